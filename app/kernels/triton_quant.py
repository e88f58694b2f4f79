"""Weight tiles of GGUF's Q8_0 and Q4_K blocks, dequantized in registers by the grouped matmul's programs.

A held weight is a uint8 tensor whose rows are the file's blocks as they lie (`interface.held_kind` names the
type by the row's width). A program reads the blocks of its columns and of one step of k, widens each value
with its scales in fp32, as the `gguf` package's dequantizer does (the products are exact there, so the
bits are the same whatever the order of operations), and hands the tile to `tl.dot` in the activations'
dtype. A step of k lies within one Q4_K super-block (256 values), or covers whole Q8_0 blocks (32).

- Q8_0 (34 bytes a 32 values): an fp16 scale d, then 32 int8 q; value = d * q.
- Q4_K (144 bytes a 256 values): fp16 d and dmin, 12 bytes of eight 6-bit scales and mins (one each a
  group of 32), then 128 bytes of 4-bit q: a 64-value stretch is 32 bytes, their low nibbles its first 32
  values and their high nibbles the next 32; value = (d * scale) * q - dmin * min. `q4_k_tiles` gives the
  two halves of a step apart (low nibbles, high nibbles), each multiplied by its own columns of x.
"""

from __future__ import annotations

import triton
import triton.language as tl

STEP_LIMITS = {"Q8_0": (32, 1 << 12), "Q4_K": (64, 256)}  # a step's smallest and largest k


def quant_step(kind: str, columns: int, wanted: int) -> int:
    """The step of k for rows of `columns` values of `kind`: the largest power of two up to `wanted` (at
    least the type's smallest step) that divides the row and stays within a Q4_K super-block."""
    least, most = STEP_LIMITS[kind]
    step = max(least, min(wanted, most))
    while columns % step:
        step //= 2
    if step < least:
        raise ValueError(f"{kind} rows of {columns} values hold no whole steps of {least}")
    return step


@triton.jit
def q8_0_tile(rows, col_ok, start, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 of k in start..start + BLOCK_K from Q8_0 rows (byte pointers
    `rows` [BLOCK_N]; columns not `col_ok` read as 0)."""
    blocks: tl.constexpr = BLOCK_K // 32
    at = rows[None, :] + ((start // 32 + tl.arange(0, blocks)) * 34)[:, None]  # [blocks, BLOCK_N]
    d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=col_ok[None, :], other=0.0).to(tl.float32)
    q = tl.load(at[:, None, :] + 2 + tl.arange(0, 32)[None, :, None], mask=col_ok[None, None, :], other=0)
    values = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None, :]
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def _k4_scales(packed, j, mask):
    """Q4_K's six-bit scale and min of group j [G] of super-blocks whose 12 packed bytes start at
    `packed` [BLOCK_N]: [G, BLOCK_N] each, as fp32."""
    at = packed[None, :] + j[:, None]
    b_j = tl.load(at, mask=mask, other=0).to(tl.int32)
    b_up = tl.load(at + 4, mask=mask, other=0).to(tl.int32)
    b_down = tl.load(at - 4, mask=mask & (j[:, None] >= 4), other=0).to(tl.int32)
    low = j[:, None] < 4
    scale = tl.where(low, b_j & 63, (b_up & 15) | ((b_down >> 6) << 4))
    least = tl.where(low, b_up & 63, (b_up >> 4) | ((b_j >> 6) << 4))
    return scale.to(tl.float32), least.to(tl.float32)


@triton.jit
def q4_k_tiles(rows, col_ok, start, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The values of k in start..start + BLOCK_K from Q4_K rows (byte pointers `rows` [BLOCK_N]) as two
    [BLOCK_K // 2, BLOCK_N] fp32 tiles: the low nibbles (k = start + 64 g + i, i < 32) and the high ones
    (k + 32). The step lies within one super-block."""
    stretches: tl.constexpr = BLOCK_K // 64
    block = rows + (start // 256) * 144  # [BLOCK_N]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=col_ok, other=0.0).to(tl.float32)
    dmin = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=col_ok, other=0.0).to(tl.float32)
    stretch = (start % 256) // 64 + tl.arange(0, stretches)  # [stretches]
    mask = col_ok[None, :]
    scale_lo, min_lo = _k4_scales(block + 4, 2 * stretch, mask)
    scale_hi, min_hi = _k4_scales(block + 4, 2 * stretch + 1, mask)
    at = block[None, None, :] + 16 + (stretch * 32)[:, None, None] + tl.arange(0, 32)[None, :, None]
    q = tl.load(at, mask=col_ok[None, None, :], other=0).to(tl.int32)  # [stretches, 32, BLOCK_N]
    lo = (q & 15).to(tl.float32) * (d[None, :] * scale_lo)[:, None, :] - (dmin[None, :] * min_lo)[:, None, :]
    hi = (q >> 4).to(tl.float32) * (d[None, :] * scale_hi)[:, None, :] - (dmin[None, :] * min_hi)[:, None, :]
    return tl.reshape(lo, (BLOCK_K // 2, BLOCK_N)), tl.reshape(hi, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def q4_k_columns(start, BLOCK_K: tl.constexpr):
    """The k [BLOCK_K // 2] of a step's low-nibble values (`q4_k_tiles`); the high ones are these + 32."""
    half = tl.arange(0, BLOCK_K // 2)
    return start + (half // 32) * 64 + half % 32
