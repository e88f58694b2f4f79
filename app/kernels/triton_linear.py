"""Dense projections of decode windows (few rows): weights read whole, before the kernel before them ends.

A decode window multiplies a handful of rows by each weight, so its projections are bound by reading the
weight once, and for small weights by latency. A weight is no kernel's result, so the kernels here load a
program's whole slice of it first and only then wait for the kernel before them on the stream
(`triton_launch`): with dependent launches the weight is read while the previous kernel (a norm, the
attention merge) still runs, and only the rows wait for it.

- `resident_tile_linear` (small weights, up to 16 rows): a program holds 16 weight rows, all of k, and
  multiplies the window's rows (padded to 16) by them in one `tl.dot`: the same sequence of tensor-core steps
  as the fixed 16 x 16 x 512 tiles of `tiled_linear`, so a row gets the tiles' bits in any window. With
  `chunk_k` k is cut into pieces, one dot each (independent chains of tensor-core steps, several warps at
  once), their sums added in a fixed order: other bits than the tiles', the same in any window of up to 16
  rows (a candidate of `benchmarks/tune_linear.py`; the engine does not pick it).
- `row_linear` (a lone row, mid-sized weights): a program holds a few weight rows and sums their products
  with the row in fp32 on the CUDA cores.
- the grouped matmul of `triton_moe` with one group and fixed tiles (`tiled_linear`) for the rest of few
  rows, cuBLAS beyond.

`few_rows_linear` picks by the weight's shape and the window's rows (`benchmarks/tune_linear.py` on an H200,
docs/KERNELS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_moe import MoeTiles, tiled_linear

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
    n,
    stride_wn,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[cols] = x @ w[cols].T for one row x, BLOCK_N weight rows held whole, summed in fp32."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_K], read before the kernel this one follows has finished
    follow_previous(PDL)
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _checked(x: torch.Tensor, weight: torch.Tensor, weight_rows: int) -> tuple[torch.Tensor, int]:
    """x with unit-stride rows and the power-of-two k a program covers; refuses a program of `weight_rows`
    whole weight rows that would not fit."""
    block_k = triton.next_power_of_2(x.shape[1])
    if weight_rows * block_k > MAX_PROGRAM_ELEMENTS:
        raise ValueError(f"{weight_rows} weight rows of {x.shape[1]} elements do not fit one program")
    if weight.stride(-1) != 1:
        raise ValueError("the weight's rows must have unit stride")
    return (x if x.stride(-1) == 1 else x.contiguous()), block_k


def resident_tile_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """x [rows <= 16, k] @ weight [n, k].T (+ bias), 16 whole weight rows a program: one dot over k, or with
    `chunk_k` (a power of two) one dot over each piece of that many of k and the pieces' sums added."""
    rows, k = x.shape
    if rows > TILE:
        raise ValueError(f"resident tiles take at most {TILE} rows, got {rows}")
    x, block_k = _checked(x, weight, TILE)
    chunk_k = block_k if chunk_k is None else min(chunk_k, block_k)
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    if rows:
        grid = (triton.cdiv(n, TILE),)
        _resident_tile_kernel[grid](
            x,
            weight,
            out,
            rows,
            n,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            K=k,
            CHUNKS=block_k // chunk_k,
            CHUNK_K=chunk_k,
            TILE_N=TILE,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps,
            **pdl(x.device, grid),
        )
    return out if bias is None else out + bias


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, num_warps: int = 4
) -> torch.Tensor:
    """x [1, k] @ weight [n, k].T (+ bias), `block_n` whole weight rows a program."""
    if x.shape[0] != 1:
        raise ValueError(f"row_linear takes one row, got {x.shape[0]}")
    k = x.shape[1]
    x, block_k = _checked(x, weight, block_n)
    n = weight.shape[0]
    out = x.new_empty(1, n)
    grid = (triton.cdiv(n, block_n),)
    _row_kernel[grid](
        x,
        weight,
        out,
        n,
        weight.stride(0),
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        **pdl(x.device, grid),
    )
    return out if bias is None else out + bias


# From benchmarks/tune_linear.py on an H200 (docs/KERNELS.md).
ROW_ELEMENTS = 4096  # weight elements a `row_linear` program holds (32 a thread of 4 warps)
SMALL_WEIGHT_TILES = MoeTiles(block_m=16, block_n=16, block_k=512, num_warps=4, num_stages=3)
WIDE_WEIGHT_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
SMALL_WEIGHT, WIDE_WEIGHT = 1 << 21, 12288  # elements of a small weight; rows of a wide one


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias): a window of few rows by the kernel the weight's shape and the
    row count pick, everything else by cuBLAS.

    A small weight's row gets the same bits in every window of up to 16 rows (resident tiles, or the fixed
    tiles where 16 weight rows do not fit a program), so does a wide weight's (fixed tiles); a mid-sized
    weight's lone row is read by `row_linear` and more rows by cuBLAS, which picks its algorithm, and so its
    bits, by the row count.
    """
    rows, k = x.shape
    n = weight.shape[0]
    if rows > TILE or n >= WIDE_WEIGHT:
        if n >= WIDE_WEIGHT and rows <= WIDE_WEIGHT_TILES.block_m:
            return tiled_linear(x, weight, bias, WIDE_WEIGHT_TILES)
        return torch.nn.functional.linear(x, weight, bias)
    block_k = triton.next_power_of_2(k)
    if weight.numel() <= SMALL_WEIGHT:
        if TILE * block_k <= MAX_PROGRAM_ELEMENTS:
            return resident_tile_linear(x, weight, bias)
        return tiled_linear(x, weight, bias, SMALL_WEIGHT_TILES)
    if rows == 1 and block_k <= MAX_PROGRAM_ELEMENTS:
        return row_linear(x, weight, bias, max(1, ROW_ELEMENTS // block_k))
    return torch.nn.functional.linear(x, weight, bias)
