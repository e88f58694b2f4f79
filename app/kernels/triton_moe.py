"""Routed experts in two grouped-matmul launches that read each expert's weights in place.

The (token, expert) pairs of a batch are grouped by expert into tiles of `block_m` rows (`align_routes`);
each tile multiplies its rows by its expert's weights straight from the stacked [experts, n, k] tensor, with
no gather of weights per token. The first launch computes SwiGLU(gate, up) per pair, the second the down
projection scaled by the routing weight; a last launch sums each token's pairs in a fixed order.

A pair's arithmetic depends only on the tile configuration (`MoeTiles`), never on which other pairs share
its tile: `exact` tiles are the same for every batch, so a row's output is bit-identical alone or batched.
Nothing here synchronises with the host, so the whole block can be captured in a CUDA graph.

Experts held as blocks `cuda_held.serves_experts` names (Q4_K, Q8_0) in windows of up to 64 tokens run the
CUDA kernels of `cuda_held` where they serve (bf16 activations, a CUDA device with NVRTC), unless `exact` or
explicit tiles are asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from app.kernels import cuda_held
from app.kernels.gguf_quants import I_QUANTS
from app.kernels.interface import held_kind
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_quant import (
    held_values,
    q4_k_columns,
    q4_k_groups,
    q4_k_row,
    q4_k_tiles,
    q8_0_groups,
    q8_0_row,
    quant_step,
    quant_tables,
)


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the grouped matmuls: rows per tile, output columns per program, reduction step.

    `rowwise` (weights held as GGUF blocks only): each row of a tile summed by itself in fp32 on the CUDA
    cores (`_held_rowwise`), so a row's bits depend on block_n, block_k and num_warps, not on block_m.
    `columns_first` (Q8_0 blocks only): the widened weights [block_n, block_k] are the dot's left operand
    and the tile's rows its right one, so that the tensor cores take the weights from registers; a form
    benchmarks/tune_held.py times beside the tiles (no window size takes it by default).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    rowwise: bool = False
    columns_first: bool = False


# From benchmarks/tune_moe.py on an H200 (docs/KERNELS.md): 16-row tiles read decode batches' experts at
# 51% (1 token), 87% (8) and 93% (32) of copy bandwidth; 128-row tiles are fastest for long prompts.
EXACT_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)


# Windows of at most this many tokens run their pairs one tile each (PER_PAIR): a lone token's picks are
# distinct experts, so nothing is read twice, and the two alignment launches are saved.
PER_PAIR_TOKENS = 2

# Held experts (benchmarks/tune_held.py on an H200, docs/KERNELS.md): windows of up to HELD_PER_PAIR_TOKENS
# tokens sum each pair on the CUDA cores by itself (Q4_K's experts at 8 tokens 131 us a layer against the
# 16-row tiles' 156, Q8_0's 219 against 426: a tile widens every value for its one or two real rows).
# Triton's interpreter (the CPU tests) pays per program, not per value: there a rowwise program takes 64
# columns, the same code in 16x fewer programs (a row's bits differ from the GPU's, as block_n sets them).
_ROWWISE_COLUMNS = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 4
HELD_ROWWISE_TILES = MoeTiles(
    block_m=1, block_n=_ROWWISE_COLUMNS, block_k=256, num_warps=1, num_stages=2, rowwise=True
)
HELD_PER_PAIR_TOKENS = 8
# Q8_0's experts from 9 tokens on take the 16-row tiles too. Since Q8_0 is held reordered (a row's codes, then
# its scales) the tiles read its codes 16 bytes at a time, and on an H100 its experts at 32 tokens took 274 us
# a layer in them against 442 widened columns first (`MoeTiles.columns_first`, two stages; 310 at one), which
# had been the faster form (458 against 770 us on an H200) while the file's layout made every load two bytes
# (benchmarks/tune_held.py, docs/PERFORMANCE.md 2026-12-05).
DECODE_TOKENS = 64  # windows of up to this many tokens take the decode tiles (a row's bits the same in all)
# Held types whose tiles run one pipeline stage: staging IQ3_S's grid reads costs more than it hides (its
# experts at 32 tokens 1.40 ms a layer against 2.16 at four stages, 2,048 tokens 3.37 against 4.89: tune_held,
# docs/PERFORMANCE.md). The stages order no arithmetic, so a row's bits do not change.
ONE_STAGE_HELD = frozenset({"IQ3_S"})


def moe_tiles(tokens: int, exact: bool, held: tuple[str, ...] = ()) -> MoeTiles:
    """The tiles for a batch of `tokens` rows (`held`: the types of the experts' two weights where they are
    held as GGUF blocks, which may differ); with `exact` the same for every batch size. A row's bits are the
    same in every window of one range: held weights' windows of up to HELD_PER_PAIR_TOKENS tokens (rowwise
    sums), up to DECODE_TOKENS (16-row tiles), beyond (128-row tiles); those of ONE_STAGE_HELD types in one
    pipeline stage."""
    if exact:
        return EXACT_TILES
    if held and tokens <= HELD_PER_PAIR_TOKENS:
        return HELD_ROWWISE_TILES
    if tokens <= DECODE_TOKENS:
        tiles = EXACT_TILES
    else:
        tiles = MoeTiles(block_m=128, block_n=128, block_k=64, num_warps=8)
    return replace(tiles, num_stages=1) if ONE_STAGE_HELD & set(held) else tiles


@dataclass(frozen=True)
class Routes:
    """The pairs of a batch grouped by expert.

    rows [blocks * block_m] int32: pair ids (token * top_k + choice) tile by tile, `pairs` marking padding;
    block_expert [blocks] int32: the expert of each tile, -1 for tiles left unused.
    """

    rows: torch.Tensor
    block_expert: torch.Tensor
    pairs: int
    block_m: int


@triton.jit
def _count_pairs(
    ids_ptr, counts_ptr, block_expert_ptr, pairs, blocks, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """counts[expert] = how many pairs picked this program's expert; also marks its share of tiles unused."""
    follow_previous(PDL)
    expert = tl.program_id(0)
    for start in range(0, per_program, BLOCK):
        tile = expert * per_program + start + tl.arange(0, BLOCK)
        tl.store(
            block_expert_ptr + tile, -1, mask=(tile < blocks) & (start + tl.arange(0, BLOCK) < per_program)
        )
    total = 0
    for start in range(0, pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
        total += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, total)


@triton.jit
def _place_pairs(
    ids_ptr,
    counts_ptr,
    rows_ptr,
    block_expert_ptr,
    pairs,
    experts,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    """Write this program's expert's pairs (in pair order) and padding into its tiles, and name the tiles."""
    follow_previous(PDL)
    expert = tl.program_id(0)
    all_experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + all_experts, mask=all_experts < experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first_row = tl.sum(tl.where(all_experts < expert, padded, 0), axis=0)
    mine = tl.sum(tl.where(all_experts == expert, counts, 0), axis=0)
    if mine == 0:
        return
    seen = 0
    for start in range(0, pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        hit = (tl.load(ids_ptr + offs, mask=offs < pairs, other=-1) == expert).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - hit
        tl.store(rows_ptr + first_row + rank, offs, mask=hit == 1)
        seen += tl.sum(hit, axis=0)
    tail = tl.arange(0, BLOCK_M)
    mine_padded = (mine + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(rows_ptr + first_row + mine + tail, pairs, mask=mine + tail < mine_padded)
    tiles = mine_padded // BLOCK_M
    for start in range(0, tiles, BLOCK_M):
        t = start + tl.arange(0, BLOCK_M)
        tl.store(block_expert_ptr + first_row // BLOCK_M + t, expert, mask=t < tiles)


def align_routes(top_ids: torch.Tensor, experts: int, block_m: int) -> Routes:
    """Group the pairs of `top_ids` [tokens, top_k] by expert into tiles of `block_m` rows (two launches).

    Sizes are bounds known from the shapes alone (at most ceil(pairs / block_m) + min(pairs, experts) tiles),
    so no value is read back to the host; within an expert, pairs keep their order.
    """
    flat = top_ids.flatten()
    pairs = flat.numel()
    device = flat.device
    blocks = -(-pairs // block_m) + min(pairs, experts)
    counts = torch.empty(experts, dtype=torch.int32, device=device)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    block = 256 if pairs <= 256 else 1024  # two compiled variants, whatever the window size
    grid = (experts,)
    _count_pairs[grid](
        flat, counts, block_expert, pairs, blocks, -(-blocks // experts), BLOCK=block, **pdl(device, grid)
    )
    grid = (experts,)
    _place_pairs[grid](
        flat,
        counts,
        rows,
        block_expert,
        pairs,
        experts,
        BLOCK_M=block_m,
        BLOCK=block,
        BLOCK_E=triton.next_power_of_2(experts),
        **pdl(flat.device, grid),
    )
    return Routes(rows=rows, block_expert=block_expert, pairs=pairs, block_m=block_m)


@triton.jit
def route_row(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    live_ptr,
    row,
    experts,
    stride_row,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Softmax over token `row`'s router logits, its top-k experts (int64) and weights; adds the picks to
    `counts`. The logits are read at L2 (`.cg`), so a program may route logits other programs of its launch
    wrote."""
    cols = tl.arange(0, BLOCK_E)
    ok = cols < experts
    at = logits_ptr + row * stride_row + cols
    x = tl.load(at, mask=ok, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(ok, p, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    live = tl.load(live_ptr + row).to(tl.int64) if HAS_LIVE else tl.full((), 1, dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        chosen = tl.where(slots == k, best, chosen)
        weights = tl.where(slots == k, tl.max(p, axis=0), weights)
        p = tl.where(cols == best, -1.0, p)
    keep = slots < TOP_K
    tl.atomic_add(counts_ptr + chosen, tl.full((BLOCK_K,), 1, tl.int64) * live, mask=keep)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(ids_ptr + row * TOP_K + slots, chosen.to(tl.int64), mask=keep)
    tl.store(weights_ptr + row * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _route(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    live_ptr,
    experts,
    stride_row,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """A program per token: `route_row`."""
    follow_previous(PDL)
    route_row(
        logits_ptr,
        ids_ptr,
        weights_ptr,
        counts_ptr,
        live_ptr,
        tl.program_id(0).to(tl.int64),
        experts,
        stride_row,
        TOP_K,
        RENORM,
        HAS_LIVE,
        BLOCK_E,
        BLOCK_K,
    )


def route_top_k(
    logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor, live: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts [tokens, top_k] (int64) and weights (logits' dtype) from router logits [tokens, experts].

    Same contract as `SparseMoE.route` (softmax over all experts in fp32, optionally renormalised over the
    picks); also adds each real row's picks to `counts` [experts] int64 (`live` [tokens]: 0 on padding).
    """
    tokens, experts = logits.shape
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    grid = (tokens,)
    _route[grid](
        logits,
        ids,
        weights,
        counts,
        live if live is not None else counts,
        experts,
        logits.stride(0),
        TOP_K=top_k,
        RENORM=renormalize,
        HAS_LIVE=live is not None,
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if experts <= 256 else 2,
        **pdl(logits.device, grid),
    )
    return ids, weights


MAX_GRID_Y = 65535  # a CUDA launch's most programs along its second axis (column blocks here)
HELD_CODES = {
    "Q8_0": 1,
    "Q4_K": 2,
    "Q6_K": 3,
    "Q5_K": 4,
    "IQ4_XS": 5,
    "IQ3_XXS": 6,
    "IQ3_S": 7,
}  # the HELD argument of `_grouped_matmul` for a held weight's blocks (`triton_quant.held_values`)

# How a grouped-matmul program finds its rows and its expert (the MODE argument).
TILED = 0  # tile t holds rows[t * BLOCK_M:...] of expert block_expert[t] (`align_routes`)
PER_PAIR = 1  # tile t is pair t alone, of expert ids[t]: no alignment launches (windows of few tokens)
ONE_GROUP = 2  # tile t holds rows t * BLOCK_M...: a dense matmul (expert 0) with no routing tensors


@triton.jit
def _tile_rows(rows_ptr, block_expert_ptr, tile, pairs, MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """This tile's row ids (`pairs` where padding) and its expert (-1: tile unused)."""
    lanes = tl.arange(0, BLOCK_M)
    if MODE == 0:
        rows = tl.load(rows_ptr + tile * BLOCK_M + lanes)
        expert = tl.load(block_expert_ptr + tile)
    elif MODE == 1:
        rows = tl.where(lanes == 0, tile, pairs)
        expert = tl.load(block_expert_ptr + tile).to(tl.int32)
    else:
        rows = tile * BLOCK_M + lanes
        rows = tl.where(rows < pairs, rows, pairs)
        expert = tl.zeros((), dtype=tl.int32)
    return rows, expert


@triton.jit
def _columns_first_dot(
    a, rows, col_ok, start, k, acc, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """acc [BLOCK_N, BLOCK_M] + a step of held Q8_0 rows of `k` values (`rows`: byte pointers [BLOCK_N])
    widened [BLOCK_N, BLOCK_K] times the tile's activations a [BLOCK_M, BLOCK_K], transposed."""
    codes, d = q8_0_groups(rows, col_ok, start, k, BLOCK_K, BLOCK_N)
    values = tl.reshape(codes * d[:, :, None], (BLOCK_N, BLOCK_K))
    return tl.dot(values.to(a.dtype), tl.trans(a), acc, input_precision=PRECISION)


@triton.jit
def _grouped_matmul(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,
    table_ptr,
    pairs,
    n,
    k,
    up_offset,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    MODE: tl.constexpr,
    X_ROW_DIV: tl.constexpr,
    HELD: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    COLUMNS_FIRST: tl.constexpr = False,
):
    """out[pair, cols] = act(x[pair // X_ROW_DIV] @ w[expert].T) for one tile of pairs and BLOCK_N columns.

    HELD: 0 for weights of the activations' kind, else a held type's code (HELD_CODES) for rows of GGUF blocks
    (`triton_quant`; `table_ptr`: its `quant_tables`), whose strides are in bytes and whose k is a multiple of
    BLOCK_K. COLUMNS_FIRST (Q8_0): w[expert] @ x.T, the accumulators [BLOCK_N, BLOCK_M], transposed at the
    end."""
    follow_previous(PDL)
    tile = tl.program_id(0)
    rows, expert = _tile_rows(rows_ptr, block_expert_ptr, tile, pairs, MODE, BLOCK_M)
    if expert < 0:
        return
    valid = rows < pairs
    x_rows = (rows // X_ROW_DIV).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if COLUMNS_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HELD != 0:
        w_rows = w_base + cols.to(tl.int64) * stride_wn
        up_rows = w_base + (cols + up_offset).to(tl.int64) * stride_wn
    for start in range(0, k, BLOCK_K):
        if HELD == 2 or HELD == 4:
            k_lo = q4_k_columns(start, BLOCK_K)
            x_at = x_ptr + x_rows[:, None] * stride_xm + k_lo[None, :]
            a_lo = tl.load(x_at, mask=valid[:, None], other=0.0)
            a_hi = tl.load(x_at + 32, mask=valid[:, None], other=0.0)
            w_lo, w_hi = q4_k_tiles(w_rows, col_ok, start, HELD == 4, BLOCK_K, BLOCK_N)
            acc = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc, input_precision=PRECISION)
            acc = tl.dot(a_hi, w_hi.to(a_hi.dtype), acc, input_precision=PRECISION)
            if SWIGLU:
                u_lo, u_hi = q4_k_tiles(up_rows, col_ok, start, HELD == 4, BLOCK_K, BLOCK_N)
                acc_up = tl.dot(a_lo, u_lo.to(a_lo.dtype), acc_up, input_precision=PRECISION)
                acc_up = tl.dot(a_hi, u_hi.to(a_hi.dtype), acc_up, input_precision=PRECISION)
        elif COLUMNS_FIRST:
            ks = start + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :], mask=valid[:, None], other=0.0)
            acc = _columns_first_dot(a, w_rows, col_ok, start, k, acc, PRECISION, BLOCK_K, BLOCK_N)
            if SWIGLU:
                acc_up = _columns_first_dot(a, up_rows, col_ok, start, k, acc_up, PRECISION, BLOCK_K, BLOCK_N)
        elif HELD != 0:
            ks = start + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :], mask=valid[:, None], other=0.0)
            b = held_values(HELD, w_rows, col_ok, start, k, table_ptr, BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
            if SWIGLU:
                b_up = held_values(HELD, up_rows, col_ok, start, k, table_ptr, BLOCK_K, BLOCK_N)
                acc_up = tl.dot(a, b_up.to(a.dtype), acc_up, input_precision=PRECISION)
        else:
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            x_at = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]
            a = tl.load(x_at, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SWIGLU:
                b_up = tl.load(
                    w_base + (cols[None, :] + up_offset) * stride_wn + ks[:, None], mask=w_mask, other=0.0
                )
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    if COLUMNS_FIRST:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_rows = rows.to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


@triton.jit
def _tile_row(rows_ptr, tile, m: tl.constexpr, pairs, MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row id m of this tile as `_tile_rows` lays them out (`pairs` where padding)."""
    if MODE == 0:
        row = tl.load(rows_ptr + tile * BLOCK_M + m)
    elif MODE == 1:
        row = tile if m == 0 else pairs
    else:
        row = tl.minimum(tile * BLOCK_M + m, pairs)
    return row


@triton.jit
def _held_rowwise(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,
    table_ptr,
    pairs,
    n,
    k,
    up_offset,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    MODE: tl.constexpr,
    X_ROW_DIV: tl.constexpr,
    HELD: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_grouped_matmul`'s result for weights held as GGUF blocks (HELD: HELD_CODES), each of
    the tile's rows summed with the program's dequantized step by itself in fp32 on the CUDA cores, padding
    rows skipped: a few rows read the blocks once, at the arithmetic of one row's products."""
    follow_previous(PDL)
    tile = tl.program_id(0)
    rows, expert = _tile_rows(rows_ptr, block_expert_ptr, tile, pairs, MODE, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_rows = w_base + cols.to(tl.int64) * stride_wn
    up_rows = w_base + (cols + up_offset).to(tl.int64) * stride_wn
    lanes = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if HELD == 2 or HELD == 4:
            low, high, mul_lo, off_lo, mul_hi, off_hi = q4_k_groups(
                w_rows, col_ok, start, HELD == 4, BLOCK_K, BLOCK_N
            )
            if SWIGLU:
                u_low, u_high, u_mul_lo, u_off_lo, u_mul_hi, u_off_hi = q4_k_groups(
                    up_rows, col_ok, start, HELD == 4, BLOCK_K, BLOCK_N
                )
        elif HELD == 1:
            codes, d = q8_0_groups(w_rows, col_ok, start, k, BLOCK_K, BLOCK_N)
            if SWIGLU:
                u_codes, u_d = q8_0_groups(up_rows, col_ok, start, k, BLOCK_K, BLOCK_N)
        else:
            values = held_values(HELD, w_rows, col_ok, start, k, table_ptr, BLOCK_K, BLOCK_N)
            if SWIGLU:
                u_values = held_values(HELD, up_rows, col_ok, start, k, table_ptr, BLOCK_K, BLOCK_N)
        for m in tl.static_range(BLOCK_M):
            row = _tile_row(rows_ptr, tile, m, pairs, MODE, BLOCK_M)
            if row < pairs:
                x_row = x_ptr + (row // X_ROW_DIV).to(tl.int64) * stride_xm
                if HELD == 2 or HELD == 4:
                    part = q4_k_row(low, high, mul_lo, off_lo, mul_hi, off_hi, x_row, start, BLOCK_K)
                elif HELD == 1:
                    part = q8_0_row(codes, d, x_row, start, BLOCK_K)
                else:
                    x = tl.load(x_row + start + tl.arange(0, BLOCK_K)).to(tl.float32)
                    part = tl.sum(values * x[:, None], axis=0)
                acc = tl.where(lanes == m, acc + part[None, :], acc)
                if SWIGLU:
                    if HELD == 2 or HELD == 4:
                        part = q4_k_row(
                            u_low, u_high, u_mul_lo, u_off_lo, u_mul_hi, u_off_hi, x_row, start, BLOCK_K
                        )
                    elif HELD == 1:
                        part = q8_0_row(u_codes, u_d, x_row, start, BLOCK_K)
                    else:
                        part = tl.sum(u_values * x[:, None], axis=0)
                    acc_up = tl.where(lanes == m, acc_up + part[None, :], acc_up)
    valid = rows < pairs
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


@triton.jit
def picks_sum(y_ptr, ids_ptr, token, stride_y, cols, ok, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Columns `cols` of the sum of a token's TOP_K pair rows of y (row token * TOP_K + choice, `stride_y`
    apart) in fp32, added in choice order; pairs whose id is negative (never computed) left out. No branch:
    every choice's loads are issued before the first add."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        pair = token * TOP_K + choice
        keep = tl.load(ids_ptr + pair) >= 0
        part = tl.load(y_ptr + pair * stride_y + cols, mask=tl.where(keep, ok, False), other=0.0)
        acc = tl.where(keep, acc + part.to(tl.float32), acc)
    return acc


@triton.jit
def _sum_choices(
    y_ptr, ids_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """out[token] = `picks_sum` of the token's TOP_K pair rows of y."""
    follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = picks_sum(y_ptr, ids_ptr, token, hidden, cols, ok, TOP_K, BLOCK)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _precision(x: torch.Tensor) -> str:
    """`tl.dot`'s input precision for activations of x's dtype."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routes: Routes,
    tiles: MoeTiles,
    n: int,
    x_row_div: int,
    scale: torch.Tensor | None,
    up_offset: int = 0,
    mode: int = TILED,
    tile_count: int | None = None,
) -> None:
    """One grouped matmul over the tiles of `routes` (PER_PAIR: `block_expert` holds each pair's expert, a
    tile per pair; ONE_GROUP: `tile_count` tiles of expert 0, the routing tensors unread)."""
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped matmul needs rows with unit stride")
    held, block_k, table = 0, tiles.block_k, out  # `table`: the i-quants' lookup tables (unread otherwise)
    if w.dtype == torch.uint8:
        kind = held_kind(w, x.shape[-1])
        held, block_k = HELD_CODES[kind], quant_step(kind, x.shape[-1], tiles.block_k, tiles.rowwise)
        table = quant_tables(x.device) if kind in I_QUANTS else out
    grid = (tile_count or routes.block_expert.numel(), triton.cdiv(n, tiles.block_n))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"{n} columns in blocks of {tiles.block_n}: more than {MAX_GRID_Y} blocks")
    if tiles.rowwise and not held:
        raise ValueError("rowwise tiles read weights held as GGUF blocks only")
    if tiles.columns_first and held != HELD_CODES["Q8_0"]:
        raise ValueError("tiles widened columns first read Q8_0 blocks only")
    kernel, extra = (
        (_held_rowwise, {})
        if tiles.rowwise
        else (_grouped_matmul, {"PRECISION": _precision(x), "COLUMNS_FIRST": tiles.columns_first})
    )
    kernel[grid](
        x,
        w,
        out,
        routes.rows,
        routes.block_expert,
        scale if scale is not None else out,
        table,
        routes.pairs,
        n,
        x.shape[-1],
        up_offset,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        MODE=mode,
        X_ROW_DIV=x_row_div,
        HELD=held,
        SWIGLU=up_offset > 0,
        SCALE=scale is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **extra,
        **pdl(x.device, grid),
    )


def fused_experts(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    exact: bool = False,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """The weighted sum of each token's routed experts (same contract as `experts_reference`).

    x [tokens, hidden]; top_ids, top_weights [tokens, top_k]; gate_up [experts, 2I, hidden] (gate rows
    first); down [experts, hidden, I]; either may be held as GGUF blocks (uint8 rows, `held_kind`). An entry
    whose id is negative adds nothing and reads no weights. `tiles` overrides the choice of `moe_tiles` (for
    tuning).
    """
    return sum_picks(expert_pairs(x, top_ids, top_weights, gate_up, down, exact, tiles), top_ids)


def sum_picks(pairs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its picks' rows [tokens, hidden] (`Picks.add`): pairs [tokens * top_k, hidden] as
    `expert_pairs` leaves them, ids [tokens, top_k] (negative: left out), added in choice order in fp32."""
    tokens, top_k = ids.shape
    hidden = pairs.shape[1]
    out = pairs.new_empty(tokens, hidden)
    block = 1024
    grid = (tokens, triton.cdiv(hidden, block))
    ids = ids.contiguous()
    _sum_choices[grid](pairs, ids, out, hidden, TOP_K=top_k, BLOCK=block, **pdl(pairs.device, grid))
    return out


def expert_pairs(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    exact: bool = False,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """`fused_experts` before its sum: each (token, choice) pair's expert output times its routing weight,
    [tokens * top_k, hidden] in x's dtype, row token * top_k + choice (left unwritten for a negative id)."""
    tokens, hidden = x.shape
    top_k = top_ids.shape[1]
    experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    both_held = gate_up.dtype == down.dtype == torch.uint8
    held = (held_kind(gate_up, hidden), held_kind(down, intermediate)) if both_held else ()
    if held and not exact and tiles is None and cuda_held.serves_experts(held):
        y = cuda_held.expert_pairs(x, top_ids, top_weights, gate_up, down, held)
        if y is not None:
            return y
    tiles = tiles or moe_tiles(tokens, exact, held)
    pairs = tokens * top_k
    x = x.contiguous()
    scale = top_weights.flatten().contiguous()
    act = x.new_empty(pairs, intermediate)
    if tokens <= PER_PAIR_TOKENS or (tiles.rowwise and tokens <= HELD_PER_PAIR_TOKENS):
        ids = top_ids.flatten().contiguous()
        routes, mode = Routes(rows=ids, block_expert=ids, pairs=pairs, block_m=tiles.block_m), PER_PAIR
    else:
        routes, mode = align_routes(top_ids, experts, tiles.block_m), TILED
    _launch(x, gate_up, act, routes, tiles, intermediate, top_k, None, intermediate, mode)
    y = x.new_empty(pairs, hidden)
    _launch(act, down, y, routes, tiles, hidden, 1, scale, mode=mode)
    return y


def exact_fused_experts(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`fused_experts` with the batch-independent tiles."""
    return fused_experts(x, top_ids, top_weights, gate_up, down, exact=True)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias) as a grouped matmul with one group and the exact tiles.

    Every row is computed by the same tile program whatever the number of rows, so a row's result does not
    depend on its batch (cuBLAS picks its algorithm by matrix shape).
    """
    return tiled_linear(x, weight, bias, EXACT_TILES)


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: MoeTiles
) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias) by ONE_GROUP tiles of `tiles` (a row's result depends on the
    tiles only); the weight may be held as GGUF blocks (uint8 [n, row bytes])."""
    rows, n = x.shape[0], weight.shape[0]
    x = x.contiguous()
    out = x.new_empty(rows, n)
    if rows:
        routes = Routes(rows=out, block_expert=out, pairs=rows, block_m=tiles.block_m)
        blocks = -(-rows // tiles.block_m)
        _launch(x, weight.unsqueeze(0), out, routes, tiles, n, 1, None, mode=ONE_GROUP, tile_count=blocks)
    return out if bias is None else out + bias
