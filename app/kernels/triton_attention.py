"""Paged causal attention over a flat varlen batch: prompt chunks and decode rows in one kernel launch.

The rows of a batch are the new tokens of several sequences back to back (`PagedLayout.query_start`); their
keys and values are already in the paged cache, so each sequence reads all of its keys through its block
table. Query heads that share a kv head are packed into the rows of one tile, so a decode row of a model
with 8 query heads per kv head still feeds tensor cores with 16 rows or more, and every K/V tile is loaded
once for the whole group.

Two paths share the main kernel, chosen per sequence by its own length:

- a prompt chunk (more than one row) is cut into tiles of BLOCK_Q tokens; each program walks the keys its
  tile can see, block by block from position 0, with an online softmax;
- a decode row is split over the keys, so that a few long decodes still fill the GPU: program `part` of
  SPLITS reads key tiles part, part + SPLITS, ... and leaves an unnormalised partial result, which a small
  second kernel (launched for every batch, a no-op for prompt chunks) merges in partition order.

Batch invariance: the tiles (BLOCK_Q, the key steps, SPLITS, warps) follow only the head size, the group
size and the element size, never the batch; the key walk of a row and the partitions of a decode row are
fixed by positions. A row is therefore bit-identical alone or batched with any other sequences. Sequence
bounds are read inside the kernels and the grids are sized from shapes and the host int `max_query_len`, so
nothing synchronises with the host and the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from app.kernels import kv_quant
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_norm import torch_sigmoid
from app.models.batch import PagedLayout

LOG2E = 1.4426950408889634
MIN_DOT = 16  # the smallest tile side tl.dot takes


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one kernel specialisation; they may follow the model's shapes, never the batch.

    block_m: rows of a prompt tile (block_m // group_pad tokens times group_pad heads); block_kv: keys per
    step of a prompt tile's walk; dec_kv: keys per step of a decode partition; splits: partitions of a
    decode row; warps and stages: of the main kernel.
    """

    block_m: int
    block_kv: int
    dec_kv: int
    splits: int
    warps: int
    stages: int


def tile_config(head_dim: int, group: int, element_size: int) -> TileConfig:
    """The tiles for a head size, a number of query heads per kv head and the bytes of one element."""
    group_pad = triton.next_power_of_2(group)
    warps = 4 if head_dim <= 64 else 8
    if element_size > 2:  # fp32 runs on CUDA cores: small tiles keep it out of local memory
        block_m, block_kv, dec_kv = 32, 32, min(64, 8192 // head_dim)
    else:
        block_m, block_kv, dec_kv = (128 if head_dim <= 128 else 64), 64, min(128, 16384 // head_dim)
    return TileConfig(
        block_m=max(block_m, group_pad, MIN_DOT),
        block_kv=block_kv,
        dec_kv=max(dec_kv, MIN_DOT),
        splits=32,
        warps=warps,
        stages=2,
    )


@triton.jit
def _row_scales(rows, ok, HEAD_DIM: tl.constexpr):
    """The fp32 scales of 8-bit cache rows (`kv_quant`) at `rows`: the 4 bytes after each row's codes."""
    return tl.load((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)


@triton.jit
def _online_step(
    q,
    acc,
    m_i,
    l_i,
    k_rows,
    v_rows,
    d,
    ok,
    seen,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of keys and values (rows at `k_rows`, `v_rows`) folded into a row block's online softmax:
    (acc, running max, running sum) after it. With MASKED, rows not `ok` read as zeros and scores not `seen`
    are -inf. An 8-bit tile's codes are dotted as they are (exact in q's dtype), each key's scale applied to
    its scores and each value's to its probabilities."""
    if MASKED:
        k = tl.load(k_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    else:
        k = tl.load(k_rows[:, None] + d[None, :])
        v = tl.load(v_rows[:, None] + d[None, :])
    if SCALED:
        k_scale = _row_scales(k_rows, ok, HEAD_DIM)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p = p * _row_scales(v_rows, ok, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _output(out, gate_ptrs, mask, GATED: tl.constexpr, PRECISE: tl.constexpr, out_ty: tl.constexpr):
    """Attention's fp32 output in `out_ty`; with GATED times the sigmoid of the gate at `gate_ptrs`, rounded
    as the layer's pieces round (the output, the sigmoid and the product each in the model's dtype)."""
    if GATED:
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        scale = torch_sigmoid(gate, PRECISE).to(out_ty).to(tl.float32)
        return (out.to(out_ty).to(tl.float32) * scale).to(out_ty)
    return out.to(out_ty)


@triton.jit
def _prompt_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_row_ptr,
    q_start,
    q_len,
    seq_len,
    tile,
    kv_head,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    gate_ptr,
    stride_gt,
    stride_gh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    GATED: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One tile of a prompt chunk: BLOCK_M // GROUP_PAD tokens times the group's heads, over its keys.

    Keys before the tile's first position are seen by every row and need no mask; the rest are masked
    causally. Rows past the chunk or past the group read zeros and are not stored.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = tile * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (token < q_len) & (g < GROUP)
    past = seq_len - q_len
    row_pos = past + tl.minimum(token, q_len - 1)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    row_t = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    cols = tl.arange(0, BLOCK_KV)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    unmasked_end = (past + tile * BLOCK_Q) // BLOCK_KV * BLOCK_KV
    kv_end = past + tl.minimum((tile + 1) * BLOCK_Q, q_len)

    for start in range(0, unmasked_end, BLOCK_KV):
        pos = start + cols
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_rows = k_head + block * stride_kb + offset * stride_ks
        v_rows = v_head + block * stride_vb + offset * stride_vs
        acc, m_i, l_i = _online_step(
            q,
            acc,
            m_i,
            l_i,
            k_rows,
            v_rows,
            d,
            pos < kv_end,
            None,
            qk_scale,
            HEAD_DIM,
            PRECISION,
            SCALED,
            False,
        )

    for start in range(unmasked_end, kv_end, BLOCK_KV):
        pos = start + cols
        pos_ok = pos < kv_end
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_rows = k_head + block * stride_kb + offset * stride_ks
        v_rows = v_head + block * stride_vb + offset * stride_vs
        seen = pos[None, :] <= row_pos[:, None]
        acc, m_i, l_i = _online_step(
            q, acc, m_i, l_i, k_rows, v_rows, d, pos_ok, seen, qk_scale, HEAD_DIM, PRECISION, SCALED, True
        )

    out = acc / l_i[:, None]
    gates = gate_ptr + row_t[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :]
    tl.store(
        out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        _output(out, gates, row_ok[:, None], GATED, PRECISE, out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def _decode_partition(
    q_ptr,
    k_ptr,
    v_ptr,
    part_acc_ptr,
    part_ml_ptr,
    table_row_ptr,
    seq,
    q_start,
    seq_len,
    part,
    kv_head,
    heads,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    DEC_M: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Partition `part` of a decode row: key tiles part, part + SPLITS, ... for the group's heads.

    Leaves the running max, the sum of exponentials and the unnormalised output of each head for the merge.
    """
    g = tl.arange(0, DEC_M)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None],
        other=0.0,
    )
    m_i = tl.full((DEC_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((DEC_M,), dtype=tl.float32)
    acc = tl.zeros((DEC_M, HEAD_DIM), dtype=tl.float32)
    cols = tl.arange(0, BLOCK_KV)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(part * BLOCK_KV, seq_len, SPLITS * BLOCK_KV):
        pos = start + cols
        pos_ok = pos < seq_len
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_rows = k_head + block * stride_kb + offset * stride_ks
        v_rows = v_head + block * stride_vb + offset * stride_vs
        acc, m_i, l_i = _online_step(
            q,
            acc,
            m_i,
            l_i,
            k_rows,
            v_rows,
            d,
            pos_ok,
            pos_ok[None, :],
            qk_scale,
            HEAD_DIM,
            PRECISION,
            SCALED,
            True,
        )

    slot = (seq.to(tl.int64) * heads + head) * SPLITS + part  # [DEC_M]
    tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
    tl.store(part_ml_ptr + slot * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["stride_bt"])  # the table's width follows the batch: one compiled kernel
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_table_ptr,
    heads,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    gate_ptr,
    stride_gt,
    stride_gh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DEC_M: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    DEC_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    GATED: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence, tile or partition, kv head): a prompt tile or a decode partition, else nothing."""
    follow_previous(PDL)
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    if q_len == 1:
        if (tile < SPLITS) & (tile * DEC_KV < seq_len):
            _decode_partition(
                q_ptr,
                k_ptr,
                v_ptr,
                part_acc_ptr,
                part_ml_ptr,
                table_row_ptr,
                seq,
                q_start,
                seq_len,
                tile,
                kv_head,
                heads,
                qk_scale,
                stride_qt,
                stride_qh,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                GROUP,
                DEC_M,
                DEC_KV,
                BLOCK_SIZE,
                HEAD_DIM,
                SPLITS,
                PRECISION,
                SCALED,
            )
    elif tile * (BLOCK_M // GROUP_PAD) < q_len:
        _prompt_tile(
            q_ptr,
            k_ptr,
            v_ptr,
            out_ptr,
            table_row_ptr,
            q_start,
            q_len,
            seq_len,
            tile,
            kv_head,
            qk_scale,
            stride_qt,
            stride_qh,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_ot,
            stride_oh,
            gate_ptr,
            stride_gt,
            stride_gh,
            GROUP,
            GROUP_PAD,
            BLOCK_M,
            BLOCK_KV,
            BLOCK_SIZE,
            HEAD_DIM,
            PRECISION,
            SCALED,
            GATED,
            PRECISE,
        )


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_ptr,
    seq_lens_ptr,
    heads,
    stride_ot,
    stride_oh,
    gate_ptr,
    stride_gt,
    stride_gh,
    DEC_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    GATED: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence, head): a decode row's output from its partitions, always summed in one order."""
    follow_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_len == 1:
        parts = tl.arange(0, SPLITS)
        used = parts < tl.cdiv(seq_len, DEC_KV)
        slot = (seq.to(tl.int64) * heads + head) * SPLITS + parts
        m = tl.load(part_ml_ptr + slot * 2, mask=used, other=float("-inf"))
        l_part = tl.load(part_ml_ptr + slot * 2 + 1, mask=used, other=0.0)
        d = tl.arange(0, HEAD_DIM)
        acc = tl.load(part_acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
        weight = tl.exp2(m - tl.max(m, 0))
        total = tl.sum(l_part * weight, 0)
        out = tl.sum(acc * weight[:, None], 0) / total
        gates = gate_ptr + q_start.to(tl.int64) * stride_gt + head * stride_gh + d
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
            _output(out, gates, d < HEAD_DIM, GATED, PRECISE, out_ptr.dtype.element_ty),
        )


_COMPILED = isinstance(
    _merge_partitions_kernel, triton.runtime.JITFunction
)  # the interpreter lacks libdevice


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every row of a flat batch over its sequence's keys in the paged cache.

    q [tokens, heads, head_dim] holds the batch's new rows (rotary applied); key_cache and value_cache
    [blocks, block_size, kv_heads, head_dim] (q's dtype, or 8-bit rows of head_dim + 16, `kv_quant`) already
    hold their keys and values. Sequence s owns rows
    query_start[s]:query_start[s+1] and has seq_lens[s] keys; its row j sits at position
    seq_lens[s] - length + j and sees keys 0 up to that position. Query head h reads kv head
    h // (heads // kv_heads). Softmax in fp32; returns [tokens, heads, head_dim] in q's dtype. With `gate`
    (q's shape and dtype, rows of unit stride: a gated attention layer's output gate) each output is
    multiplied by the sigmoid of its gate in the same launch, rounded as `output * torch.sigmoid(gate)`.
    """
    heads, head_dim = q.shape[1:]
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    config = tile_config(head_dim, group, q.element_size())
    return _paged_attention(q, key_cache, value_cache, layout, scale, config, gate)


def _paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    scale: float,
    config: TileConfig,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with the tiles given (tests use small ones to cover many tiles cheaply)."""
    tokens, heads, head_dim = q.shape
    block_size, kv_heads, cache_dim = key_cache.shape[1:]
    scaled = kv_quant.quantized(key_cache.dtype)
    row = kv_quant.row_width(head_dim, key_cache.dtype)
    if value_cache.shape != key_cache.shape or cache_dim != row or heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)}, key cache {tuple(key_cache.shape)} and value cache "
            f"{tuple(value_cache.shape)} do not fit together"
        )
    if value_cache.dtype != key_cache.dtype or (key_cache.dtype != q.dtype and not scaled):
        raise ValueError(f"q is {q.dtype} but the caches are {key_cache.dtype} and {value_cache.dtype}")
    if head_dim & (head_dim - 1) or head_dim < MIN_DOT or block_size & (block_size - 1):
        raise ValueError(f"head_dim {head_dim} and block_size {block_size} must be powers of two, >= 16")
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(config.block_m, group_pad)
    seqs = layout.query_start.shape[0] - 1
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        raise ValueError(f"the gate must be a {tuple(q.shape)} {q.dtype} tensor with unit-stride rows")
    gating = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (out, 0, 0)
    gated = {"GATED": gate is not None, "PRECISE": _COMPILED}
    splits = config.splits
    part_acc = torch.empty((seqs, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
    block_table = layout.block_table
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    q_tiles = triton.cdiv(max(layout.max_query_len, 1), block_m // group_pad)
    grid = (seqs, max(q_tiles, splits), kv_heads)
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part_acc,
        part_ml,
        layout.query_start,
        layout.seq_lens,
        block_table,
        heads,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        *gating,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        DEC_M=max(group_pad, MIN_DOT),
        BLOCK_KV=config.block_kv,
        DEC_KV=config.dec_kv,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        SPLITS=splits,
        PRECISION=precision,
        SCALED=scaled,
        **gated,
        num_warps=config.warps,
        num_stages=config.stages,
        **pdl(q.device, grid),
    )
    grid = (seqs, heads)
    _merge_partitions_kernel[grid](
        out,
        part_acc,
        part_ml,
        layout.query_start,
        layout.seq_lens,
        heads,
        out.stride(0),
        out.stride(1),
        *gating,
        DEC_KV=config.dec_kv,
        HEAD_DIM=head_dim,
        SPLITS=splits,
        **gated,
        num_warps=4,
        **pdl(out.device, grid),
    )
    return out


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at the flat cache slots (block * block_size + offset).

    The caches [blocks, block_size, kv_heads, head_dim] are written in place (8-bit ones as `kv_quant`
    rows); nothing waits on the host.
    """
    kv_quant.write(key_cache, value_cache, k, v, slot_mapping)
