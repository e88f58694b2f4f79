"""Fused RMSNorm kernels: plain, with the residual add, gated, and QK-norm with rotary embedding.

Each public function is one Triton launch that replaces a chain of small torch kernels and reproduces the
torch reference's rounding steps (`RMSNorm`, `GatedRMSNorm`, `apply_rotary` in `app.models.layers`):
statistics in fp32, intermediate results rounded to the model dtype exactly where the reference rounds them.
Only the order of the fp32 sum of squares (and, in Triton's interpreter, the exp of the SiLU gate) may differ
from the reference: fp32 results then move by a few units in the last place, 16-bit results rarely by one.

Every program handles one row (or one head of one token), and its tile size and warp count follow from the
row length alone, so a row's result is bit-identical whether it is computed alone or in any batch. Grids come
from tensor shapes only and nothing reads back to the host, so the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from app.kernels import kv_quant
from app.kernels.interface import Picks
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_moe import picks_sum

MAX_DIM = 65536  # longest row one program normalises in a single tile
QUANT_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}  # 8-bit caches `_store_row` writes


def _block(dim: int) -> int:
    """The tile length for rows of `dim` elements: the next power of two."""
    if dim < 1 or dim > MAX_DIM:
        raise ValueError(f"norm dimension must be in 1..{MAX_DIM}, got {dim}")
    return triton.next_power_of_2(dim)


def _warps(block: int) -> int:
    """Warps per program, chosen from the tile length only (about 8 elements per thread)."""
    return max(1, min(16, block // 256))


@triton.jit
def _rstd(x, eps, DIM: tl.constexpr):
    """1 / sqrt(mean(x * x) + eps) of an fp32 row (masked lanes hold zeros), as the reference computes it."""
    mean = tl.math.div_rn(tl.sum(x * x, 0), DIM * 1.0)
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _scale(x, weight, rstd, OFFSET: tl.constexpr, out_ty: tl.constexpr):
    """`RMSNorm`'s output in `out_ty` from the fp32 row x, its weight and its rstd."""
    normed = x * rstd
    if OFFSET:
        out = normed * (1.0 + weight.to(tl.float32))
    else:
        out = weight.to(tl.float32) * normed.to(out_ty).to(tl.float32)
    return out.to(out_ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    ids_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    OFFSET: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PICKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """RMSNorm of one row; with ADD_RESIDUAL the row is residual + x, which is also stored. With PICKS (a
    token's picks, `interface.Picks`) x is the sum of the token's PICKS rows of x whose ids are not negative,
    in choice order in fp32, rounded to x's dtype (as `triton_moe.sum_picks` stores it)."""
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    live = col < DIM
    out_ty = out_ptr.dtype.element_ty
    if PICKS:
        x = picks_sum(x_ptr, ids_ptr, row, stride_x, col, live, PICKS, BLOCK)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + col, mask=live, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        res = tl.load(res_ptr + row * stride_r + col, mask=live, other=0.0).to(tl.float32)
        total = (res + x).to(out_ty)
        tl.store(res_out_ptr + row * stride_ro + col, total, mask=live)
        x = total.to(tl.float32)
    weight = tl.load(w_ptr + col, mask=live, other=0.0)
    out = _scale(x, weight, _rstd(x, eps, DIM), OFFSET, out_ty)
    tl.store(out_ptr + row * stride_o + col, out, mask=live)


@triton.jit
def torch_sigmoid(x, PRECISE: tl.constexpr):
    """torch's CUDA sigmoid of fp32 x: 1 / (1 + exp(-x)), with libdevice's accurate exp when PRECISE (Triton's
    interpreter has only its own)."""
    decay = libdevice.exp(-x) if PRECISE else tl.exp(-x)
    return tl.math.div_rn(1.0, 1.0 + decay)


@triton.jit
def gated_row(
    x,
    gate,
    weight,
    eps,
    DIM: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    out_ty: tl.constexpr,
):
    """`GatedRMSNorm` of one fp32 row x (masked lanes zero) in `out_ty`, as `_gated_rms_norm_kernel` computes
    it (also the Gated DeltaNet decode step's epilogue, app/kernels/triton_gdn_decode.py)."""
    gate = gate.to(tl.float32)
    normed = (x * _rstd(x, eps, DIM)).to(out_ty).to(tl.float32)
    product = weight.to(tl.float32) * normed
    if ROUND_PRODUCT:
        product = product.to(out_ty).to(tl.float32)
    decay = libdevice.exp(-gate) if PRECISE_EXP else tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + decay)
    return (product * silu).to(out_ty)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_g,
    stride_o,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    """`GatedRMSNorm` of one row: (weight * normed in x's dtype) * silu(gate in fp32), cast to x's dtype.

    ROUND_PRODUCT rounds weight * normed to x's dtype, as torch does when weight has x's dtype (otherwise
    that product is fp32). PRECISE_EXP takes libdevice's accurate exp, the one torch's CUDA SiLU uses, rather
    than Triton's fast approximate exp.
    """
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    live = col < DIM
    out_ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + col, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + col, mask=live, other=0.0)
    weight = tl.load(w_ptr + col, mask=live, other=0.0)
    out = gated_row(x, gate, weight, eps, DIM, ROUND_PRODUCT, PRECISE_EXP, out_ty)
    tl.store(out_ptr + row * stride_o + col, out, mask=live)


@triton.jit
def _e4m3_grid(y):
    """fp32 y (|y| <= 448) rounded half to even to e4m3's grid, as `kv_quant.e4m3_grid`."""
    exponent = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 255, 127 - 6)
    magic = ((exponent - 3) << 23).to(tl.float32, bitcast=True) * 12582912.0
    return (y + magic) - magic


@triton.jit
def _store_row(row_ptr, x, d, live, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """One token's kv head x [BLOCK_D] (0 beyond HEAD_DIM) into its cache row: as it is (QUANT 0), or as
    `kv_quant.quantize` gives it, int8 (1) or e4m3 (2) codes and then the fp32 scale's 4 bytes."""
    if QUANT == 0:
        tl.store(row_ptr + d, x.to(row_ptr.dtype.element_ty), mask=live)
    else:
        x = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-30)
        if QUANT == 1:
            scale = tl.math.div_rn(amax, 127.0)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -127.0), 127.0)
            tl.store(row_ptr + d, ((y + 12582912.0) - 12582912.0).to(tl.int8), mask=live)
        else:
            scale = tl.math.div_rn(amax, 448.0)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            tl.store(row_ptr + d, _e4m3_grid(y).to(tl.float8e4nv), mask=live)
        tl.store((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    v_ptr,
    value_cache_ptr,
    slots_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OFFSET: tl.constexpr,
    STORE: tl.constexpr,
    QUANT: tl.constexpr,
    ROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """RMSNorm then neox rotary of one head of one token; heads [0, HEADS) are q's, the rest are k's.

    The rotation partner of each rotated element (the other half of the rotary span) is loaded and normalised
    a second time with the same rstd, which yields exactly the normalised partner without any data exchange.
    With STORE, k_out is the paged key cache: a k head goes to the token's cache slot (slots[token]), and the
    same program copies the token's v head into the value cache; with QUANT both go in as 8-bit rows
    (`_store_row`).
    """
    follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    out_ty = q_out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    if head < HEADS:
        src = q_ptr + token * stride_qt + head * stride_qh
        w_ptr = qw_ptr
    else:
        src = k_ptr + token * stride_kt + (head - HEADS) * stride_kh
        w_ptr = kw_ptr
    live = d < HEAD_DIM
    rotated = d < ROTARY_DIM
    x = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
    rstd = _rstd(x, eps, HEAD_DIM)
    normed = _scale(x, tl.load(w_ptr + d, mask=live, other=0.0), rstd, OFFSET, out_ty).to(tl.float32)
    half = ROTARY_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    partner_x = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    partner_w = tl.load(w_ptr + partner, mask=rotated, other=0.0)
    partner_normed = _scale(partner_x, partner_w, rstd, OFFSET, out_ty).to(tl.float32)
    swapped = tl.where(d < half, -partner_normed, partner_normed)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=rotated, other=0.0).to(tl.float32)
    # As torch on model-dtype tensors: each product rounded to the dtype, then their sum rounded again.
    with_cos = (normed * cos).to(out_ty).to(tl.float32)
    with_sin = (swapped * sin).to(out_ty).to(tl.float32)
    out = tl.where(rotated, (with_cos + with_sin).to(out_ty), normed.to(out_ty))
    if head < HEADS:
        tl.store(q_out_ptr + (token * HEADS + head) * HEAD_DIM + d, out, mask=live)
    elif STORE:
        place = (tl.load(slots_ptr + token).to(tl.int64) * KV_HEADS + head - HEADS) * ROW
        v = tl.load(v_ptr + token * stride_vt + (head - HEADS) * stride_vh + d, mask=live, other=0.0)
        _store_row(k_out_ptr + place, out, d, live, HEAD_DIM, QUANT)
        _store_row(value_cache_ptr + place, v, d, live, HEAD_DIM, QUANT)
    else:
        tl.store(k_out_ptr + (token * KV_HEADS + head - HEADS) * HEAD_DIM + d, out, mask=live)


# Compiled kernels use libdevice's accurate exp (the CUDA reference's expf); Triton's interpreter lacks it.
_COMPILED = isinstance(_gated_rms_norm_kernel, triton.runtime.JITFunction)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as a 2-d tensor whose last dim has unit stride (copied only if it has not)."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-d [rows, dim], got shape {tuple(x.shape)}")
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _check_weight(weight: torch.Tensor, dim: int) -> torch.Tensor:
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},), got {tuple(weight.shape)}")
    return weight.contiguous()


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm of x's rows, or with `ids` [rows, top_k] of each row's sum of its picks (x: their pairs)."""
    rows, dim = x.shape if ids is None else (ids.shape[0], x.shape[1])
    block = _block(dim)
    weight = _check_weight(weight, dim)
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if rows > 0:
        res = residual if residual is not None else x
        res_dst = res_out if res_out is not None else out
        grid = (rows,)
        _rms_norm_kernel[grid](
            x,
            ids if ids is not None else x,
            res,
            weight,
            out,
            res_dst,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_dst.stride(0),
            eps,
            DIM=dim,
            BLOCK=block,
            OFFSET=offset,
            ADD_RESIDUAL=residual is not None,
            PICKS=0 if ids is None else ids.shape[1],
            num_warps=_warps(block),
            enable_fp_fusion=False,
            **pdl(x.device, grid),
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm of each row of x [rows, dim] (rows may be strided), rounded exactly as `RMSNorm.forward`.

    With `offset` the scale is (1 + weight) applied in fp32; without it the normalised row is rounded to x's
    dtype and then multiplied by weight (expected in x's dtype). Returns a new contiguous [rows, dim] tensor
    of x's dtype.
    """
    x = _rows(x, "x")
    out, _ = _launch_rms_norm(x, None, weight, eps, offset)
    return out


def add_rms_norm(
    x: torch.Tensor | Picks, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one launch; the sum is rounded to x's dtype as torch does.

    x and residual are [rows, dim] of the same dtype (either may be strided); both results are new
    contiguous tensors. x may be a MoE block's `Picks`, summed in the same launch with the bits of their
    `total()`.
    """
    ids = None
    if isinstance(x, Picks):
        x, ids = x.pairs, x.ids.contiguous()
        if x.shape[0] != ids.numel():
            raise ValueError(f"{x.shape[0]} pair rows for {ids.numel()} picks")
    x = _rows(x, "x")
    residual = _rows(residual, "residual")
    shape = x.shape if ids is None else (ids.shape[0], x.shape[1])
    if residual.shape != shape or residual.dtype != x.dtype:
        raise ValueError("residual must have x's shape and dtype")
    out, res_out = _launch_rms_norm(x, residual, weight, eps, offset, ids)
    assert res_out is not None
    return out, res_out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`GatedRMSNorm.forward` of x [rows, dim] with gate [rows, dim], in one launch with the same rounding.

    x (e.g. fp32) and gate (e.g. the model dtype) may differ in dtype, and either may be strided. The result
    is a new contiguous tensor of x's dtype.
    """
    x = _rows(x, "x")
    gate = _rows(gate, "gate")
    if gate.shape != x.shape:
        raise ValueError("gate must have x's shape")
    rows, dim = x.shape
    block = _block(dim)
    weight = _check_weight(weight, dim)
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows > 0:
        grid = (rows,)
        _gated_rms_norm_kernel[grid](
            x,
            gate,
            weight,
            out,
            x.stride(0),
            gate.stride(0),
            out.stride(0),
            eps,
            DIM=dim,
            BLOCK=block,
            ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
            PRECISE_EXP=_COMPILED,
            num_warps=_warps(block),
            enable_fp_fusion=False,
            **pdl(x.device, grid),
        )
    return out


def _heads(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as a 3-d [tokens, heads, head_dim] tensor whose last dim has unit stride."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-d [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def _checked_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The arguments of the q/k norm + rope kernels, checked, with unit last strides."""
    q = _heads(q, "q")
    k = _heads(k, "k")
    tokens, _, head_dim = q.shape
    rotary_dim = cos.shape[-1]
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError("k must be [tokens, kv_heads, head_dim] like q")
    if k.dtype != q.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError("q, k, cos and sin must share one dtype")
    if cos.shape != (tokens, rotary_dim) or sin.shape != cos.shape:
        raise ValueError("cos and sin must be [tokens, rotary_dim]")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in 2..head_dim, got {rotary_dim}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q_weight = _check_weight(q_weight, head_dim)
    k_weight = _check_weight(k_weight, head_dim)
    if k_weight.dtype != q_weight.dtype:
        raise ValueError("q_weight and k_weight must share one dtype")
    return q, k, q_weight, k_weight, cos, sin


def _launch_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v: torch.Tensor | None = None,
    value_cache: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """q normalised and rotated (new tensor); k's result into `k_out` (rows, or the key cache with `v`)."""
    tokens, heads, head_dim = q.shape
    block = _block(head_dim)
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    store = v is not None
    if tokens > 0:
        grid = (tokens, heads + k.shape[1])
        _qk_norm_rope_kernel[grid](
            q,
            k,
            q_weight,
            k_weight,
            cos,
            sin,
            q_out,
            k_out,
            v if store else q,
            value_cache if store else q,
            slots if store else q,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0) if store else 0,
            v.stride(1) if store else 0,
            cos.stride(0),
            sin.stride(0),
            eps,
            HEADS=heads,
            KV_HEADS=k.shape[1],
            HEAD_DIM=head_dim,
            ROTARY_DIM=cos.shape[-1],
            BLOCK_D=block,
            OFFSET=offset,
            STORE=store,
            QUANT=QUANT_KINDS.get(k_out.dtype, 0) if store else 0,
            ROW=kv_quant.row_width(head_dim, k_out.dtype) if store else head_dim,
            num_warps=_warps(block),
            enable_fp_fusion=False,
            **pdl(q.device, grid),
        )
    return q_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k followed by neox rotary on the first rotary_dim dims, in one launch.

    q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] may be strided views (e.g. the q half
    of a gated q_proj output); cos and sin [tokens, rotary_dim] are `RotaryEmbedding.cos_sin` tables in the
    dtype of q and k. Matches `apply_rotary(RMSNorm(head_dim, eps, offset)(q), cos, sin)` (and likewise for
    k) rounding step by rounding step. Returns new contiguous q and k of the same shapes and dtype.
    """
    q, k, q_weight, k_weight, cos, sin = _checked_qk(q, k, q_weight, k_weight, cos, sin)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch_qk_norm_rope(q, k, q_weight, k_weight, eps, offset, cos, sin, k_out), k_out


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`qk_norm_rope`, with k's result and v [tokens, kv_heads, head_dim] stored at each token's flat slot
    of the paged caches [blocks, block_size, kv_heads, head_dim] (as `write_kv`; 8-bit caches get the rows
    `kv_quant.quantize` gives) in the same launch instead of returned. Returns q."""
    q, k, q_weight, k_weight, cos, sin = _checked_qk(q, k, q_weight, k_weight, cos, sin)
    v = _heads(v, "v")
    if v.shape != k.shape:
        raise ValueError("v must be shaped like k")
    row = kv_quant.row_width(k.shape[2], key_cache.dtype)
    if key_cache.shape[2:] != (k.shape[1], row) or value_cache.shape != key_cache.shape:
        raise ValueError("the caches must be [blocks, block_size, kv_heads, head_dim] like k")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"the key cache is {key_cache.dtype} but the value cache {value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if slot_mapping.shape != (q.shape[0],):
        raise ValueError("slot_mapping must hold one slot per token")
    return _launch_qk_norm_rope(
        q, k, q_weight, k_weight, eps, offset, cos, sin, key_cache, v, value_cache, slot_mapping
    )
