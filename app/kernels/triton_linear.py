"""Dense projections of decode windows (few rows): weights read whole, before the kernel before them ends.

A decode window multiplies a handful of rows by each weight, so its projections are bound by reading the
weight once, and for small weights by latency. A weight is no kernel's result, so the kernels here load a
program's whole slice of it first and only then wait for the kernel before them on the stream
(`triton_launch`): with dependent launches the weight is read while the previous kernel (a norm, the
attention merge) still runs, and only the rows wait for it.

- `row_linear` (small weights up to 16 rows, a mid-sized weight's lone row): a program holds a few weight
  rows and sums their products with each row of the window by itself, in fp32 on the CUDA cores, so a row
  gets the same bits in any window of up to 16 rows. A small weight's window of rows reads it once: the
  router's lone row in 1.3-1.5 us where a tensor-core tile takes 4.5-4.9 (q30's router on an H200).
- `resident_tile_linear` (small weights of k up to 128, the tiny models'): a program holds 16 weight rows,
  all of k, and multiplies the window's rows (padded to 16) by them in one `tl.dot`: the same sequence of
  tensor-core steps as the fixed 16 x 16 x 512 tiles of `tiled_linear`, and at such k cuBLAS's bits, which
  the rows of larger windows get. With `chunk_k` k is cut into pieces, one dot each, their sums added in a
  fixed order (a candidate of `benchmarks/tune_linear.py`; the engine does not pick it).
- the grouped matmul of `triton_moe` with one group and fixed tiles (`tiled_linear`) for the rest of few
  rows, cuBLAS beyond.
- a weight held as GGUF blocks (`held_linear`): windows of up to 64 rows of the kinds
  `cuda_held.serves_linear` names (Q4_K, Q8_0; an LM head only Q4_K's) by the CUDA kernels of `cuda_held`;
  else the grouped matmul with one group, its blocks dequantized in the programs (`triton_quant`), one or two
  rows each summed by itself on the CUDA cores, more by tiles.

`few_rows_linear` picks by the weight's shape and the window's rows (`benchmarks/tune_linear.py` on an H200,
docs/KERNELS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import triton
import triton.language as tl

from app.kernels import cuda_held
from app.kernels.interface import held_kind
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_moe import HELD_ROWWISE_TILES, MoeTiles, moe_tiles, tiled_linear

MAX_PROGRAM_ELEMENTS = 1 << 15  # weight elements one program holds (64 KB of bf16)
TILE = 16  # rows and weight rows of a `resident_tile_linear` program (the tiles' block_m and block_n)


@triton.jit
def _resident_tile_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    n,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_K: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[:rows, cols] = x[:rows] @ w[cols].T for TILE_N weight rows held whole: one dot over each of the
    CHUNKS pieces of CHUNK_K of k, the pieces' sums then added together."""
    cols = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    col_ok = cols < n
    lanes = tl.arange(0, TILE_N)
    live = lanes < rows
    if CHUNKS == 1:
        ks = tl.arange(0, CHUNK_K)
        k_ok = ks < K
        b = tl.load(
            w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [CHUNK_K, TILE_N], read before the kernel this one follows has finished
        follow_previous(PDL)
        a = tl.load(
            x_ptr + lanes[:, None] * stride_xm + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0
        )
        acc = tl.dot(a, b, input_precision=PRECISION)
    else:
        starts = tl.arange(0, CHUNKS) * CHUNK_K
        steps = tl.arange(0, CHUNK_K)
        kb = starts[:, None, None] + steps[None, :, None]  # [CHUNKS, CHUNK_K, 1]
        b = tl.load(
            w_ptr + cols.to(tl.int64)[None, None, :] * stride_wn + kb,
            mask=(kb < K) & col_ok[None, None, :],
            other=0.0,
        )  # [CHUNKS, CHUNK_K, TILE_N], read before the kernel this one follows has finished
        follow_previous(PDL)
        ka = starts[:, None, None] + steps[None, None, :]  # [CHUNKS, 1, CHUNK_K]
        a = tl.load(
            x_ptr + lanes[None, :, None] * stride_xm + ka, mask=live[None, :, None] & (ka < K), other=0.0
        )
        acc = tl.sum(tl.dot(a, b, input_precision=PRECISION), 0)
    out = out_ptr + lanes[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])


@triton.jit
def _row_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    n,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[:rows, cols] = x[:rows] @ w[cols].T for BLOCK_N weight rows held whole, each row summed in fp32 by
    itself (so its bits do not depend on the others)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_N, BLOCK_K], read before the kernel this one follows has finished
    follow_previous(PDL)
    for row in range(rows):
        x = tl.load(x_ptr + row * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w * x[None, :], 1)
        tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _checked(x: torch.Tensor, weight: torch.Tensor, weight_rows: int) -> tuple[torch.Tensor, int]:
    """x with unit-stride rows and the power-of-two k a program covers; refuses a program of `weight_rows`
    whole weight rows that would not fit."""
    block_k = triton.next_power_of_2(x.shape[1])
    if weight_rows * block_k > MAX_PROGRAM_ELEMENTS:
        raise ValueError(f"{weight_rows} weight rows of {x.shape[1]} elements do not fit one program")
    if weight.stride(-1) != 1:
        raise ValueError("the weight's rows must have unit stride")
    return (x if x.stride(-1) == 1 else x.contiguous()), block_k


def _whole_weight_rows(
    kernel: triton.JITFunction,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_rows: int,
    num_warps: int,
    meta: Callable[[int], dict[str, object]],
) -> torch.Tensor:
    """x [rows <= 16, k] @ weight [n, k].T (+ bias) by `kernel`, `weight_rows` whole weight rows a program;
    `meta` gives its compile-time arguments from the power-of-two k a program covers."""
    rows, k = x.shape
    if rows > TILE:
        raise ValueError(f"these programs take at most {TILE} rows, got {rows}")
    x, block_k = _checked(x, weight, weight_rows)
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    if rows:
        grid = (triton.cdiv(n, weight_rows),)
        kernel[grid](
            x,
            weight,
            out,
            rows,
            n,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            K=k,
            num_warps=num_warps,
            **meta(block_k),
            **pdl(x.device, grid),
        )
    return out if bias is None else out + bias


def resident_tile_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """x [rows <= 16, k] @ weight [n, k].T (+ bias), 16 whole weight rows a program: one dot over k, or with
    `chunk_k` (a power of two) one dot over each piece of that many of k and the pieces' sums added."""

    def meta(block_k: int) -> dict[str, object]:
        piece = block_k if chunk_k is None else min(chunk_k, block_k)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        return {"CHUNKS": block_k // piece, "CHUNK_K": piece, "TILE_N": TILE, "PRECISION": precision}

    return _whole_weight_rows(_resident_tile_kernel, x, weight, bias, TILE, num_warps, meta)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, num_warps: int = 4
) -> torch.Tensor:
    """x [rows <= 16, k] @ weight [n, k].T (+ bias), `block_n` whole weight rows a program, each row of x
    summed by itself: a row gets the same bits in any window of up to 16 rows."""

    def meta(block_k: int) -> dict[str, object]:
        return {"BLOCK_N": block_n, "BLOCK_K": block_k}

    return _whole_weight_rows(_row_kernel, x, weight, bias, block_n, num_warps, meta)


# From benchmarks/tune_linear.py on an H200 (docs/KERNELS.md).
ROW_ELEMENTS = 4096  # weight elements a `row_linear` program holds (32 a thread of 4 warps)
SMALL_WEIGHT_TILES = MoeTiles(block_m=16, block_n=16, block_k=512, num_warps=4, num_stages=3)
WIDE_WEIGHT_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
SMALL_WEIGHT, WIDE_WEIGHT = 1 << 21, 12288  # elements of a small weight; rows of a wide one
SMALL_HELD_TILES = MoeTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
HELD_FEW_ROWS = 64  # rows up to which a held weight's projection takes decode tiles
ONE_DOT_K = 128  # up to this k a small weight's tiles give cuBLAS's bits, which windows beyond 16 rows get


HELD_ROWWISE_ROWS = 2  # rows up to which a held weight's projection sums each row on the CUDA cores


def held_tiles(rows: int, n: int) -> MoeTiles:
    """The tiles of a projection by a held weight (GGUF blocks, dequantized in the programs): up to
    HELD_ROWWISE_ROWS rows each row summed by itself on the CUDA cores (one tile of them: the blocks read
    once), up to HELD_FEW_ROWS 16-row tiles, their width by the weight's rows, so that a row's bits are the
    same in every window of each range; a prompt's tiles beyond."""
    if rows <= HELD_ROWWISE_ROWS:
        return replace(HELD_ROWWISE_TILES, block_m=max(rows, 1), block_k=512)
    if rows > HELD_FEW_ROWS:
        return moe_tiles(rows, exact=False)
    return WIDE_WEIGHT_TILES if n >= WIDE_WEIGHT else SMALL_HELD_TILES


def held_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight.T (+ bias) for a weight held as GGUF blocks [n, row bytes] uint8: windows of up to
    64 rows by `cuda_held.linear` where the engine gives it the weight (`serves_linear`) and it serves,
    else the grouped matmul with one group and `held_tiles`."""
    rows, n = x.shape[0], weight.shape[0]
    kind = held_kind(weight, x.shape[1])
    out = cuda_held.linear(x, weight, kind) if cuda_held.serves_linear(kind, n) else None
    if out is None:
        return tiled_linear(x, weight, bias, held_tiles(rows, n))
    return out if bias is None else out + bias


def sums_rows(rows: int, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` projects a window of `rows` rows by `weight` (not held) with `row_linear`:
    a small weight's window of up to TILE rows over k above ONE_DOT_K, or a mid-sized weight's lone row."""
    n, k = weight.shape
    block_k = triton.next_power_of_2(k)
    if rows > TILE or n >= WIDE_WEIGHT or block_k > MAX_PROGRAM_ELEMENTS:
        return False
    return block_k > ONE_DOT_K if weight.numel() <= SMALL_WEIGHT else rows == 1


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias): a window of few rows by the kernel the weight's shape and the
    row count pick, everything else by cuBLAS.

    A small weight's row gets the same bits in every window of up to 16 rows (each row summed by itself, or
    where k is at most ONE_DOT_K the resident tiles), so does a wide weight's (fixed tiles); a mid-sized
    weight's lone row is read by `row_linear` and more rows by cuBLAS, which picks its algorithm, and so its
    bits, by the row count.
    """
    if weight.dtype == torch.uint8:
        return held_linear(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    block_k = triton.next_power_of_2(k)
    if sums_rows(rows, weight):
        return row_linear(x, weight, bias, max(1, ROW_ELEMENTS // block_k))
    if rows > TILE or n >= WIDE_WEIGHT:
        if n >= WIDE_WEIGHT and rows <= WIDE_WEIGHT_TILES.block_m:
            return tiled_linear(x, weight, bias, WIDE_WEIGHT_TILES)
        return torch.nn.functional.linear(x, weight, bias)
    if weight.numel() <= SMALL_WEIGHT:
        if TILE * block_k <= MAX_PROGRAM_ELEMENTS:
            return resident_tile_linear(x, weight, bias)
        return tiled_linear(x, weight, bias, SMALL_WEIGHT_TILES)
    return torch.nn.functional.linear(x, weight, bias)
