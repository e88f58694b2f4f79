"""Gated DeltaNet over a flat varlen batch: the causal conv and the gated delta rule, one launch each.

The rows of a batch are the tokens of several sequences back to back (`query_start` [seqs + 1] int32 holds
their offsets); each sequence continues the conv and recurrent state in its slot (`state_slots` [seqs]) and
leaves its new state there. A decode row is a sequence of length one; a prompt chunk is a longer one.

Every program works on one sequence only and its arithmetic is fixed by the model's sizes, never by the
batch: a sequence's outputs and state are bit-identical alone or batched. Sequence bounds and slots are read
inside the kernels, so nothing synchronises with the host and the launches can be captured in a CUDA graph.

`gated_delta_rule_varlen` runs the rule token by token (decode rows). `gated_delta_rule_paged`, the engine's
entry, reads prompt chunks (sequences of more than one row) in the chunked form instead: chunks of CHUNK
tokens ending at multiples of CHUNK positions of the sequence, each folded into one triangular solve, in
parallel over chunks and heads; a second kernel then carries the state across a sequence's chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.interface import CHUNK
from app.kernels.triton_launch import follow_previous, pdl
from app.models.batch import PagedLayout

L2NORM_EPS = 1e-6
CONV_BLOCK_T = 16  # tokens per step of the conv's loop over a sequence
CONV_BLOCK_C = 128  # channels per conv program
CONV_WARPS = 4
RULE_BLOCK_V = 8  # value columns of the recurrent state per delta-rule program
RULE_WARPS = 1
PREPARE_WARPS = 8
CARRY_BLOCK_V = 32  # value columns of the state per program of the chunk-carrying kernel
CARRY_WARPS = 4
CARRY_STAGES = 1  # one chunk's fp32 tiles in shared memory at a time: two would not fit
PREPARE_PRECISION = "tf32"
SOLVE_PRECISION = "tf32"  # the chunk's triangular system (measured: tf32x3 and ieee no closer, and slower)
CARRY_PRECISION = "tf32"


@triton.jit
def _conv_state_after(
    x_ptr, state_row, start, t, c, col, keep, stride_xt, stride_xc, stride_sk, KERNEL: tl.constexpr
):
    """The conv state [BLOCK_C, STATE_PAD] after a sequence's row t (-1: before its first): its inputs
    t-(KERNEL-2) .. t, reaching back into the carried state `state_row` for positions before the sequence."""
    p = t + 2 - KERNEL + col
    from_x = tl.load(
        x_ptr + (start + p[None, :]) * stride_xt + c[:, None] * stride_xc,
        mask=keep & (p >= 0)[None, :],
        other=0.0,
    )
    from_state = tl.load(
        state_row[:, None] + (KERNEL - 1 + p)[None, :] * stride_sk, mask=keep & (p < 0)[None, :], other=0.0
    )
    return tl.where((p >= 0)[None, :], from_x.to(state_row.dtype.element_ty), from_state)


@triton.jit
def _causal_conv_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    query_start_ptr,
    slots_ptr,
    seq_lens_ptr,
    save_at_ptr,
    save_slots_ptr,
    stepwise_ptr,
    row_saves_ptr,
    channels,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_ot,
    stride_oc,
    KERNEL: tl.constexpr,
    STATE_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_SAVES: tl.constexpr,
    STEPWISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """SiLU(depthwise causal conv) of one sequence over BLOCK_C channels, then its new conv state.

    Position p of the sequence reads input p - (KERNEL-1) + j for tap j; negative positions come from the
    carried state, whose column KERNEL-1+p holds input p. With HAS_SAVES, a sequence with a `save_at`
    position also leaves the conv state there in its save slot (a checkpoint); with STEPWISE, a stepwise
    sequence (`stepwise`) leaves the conv state after each of its rows that has a save slot (`row_saves`)
    in that slot.
    """
    follow_previous(PDL)
    seq = tl.program_id(0)
    start = tl.load(query_start_ptr + seq).to(tl.int64)
    length = tl.load(query_start_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    state_row = state_ptr + slot * stride_ss + c * stride_sc  # [BLOCK_C]
    state_ty = state_ptr.dtype.element_ty
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = (t < length)[:, None] & c_ok[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            p = (t - (KERNEL - 1) + j)[:, None]
            from_x = tl.load(
                x_ptr + (start + p) * stride_xt + c[None, :] * stride_xc, mask=live & (p >= 0), other=0.0
            )
            from_state = tl.load(
                state_row[None, :] + (KERNEL - 1 + p) * stride_sk, mask=live & (p < 0), other=0.0
            )
            tap = tl.where(p >= 0, from_x.to(state_ty), from_state).to(tl.float32)
            weight = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
            acc += tap * weight[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + (start + t[:, None]) * stride_ot + c[None, :] * stride_oc,
            out.to(out_ptr.dtype.element_ty),
            mask=live,
        )
    # The new state: the last KERNEL-1 inputs, reaching back into the old state for short sequences.
    col = tl.arange(0, STATE_PAD)
    keep = c_ok[:, None] & (col < KERNEL - 1)[None, :]
    strides = stride_xt, stride_xc, stride_sk
    new_state = _conv_state_after(x_ptr, state_row, start, length - 1, c, col, keep, *strides, KERNEL)
    kept = state_ptr + c[:, None] * stride_sc + col[None, :] * stride_sk  # a slot's state, less its offset
    if HAS_SAVES:
        save_at = tl.load(save_at_ptr + seq)
        if save_at > 0:
            t = save_at - (tl.load(seq_lens_ptr + seq) - length) - 1  # the row before position save_at
            saved = _conv_state_after(x_ptr, state_row, start, t, c, col, keep, *strides, KERNEL)
            tl.store(kept + tl.load(save_slots_ptr + seq) * stride_ss, saved, mask=keep)
    if STEPWISE:  # noqa: SIM102 (a constexpr branch: without it the flags are never read)
        if tl.load(stepwise_ptr + seq) != 0:
            for t in range(0, length):
                target = tl.load(row_saves_ptr + start + t)
                if target >= 0:
                    saved = _conv_state_after(x_ptr, state_row, start, t, c, col, keep, *strides, KERNEL)
                    tl.store(kept + target * stride_ss, saved, mask=keep)
    # Every thread has read the old state (above) before any thread overwrites it.
    tl.debug_barrier()
    tl.store(state_row[:, None] + col[None, :] * stride_sk, new_state, mask=keep)


@triton.jit
def rule_token(state, q, k, v, decay, beta, scale, eps):
    """One token of the gated delta rule on a [DK, BLOCK_V] fp32 slice of the state: q and k (fp32 [DK], raw)
    l2-normalised here (q also scaled), the state decayed, corrected towards v by beta, then read by q.
    Returns the new slice and its output [BLOCK_V]."""
    q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
    state = state * decay
    predicted = tl.sum(state * k[:, None], 0)
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], 0)


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    query_start_ptr,
    slots_ptr,
    stepwise_ptr,
    row_saves_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    eps,
    HEAD_RATIO: tl.constexpr,
    DK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SINGLE_ROWS_ONLY: tl.constexpr,
    STEPWISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """The gated delta rule of one sequence and value head over BLOCK_V value columns, token by token.

    The [DK, BLOCK_V] slice of the state stays in registers in fp32 for the whole sequence; q and k are
    l2-normalised here (q also scaled), value head h reading key head h // HEAD_RATIO. With
    SINGLE_ROWS_ONLY, sequences of more than one row are left to the chunked kernels, except (with STEPWISE)
    stepwise ones (`stepwise`), whose rows are read one by one as decode rows are. With STEPWISE, the state
    after each row that has a save slot (`row_saves`) is also stored in that slot.
    """
    follow_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k_head = head // HEAD_RATIO
    start = tl.load(query_start_ptr + seq).to(tl.int64)
    end = tl.load(query_start_ptr + seq + 1).to(tl.int64)
    if SINGLE_ROWS_ONLY and end - start > 1:
        if not STEPWISE:
            return
        if tl.load(stepwise_ptr + seq) == 0:
            return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    state_base = state_ptr + slot * stride_ss + head * stride_sh
    state = tl.load(state_base + dk[:, None] * stride_sk + dv[None, :] * stride_sv)
    q_row = q_ptr + k_head * stride_qh + dk * stride_qd
    k_row = k_ptr + k_head * stride_kh + dk * stride_kd
    v_row = v_ptr + head * stride_vh + dv * stride_vd
    out_row = out_ptr + head * stride_oh + dv * stride_od
    g_row = g_ptr + head * stride_gh
    beta_row = beta_ptr + head * stride_bh
    # Token t's inputs are loaded during step t-1, so their latency overlaps the previous step's arithmetic.
    # Row indices are clamped into the batch instead of masked: past the sequence's end they are unused.
    last = tl.maximum(end - 1, 0)
    row = tl.minimum(start, last)
    next_q = tl.load(q_row + row * stride_qt)
    next_k = tl.load(k_row + row * stride_kt)
    next_v = tl.load(v_row + row * stride_vt)
    next_g = tl.load(g_row + row * stride_gt)
    next_beta = tl.load(beta_row + row * stride_bt)
    for t in range(start, end):
        q = next_q.to(tl.float32)
        k = next_k.to(tl.float32)
        v = next_v.to(tl.float32)
        decay = tl.exp(next_g.to(tl.float32))
        beta = next_beta.to(tl.float32)
        row = tl.minimum(t + 1, last)
        next_q = tl.load(q_row + row * stride_qt)
        next_k = tl.load(k_row + row * stride_kt)
        next_v = tl.load(v_row + row * stride_vt)
        next_g = tl.load(g_row + row * stride_gt)
        next_beta = tl.load(beta_row + row * stride_bt)
        state, out = rule_token(state, q, k, v, decay, beta, scale, eps)
        tl.store(out_row + t * stride_ot, out)
        if STEPWISE:
            target = tl.load(row_saves_ptr + t)
            if target >= 0:
                saved = state_ptr + target * stride_ss + head * stride_sh
                tl.store(saved + dk[:, None] * stride_sk + dv[None, :] * stride_sv, state)
    # Every thread has read the old state before any thread overwrites it.
    tl.debug_barrier()
    tl.store(state_base + dk[:, None] * stride_sk + dv[None, :] * stride_sv, state)


@triton.jit
def _chunk_bounds(past, length, chunk, C: tl.constexpr):
    """Positions [lo, hi) of a sequence's `chunk`-th chunk and `base`, the multiple of C where it starts."""
    base = (past // C + chunk) * C
    lo = tl.maximum(past, base)
    hi = tl.minimum(past + length, base + C)
    return base, lo, hi


@triton.jit
def _chunk_prepare_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    w_ptr,
    u_ptr,
    qd_ptr,
    kd_ptr,
    inner_ptr,
    decay_ptr,
    query_start_ptr,
    seq_lens_ptr,
    stepwise_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    v_heads,
    scale,
    eps,
    HEAD_RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    LOG2_C: tl.constexpr,
    PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
    STEPWISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Everything of one chunk and value head that does not need the state carried into the chunk.

    Tile row i holds position base + i of the sequence; rows outside [lo, hi) are zero. With the chunk's
    cumulative log decay G, the triangular system T = (I + L)^-1, L[i, j] = beta_i (k_i . k_j) e^(G_i - G_j)
    for j < i, gives w = T (beta e^G k) and u = T (beta v); the kernel also stores q e^G (q scaled),
    k e^(G_end - G), the causal score matrix (q_i . k_j) e^(G_i - G_j) for j <= i, and G_end per row.
    All workspace tensors are [tokens, v_heads, ...] fp32, indexed by the rows of the batch.
    """
    follow_previous(PDL)
    seq = tl.program_id(0)
    chunk = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(query_start_ptr + seq)
    length = tl.load(query_start_ptr + seq + 1) - start
    past = tl.load(seq_lens_ptr + seq) - length
    base, lo, hi = _chunk_bounds(past, length, chunk, C)
    if (length <= 1) | (lo >= hi):
        return
    if STEPWISE:  # noqa: SIM102 (a constexpr branch: without it the flags are never read)
        if tl.load(stepwise_ptr + seq) != 0:  # read token by token
            return
    i = tl.arange(0, C)
    live = (base + i >= lo) & (base + i < hi)
    row = tl.where(live, start + base + i - past, start).to(tl.int64)
    k_head = head // HEAD_RATIO
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + k_head * stride_qh + dk[None, :] * stride_qd,
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    k = tl.load(
        k_ptr + row[:, None] * stride_kt + k_head * stride_kh + dk[None, :] * stride_kd,
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    v = tl.load(
        v_ptr + row[:, None] * stride_vt + head * stride_vh + dv[None, :] * stride_vd,
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + head * stride_gh, mask=live, other=0.0)
    beta = tl.load(beta_ptr + row * stride_bt + head * stride_bh, mask=live, other=0.0)
    q = q * (tl.math.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
    k = k * tl.math.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    decay = tl.cumsum(g, 0)
    decay_end = tl.sum(tl.where(i == hi - base - 1, decay, 0.0), 0)
    below = i[:, None] >= i[None, :]
    pair = tl.where(below, tl.exp(tl.where(below, decay[:, None] - decay[None, :], 0.0)), 0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    lower = tl.where(i[:, None] > i[None, :], kk * pair * beta[:, None], 0.0)
    # L is nilpotent (L^C = 0), so (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...(I + L^(C/2)): log2(C) squarings.
    power = -lower
    solve = tl.where(i[:, None] == i[None, :], 1.0, 0.0) + power
    for _ in tl.static_range(LOG2_C - 1):
        power = tl.dot(power, power, input_precision=SOLVE_PRECISION)
        solve += tl.dot(solve, power, input_precision=SOLVE_PRECISION)
    w = tl.dot(solve, k * (beta * tl.exp(decay))[:, None], input_precision=PRECISION)
    u = tl.dot(solve, v * beta[:, None], input_precision=PRECISION)
    scores = tl.where(below, tl.dot(q, tl.trans(k), input_precision=PRECISION) * pair, 0.0)
    out_k = row[:, None] * (v_heads * DK) + head * DK + dk[None, :]
    store = live[:, None]
    tl.store(w_ptr + out_k, w, mask=store)
    tl.store(qd_ptr + out_k, q * tl.exp(decay)[:, None], mask=store)
    tl.store(kd_ptr + out_k, k * tl.exp(decay_end - decay)[:, None], mask=store)
    tl.store(u_ptr + row[:, None] * (v_heads * DV) + head * DV + dv[None, :], u, mask=store)
    tl.store(inner_ptr + row[:, None] * (v_heads * C) + head * C + i[None, :], scores, mask=store)
    tl.store(decay_ptr + row * v_heads + head, tl.full((C,), 0.0, tl.float32) + decay_end, mask=live)


@triton.jit
def _chunk_carry_kernel(
    w_ptr,
    u_ptr,
    qd_ptr,
    kd_ptr,
    inner_ptr,
    decay_ptr,
    state_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    slots_ptr,
    save_at_ptr,
    save_slots_ptr,
    stepwise_ptr,
    v_heads,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_ot,
    stride_oh,
    stride_od,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SAVES: tl.constexpr,
    STEPWISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One sequence's chunks in order for one value head and BLOCK_V value columns of the state.

    Per chunk: the new values u - w S, the outputs (q e^G) S + scores (u - w S), and the state carried to the
    chunk's end, S e^G_end + (k e^(G_end - G))^T (u - w S). With HAS_SAVES, the state at the end of the chunk
    that ends at the sequence's `save_at` position is also stored in its save slot (a checkpoint).
    """
    follow_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(query_start_ptr + seq)
    length = tl.load(query_start_ptr + seq + 1) - start
    if length <= 1:
        return
    if STEPWISE:  # noqa: SIM102 (a constexpr branch: without it the flags are never read)
        if tl.load(stepwise_ptr + seq) != 0:  # read token by token
            return
    past = tl.load(seq_lens_ptr + seq) - length
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    i = tl.arange(0, C)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    state_base = state_ptr + slot * stride_ss + head * stride_sh
    state = tl.load(state_base + dk[:, None] * stride_sk + dv[None, :] * stride_sv)
    save_at = -1
    save_base = state_base
    if HAS_SAVES:
        save_at = tl.load(save_at_ptr + seq)
        save_slot = tl.maximum(tl.load(save_slots_ptr + seq), 0)
        save_base = state_ptr + save_slot * stride_ss + head * stride_sh
    chunks = (past + length - 1) // C - past // C + 1
    for chunk in range(chunks):
        base, lo, hi = _chunk_bounds(past, length, chunk, C)
        live = (base + i >= lo) & (base + i < hi)
        row = tl.where(live, start + base + i - past, start).to(tl.int64)
        at_k = row[:, None] * (v_heads * DK) + head * DK + dk[None, :]
        w = tl.load(w_ptr + at_k, mask=live[:, None], other=0.0)
        qd = tl.load(qd_ptr + at_k, mask=live[:, None], other=0.0)
        kd = tl.load(kd_ptr + at_k, mask=live[:, None], other=0.0)
        at_v = row[:, None] * (v_heads * DV) + head * DV + dv[None, :]
        u = tl.load(u_ptr + at_v, mask=live[:, None], other=0.0)
        scores = tl.load(
            inner_ptr + row[:, None] * (v_heads * C) + head * C + i[None, :], mask=live[:, None], other=0.0
        )
        decay_end = tl.load(decay_ptr + (start + lo - past).to(tl.int64) * v_heads + head)
        fresh = u - tl.dot(w, state, input_precision=PRECISION)
        out = tl.dot(qd, state, input_precision=PRECISION) + tl.dot(scores, fresh, input_precision=PRECISION)
        tl.store(
            out_ptr + row[:, None] * stride_ot + head * stride_oh + dv[None, :] * stride_od,
            out,
            mask=live[:, None],
        )
        state = state * tl.exp(decay_end) + tl.dot(tl.trans(kd), fresh, input_precision=PRECISION)
        if HAS_SAVES:
            at = tl.full((DK, BLOCK_V), 0, tl.int32) + hi.to(tl.int32)
            tl.store(save_base + dk[:, None] * stride_sk + dv[None, :] * stride_sv, state, mask=at == save_at)
    # Every thread has read the old state before any thread overwrites it.
    tl.debug_barrier()
    tl.store(state_base + dk[:, None] * stride_sk + dv[None, :] * stride_sv, state)


def _check_layout(query_start: torch.Tensor, state_slots: torch.Tensor) -> int:
    """The number of sequences, after checking the layout tensors' shapes and types."""
    if query_start.dim() != 1 or query_start.dtype != torch.int32:
        raise ValueError("query_start must be a 1-d int32 tensor of seqs + 1 offsets")
    seqs = query_start.shape[0] - 1
    if state_slots.shape != (seqs,) or state_slots.dtype != torch.int64:
        raise ValueError("state_slots must be a 1-d int64 tensor with one slot per sequence")
    return seqs


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
    layout: PagedLayout | None = None,
) -> torch.Tensor:
    """SiLU of the depthwise causal conv of every sequence in a flat batch, continuing each one's state.

    x [tokens, channels] (the mixed qkv projections); weight [channels, kernel]; conv_state
    [slots, channels, kernel-1], where each sequence's slot is read and then overwritten in place with its
    last kernel-1 inputs; query_start [seqs + 1] int32; state_slots [seqs] int64. With the batch's
    `layout` (whose rows and slots those are), a sequence with a `save_at` position also leaves the conv
    state there in its save slot, and each row of a stepwise sequence that has a row save leaves the conv
    state after it there (what the sequence's slot would hold had it ended at that row). Returns
    [tokens, channels] in the dtype of x: per sequence `causal_conv`, accumulated in fp32.
    """
    seqs = _check_layout(query_start, state_slots)
    channels, kernel = weight.shape
    if kernel < 2 or x.shape[1] != channels or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError("x, weight and conv_state disagree on channels or kernel size")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if seqs == 0 or x.shape[0] == 0:
        return out
    saving = layout is not None and layout.save_at is not None and layout.save_slots is not None
    stepping = layout is not None and layout.stepwise is not None and layout.row_saves is not None
    grid = (seqs, triton.cdiv(channels, CONV_BLOCK_C))
    _causal_conv_kernel[grid](
        x,
        weight,
        conv_state,
        out,
        query_start,
        state_slots,
        layout.seq_lens if saving else query_start,
        layout.save_at if saving else query_start,
        layout.save_slots if saving else state_slots,
        layout.stepwise if stepping else query_start,
        layout.row_saves if stepping else state_slots,
        channels,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        out.stride(0),
        out.stride(1),
        KERNEL=kernel,
        STATE_PAD=triton.next_power_of_2(kernel - 1),
        BLOCK_T=CONV_BLOCK_T,
        BLOCK_C=CONV_BLOCK_C,
        HAS_SAVES=saving,
        STEPWISE=stepping,
        num_warps=CONV_WARPS,
        **pdl(x.device, grid),
    )
    return out


def _check_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> None:
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != tokens or v_heads % k_heads != 0:
        raise ValueError("q, k and v disagree on tokens or heads")
    if g.shape != (tokens, v_heads) or beta.shape != (tokens, v_heads):
        raise ValueError("g and beta must be [tokens, v_heads]")
    if state.shape[1:] != (v_heads, dk, dv) or state.dtype != torch.float32:
        raise ValueError("state must be fp32 [slots, v_heads, dk, dv]")
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError("head dimensions must be powers of two")


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule of every sequence in a flat batch, token by token, continuing each one's state.

    q, k [tokens, k_heads, dk] raw (l2-normalised here, q also scaled by dk**-0.5); v [tokens, v_heads, dv],
    value head h reading key head h // (v_heads // k_heads); g (log decay), beta [tokens, v_heads] fp32;
    state [slots, v_heads, dk, dv] fp32, each sequence's slot read and then overwritten in place with its
    final state; query_start [seqs + 1] int32; state_slots [seqs] int64. Any of the inputs may be strided
    views. Returns [tokens, v_heads, dv] fp32: per sequence `delta_rule_recurrent` to fp32 rounding.
    A sequence of no rows leaves its state as it was.
    """
    seqs = _check_layout(query_start, state_slots)
    _check_rule_inputs(q, k, v, g, beta, state)
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    _step_rows(q, k, v, g, beta, state, out, query_start, state_slots, seqs, single_rows_only=False)
    return out


def gated_delta_rule_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: PagedLayout,
) -> torch.Tensor:
    """The gated delta rule of a paged batch: single rows token by token, longer sequences in chunks.

    Inputs and state as for `gated_delta_rule_varlen`; the layout gives each sequence's rows
    (`query_start`), its position (`seq_lens` minus its rows) and its state slot. A sequence of several rows
    is read in chunks ending at multiples of CHUNK positions (`delta_rule_chunked` with its offset, to fp32
    rounding), so a prompt read in pieces cut at those multiples is computed as in one piece. A sequence
    with a `save_at` position in the layout also leaves its recurrent state there in its save slot (the
    caller saves the conv state). The layout's stepwise sequences (`stepwise`) are read token by token
    whatever their length, as that many decode rows would be, each row with a save slot (`row_saves`)
    leaving the state after it there.
    """
    query_start, state_slots = layout.query_start, layout.state_slots
    seqs = _check_layout(query_start, state_slots)
    _check_rule_inputs(q, k, v, g, beta, state)
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(tokens, v_heads, dv, dtype=torch.float32, device=v.device)
    chunked = layout.max_query_len > 1
    if chunked and seqs:
        w, qd, kd, u, inner, decay = (
            torch.empty(tokens, v_heads, width, dtype=torch.float32, device=v.device)
            for width in (dk, dk, dk, dv, CHUNK, 1)
        )
        max_chunks = triton.cdiv(layout.max_query_len, CHUNK) + 1
        grid = (seqs, max_chunks, v_heads)
        _chunk_prepare_kernel[grid](
            q,
            k,
            v,
            g,
            beta,
            w,
            u,
            qd,
            kd,
            inner,
            decay,
            query_start,
            layout.seq_lens,
            layout.stepwise if layout.stepwise is not None else query_start,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *g.stride(),
            *beta.stride(),
            v_heads,
            dk**-0.5,
            L2NORM_EPS,
            HEAD_RATIO=v_heads // k_heads,
            DK=dk,
            DV=dv,
            C=CHUNK,
            LOG2_C=CHUNK.bit_length() - 1,
            PRECISION=PREPARE_PRECISION,
            SOLVE_PRECISION=SOLVE_PRECISION,
            STEPWISE=layout.stepwise is not None,
            num_warps=PREPARE_WARPS,
            **pdl(q.device, grid),
        )
        block_v = min(dv, CARRY_BLOCK_V)
        grid = (seqs, v_heads, dv // block_v)
        _chunk_carry_kernel[grid](
            w,
            u,
            qd,
            kd,
            inner,
            decay,
            state,
            out,
            query_start,
            layout.seq_lens,
            state_slots,
            layout.save_at if layout.save_at is not None else query_start,
            layout.save_slots if layout.save_slots is not None else state_slots,
            layout.stepwise if layout.stepwise is not None else query_start,
            v_heads,
            *state.stride(),
            *out.stride(),
            DK=dk,
            DV=dv,
            BLOCK_V=block_v,
            C=CHUNK,
            PRECISION=CARRY_PRECISION,
            HAS_SAVES=layout.save_at is not None,
            STEPWISE=layout.stepwise is not None,
            num_warps=CARRY_WARPS,
            num_stages=CARRY_STAGES,
            **pdl(w.device, grid),
        )
    stepwise = None
    if layout.stepwise is not None and layout.row_saves is not None:
        stepwise = (layout.stepwise, layout.row_saves)
    _step_rows(q, k, v, g, beta, state, out, query_start, state_slots, seqs, chunked, stepwise)
    return out


def _step_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
    seqs: int,
    single_rows_only: bool,
    stepwise: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The token-by-token kernel over the batch's sequences (only its single rows and the sequences flagged
    in `stepwise`'s first tensor, if asked), into `out`; rows with a slot in its second leave their state
    there."""
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    if seqs == 0 or tokens == 0:
        return
    block_v = min(dv, RULE_BLOCK_V)
    grid = (seqs, v_heads, dv // block_v)
    _gated_delta_rule_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        query_start,
        state_slots,
        stepwise[0] if stepwise is not None else query_start,
        stepwise[1] if stepwise is not None else state_slots,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g.stride(),
        *beta.stride(),
        *state.stride(),
        *out.stride(),
        dk**-0.5,
        L2NORM_EPS,
        HEAD_RATIO=v_heads // k_heads,
        DK=dk,
        BLOCK_V=block_v,
        SINGLE_ROWS_ONLY=single_rows_only,
        STEPWISE=stepwise is not None,
        num_warps=RULE_WARPS,
        **pdl(q.device, grid),
    )
