"""A Gated DeltaNet layer's decode step in four launches: the two input projections, then two kernels.

A decode window holds one row per sequence. The layer's pieces spend about twenty launches on such a row
(the projections' split into q, k, v and z, the conv, the decay and write strength as a chain of torch
element-wise kernels, the delta rule, the cast and the gated norm); here, after the qkvz and ba projections:

- `_decode_inputs_kernel`, a program per (sequence, key head): the conv and SiLU of the head's q, k and v
  channels read straight from the projection's row (its per-key-head grouping), the conv state's rolling
  window updated in place, and each of its value heads' decay g and write strength beta. One program owns a
  key head's channels, so nothing else reads the conv state it overwrites.
- `_decode_rule_kernel`, a program per (sequence, value head): the delta rule's token on the head's whole
  [dk, dv] fp32 state, the output rounded to the model's dtype and gated-normed with z in the same program.

then the output projection. Every program's arithmetic is fixed by the model's sizes, so a row's result does
not depend on its window. It follows the pieces' rounding steps (conv in fp32, its output and the rule's in
the model's dtype, g and beta in fp32 with the accurate exp and log1p torch's CUDA kernels use); the sums'
order may differ, so results agree with the pieces to fp32 rounding, not bit for bit, and `--exact` keeps
the pieces (`backends.exact_backends`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from app.kernels.interface import GatedDeltaNetWeights
from app.kernels.triton_gdn import L2NORM_EPS, rule_token
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_linear import few_rows_linear
from app.kernels.triton_norm import gated_row, torch_sigmoid

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's softplus returns x itself above this
MAX_STATE = 128 * 128  # fp32 elements of the state a rule program holds (64 a thread of 8 warps)


@triton.jit
def _conv_channels(
    src_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    first,
    stride_wc,
    stride_wk,
    stride_sc,
    stride_sk,
    N: tl.constexpr,
    KERNEL: tl.constexpr,
    STATE_PAD: tl.constexpr,
):
    """SiLU(causal conv) of N channels for one new input (src [N], read as the model's dtype), from
    channel `first` of the conv weight and state; the state's window moves on by that input, in place.
    Every read comes before the barrier: a channel's lanes may sit in several threads."""
    c = tl.arange(0, N)
    state_row = state_ptr + (first + c) * stride_sc
    w_row = w_ptr + (first + c) * stride_wc
    state_ty = state_ptr.dtype.element_ty
    new = tl.load(src_ptr + c).to(state_ty)
    acc = tl.zeros((N,), dtype=tl.float32)
    for j in tl.static_range(KERNEL - 1):
        tap = tl.load(state_row + j * stride_sk).to(tl.float32)
        acc += tap * tl.load(w_row + j * stride_wk).to(tl.float32)
    acc += new.to(tl.float32) * tl.load(w_row + (KERNEL - 1) * stride_wk).to(tl.float32)
    col = tl.arange(0, STATE_PAD)
    kept = col < KERNEL - 2  # the columns that take the one after them; the last takes the new input
    later = tl.load(state_row[:, None] + (col + 1)[None, :] * stride_sk, mask=kept[None, :], other=0.0)
    window = tl.where(kept[None, :], later, new[:, None])
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + first + c, out.to(out_ptr.dtype.element_ty))
    tl.debug_barrier()
    tl.store(state_row[:, None] + col[None, :] * stride_sk, window, mask=(col < KERNEL - 1)[None, :])


@triton.jit
def _decode_inputs_kernel(
    qkvz_ptr,
    ba_ptr,
    conv_w_ptr,
    conv_state_ptr,
    dt_bias_ptr,
    a_log_ptr,
    slots_ptr,
    mixed_ptr,
    g_ptr,
    beta_ptr,
    stride_qkvz,
    stride_ba,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_mixed,
    stride_g,
    K_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PER: tl.constexpr,
    PER_PAD: tl.constexpr,
    KERNEL: tl.constexpr,
    STATE_PAD: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Key head `kh` of one decode row: its q, k and the PER value heads' v through the conv (into `mixed`,
    the conv's channel order q | k | v), and g, beta of those value heads."""
    follow_previous(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    width = 2 * DK + 2 * PER * DV  # a key head's columns of qkvz: q, k, its value heads' v, then their z
    src = qkvz_ptr + seq * stride_qkvz + kh * width
    state = conv_state_ptr + slot * stride_ss
    out = mixed_ptr + seq * stride_mixed
    key_dim = K_HEADS * DK
    channels = (stride_wc, stride_wk, stride_sc, stride_sk)
    _conv_channels(src, conv_w_ptr, state, out, kh * DK, *channels, N=DK, KERNEL=KERNEL, STATE_PAD=STATE_PAD)
    _conv_channels(
        src + DK,
        conv_w_ptr,
        state,
        out,
        key_dim + kh * DK,
        *channels,
        N=DK,
        KERNEL=KERNEL,
        STATE_PAD=STATE_PAD,
    )
    v_first = 2 * key_dim + kh * PER * DV
    _conv_channels(
        src + 2 * DK,
        conv_w_ptr,
        state,
        out,
        v_first,
        *channels,
        N=PER * DV,
        KERNEL=KERNEL,
        STATE_PAD=STATE_PAD,
    )
    j = tl.arange(0, PER_PAD)
    live = j < PER
    heads = kh * PER + j
    b = tl.load(ba_ptr + seq * stride_ba + kh * 2 * PER + j, mask=live, other=0.0).to(tl.float32)
    a = tl.load(ba_ptr + seq * stride_ba + kh * 2 * PER + PER + j, mask=live, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=live, other=0.0).to(tl.float32)
    shifted = a + tl.load(dt_bias_ptr + heads, mask=live, other=0.0).to(tl.float32)
    beta = torch_sigmoid(b, PRECISE)
    if PRECISE:  # the functions torch's CUDA kernels call
        softplus = libdevice.log1p(libdevice.exp(shifted))
        rate = libdevice.exp(a_log)
    else:
        softplus = tl.log(1.0 + tl.exp(shifted))
        rate = tl.exp(a_log)
    softplus = tl.where(shifted > SOFTPLUS_THRESHOLD, shifted, softplus)
    tl.store(g_ptr + seq * stride_g + heads, -rate * softplus, mask=live)
    tl.store(beta_ptr + seq * stride_g + heads, beta, mask=live)


@triton.jit
def _decode_rule_kernel(
    mixed_ptr,
    qkvz_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    norm_w_ptr,
    slots_ptr,
    out_ptr,
    stride_mixed,
    stride_qkvz,
    stride_g,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_out,
    scale,
    l2_eps,
    norm_eps,
    K_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PER: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Value head `h` of one decode row: the delta rule's token on its whole state (in place), the output
    rounded to the model's dtype, gated-normed with the head's z, into `out` [seqs, v_heads * DV]."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // PER
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :] * stride_sv
    # the state and the norm's weight come from no kernel of this window: read before waiting for the last
    state = tl.load(tile)
    norm_w = tl.load(norm_w_ptr + dv)
    follow_previous(PDL)
    row = mixed_ptr + seq * stride_mixed
    q = tl.load(row + kh * DK + dk).to(tl.float32)
    k = tl.load(row + K_HEADS * DK + kh * DK + dk).to(tl.float32)
    v = tl.load(row + 2 * K_HEADS * DK + h * DV + dv).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + seq * stride_g + h))
    beta = tl.load(beta_ptr + seq * stride_g + h)
    state, core = rule_token(state, q, k, v, decay, beta, scale, l2_eps)
    out_ty = out_ptr.dtype.element_ty
    z_first = kh * (2 * DK + 2 * PER * DV) + 2 * DK + PER * DV + (h % PER) * DV  # after the key head's v
    z = tl.load(qkvz_ptr + seq * stride_qkvz + z_first + dv)
    gated = gated_row(core.to(out_ty).to(tl.float32), z, norm_w, norm_eps, DV, ROUND_PRODUCT, PRECISE, out_ty)
    tl.store(out_ptr + seq * stride_out + h * DV + dv, gated)
    # Every thread has read the old state before any thread overwrites it.
    tl.debug_barrier()
    tl.store(tile, state)


_COMPILED = isinstance(_decode_rule_kernel, triton.runtime.JITFunction)  # the interpreter lacks libdevice


def _takes(
    x: torch.Tensor, w: GatedDeltaNetWeights, conv_state: torch.Tensor, recurrent: torch.Tensor
) -> bool:
    """Whether the kernels take these tensors (else the layer runs its pieces)."""
    dims = (w.dk, w.dv, w.v_heads // w.k_heads * w.dv)
    if any(d & (d - 1) for d in dims) or w.dk * w.dv > MAX_STATE or w.v_heads % w.k_heads:
        return False
    if recurrent.dtype != torch.float32 or w.conv.shape[1] < 2:
        return False
    small = (x, w.conv, w.dt_bias, w.a_log, w.norm)
    return all(t.device == recurrent.device for t in small) and w.norm.is_contiguous()


def gdn_decode(
    x: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_state: torch.Tensor,
    recurrent: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor | None:
    """`Backends.gdn_decode` on the Triton set: the layer's step for a window of one decode row per sequence
    (x [seqs, hidden], row i continuing the state in slot state_slots[i]; the conv pool [slots, channels,
    kernel-1] and the recurrent pool [slots, v_heads, dk, dv] fp32 updated in place) in four launches. None
    where the kernels do not take these tensors (head sizes not powers of two, a state too large for one
    program), and the layer runs its pieces."""
    w = weights
    if not _takes(x, w, conv_state, recurrent):
        return None
    seqs = x.shape[0]
    per = w.v_heads // w.k_heads
    qkvz = few_rows_linear(x, w.qkvz)
    ba = few_rows_linear(x, w.ba)
    conv_dim = 2 * w.k_heads * w.dk + w.v_heads * w.dv
    mixed = qkvz.new_empty(seqs, conv_dim)
    g = torch.empty(seqs, w.v_heads, dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    core = x.new_empty(seqs, w.v_heads * w.dv)
    if seqs:
        grid = (seqs, w.k_heads)
        _decode_inputs_kernel[grid](
            qkvz,
            ba,
            w.conv,
            conv_state,
            w.dt_bias,
            w.a_log,
            state_slots,
            mixed,
            g,
            beta,
            qkvz.stride(0),
            ba.stride(0),
            w.conv.stride(0),
            w.conv.stride(1),
            *conv_state.stride(),
            mixed.stride(0),
            g.stride(0),
            K_HEADS=w.k_heads,
            DK=w.dk,
            DV=w.dv,
            PER=per,
            PER_PAD=triton.next_power_of_2(per),
            KERNEL=w.conv.shape[1],
            STATE_PAD=triton.next_power_of_2(w.conv.shape[1] - 1),
            PRECISE=_COMPILED,
            num_warps=4,
            **pdl(x.device, grid),
        )
        grid = (seqs, w.v_heads)
        _decode_rule_kernel[grid](
            mixed,
            qkvz,
            g,
            beta,
            recurrent,
            w.norm,
            state_slots,
            core,
            mixed.stride(0),
            qkvz.stride(0),
            g.stride(0),
            *recurrent.stride(),
            core.stride(0),
            w.dk**-0.5,
            L2NORM_EPS,
            w.eps,
            K_HEADS=w.k_heads,
            DK=w.dk,
            DV=w.dv,
            PER=per,
            ROUND_PRODUCT=torch.promote_types(w.norm.dtype, x.dtype) == x.dtype,
            PRECISE=_COMPILED,
            num_warps=max(1, min(8, w.dk * w.dv // 2048)),
            **pdl(x.device, grid),
        )
    return few_rows_linear(core, w.out)
