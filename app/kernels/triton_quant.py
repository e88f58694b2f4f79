"""Weight tiles of GGUF's blocks (Q8_0, the K-quants Q4_K, Q5_K, Q6_K and the i-quants IQ4_XS, IQ3_XXS,
IQ3_S), dequantized in registers by the matmul programs.

A held weight is a uint8 tensor whose rows are the file's blocks (`interface.held_kind` names the type by the
row's width), as they lie but for Q8_0's. A program reads the blocks of its columns and of one step of k,
widens each value with its scales in fp32, as the `gguf` package's dequantizer does (the products are exact
there, so the bits are the same whatever the order of operations), and hands the tile to `tl.dot` in the
activations' dtype. A step of k lies within one Q4_K super-block (256 values), or covers whole Q8_0 blocks
(32).

- Q8_0 (34 bytes a 32 values): an fp16 scale d and 32 int8 q; value = d * q. Held reordered
  (`gguf_quants.to_held`): a row's codes, then its scales, so its codes load as 16-byte vectors in rows of 256
  values a multiple (`q8_0_at`).
- Q6_K (210 bytes a 256 values): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one a
  group of 16), an fp16 d; in each half of 128 values, value 32 j + l (j < 4, l < 32) takes the low (j even)
  or high nibble of low byte l + 32 (j % 2) and bits 2 j of high byte l; value = d * scale * (q - 32), exact
  in fp32 in any order. `q6_k_values` widens a step within a half, for tiles and row sums alike.
- Q4_K (144 bytes a 256 values): fp16 d and dmin, 12 bytes of eight 6-bit scales and mins (one each a
  group of 32), then 128 bytes of 4-bit q: a 64-value stretch is 32 bytes, their low nibbles its first 32
  values and their high nibbles the next 32; value = (d * scale) * q - dmin * min. `q4_k_tiles` gives the
  two halves of a step apart (low nibbles, high nibbles), each multiplied by its own columns of x.
- Q5_K (176 bytes a 256 values): Q4_K's d, dmin and packed scales and mins, 32 bytes of fifth bits (bit g
  of byte l: value l of group g), then Q4_K's 128 bytes of nibbles; value = (d * scale) * (q + 16 b) - dmin
  * min.
- IQ4_XS (136 bytes): fp16 d, 2 bytes of the eight scales' high bit pairs, 4 of their low nibbles, then per
  group of 32 16 bytes (low nibbles the first 16 values, high ones the next 16) naming one of IQ4_NL's 16
  levels; value = (d * (scale - 32)) * level.
- IQ3_XXS (98 bytes): fp16 d, 64 grid ids (a grid entry is 4 magnitudes), then a little-endian word a group
  of 32: four 7-bit sign ids (the eighth sign is the parity of the seven) and a 4-bit scale s; value =
  (d * (0.5 + s) * 0.5) * magnitude * sign.
- IQ3_S (110 bytes): fp16 d, 64 low bytes of 9-bit grid ids (the ninth bits in 8 bytes, one a group), 32
  sign bytes (bit j: value j of 8 negative) and 4 bytes of 4-bit scales; value = (d * (1 + 2 s)) * magnitude
  * sign.
The i-quants' levels and grids are llama.cpp's tables. IQ4_NL's 16 levels are two 64-bit constants in the
kernels (a level is a shift and a mask, no memory read: `iq4_level`); the IQ3 grids, read from the `gguf`
package, are one int32 tensor on the device (`quant_tables`, offsets IQ3_XXS_GRID and IQ3_S_GRID), an entry's
4 magnitudes the 4 bytes of one word, so a tile reads one word a grid entry (`_grid_magnitudes`), not one
value a lane: what Triton's pipeliner stages in shared memory for a tile is a quarter of what it was. Every
product is exact in fp32, so these are the reference dequantizer's values whatever the order.

For one or two rows on the CUDA cores (`q8_0_groups`, `q4_k_groups` and their row sums) a group's codes
are summed with x first and the group's scale and offset applied to that sum; there the codes become fp32
without a conversion instruction (`codes_f32`, `nibble_codes`: the byte in the mantissa of 2**23, 2**23
taken away, exact).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# a step's smallest and largest k: on tiles, and for sums on the CUDA cores (`rowwise`)
# a K-quant's step within half a super-block, an i-quant's within a quarter (more shared memory a value).
# An i-quant's rowwise step is half a super-block: a step's lane shuffles grow little with it (IQ4_XS 7
# at 64 and 128, IQ3_S 14 and 22), so a larger step sums more values a shuffle; compiled for sm_90 it holds
# 72-96 registers a thread at 128 against 51-72 at 64, no spills (IQ3_S 255 at 256, so not 256). Chosen from
# the compiled kernels (`python tests/kernels/sm90_compile.py rowwise-registers`), not timed.
STEP_LIMITS = {
    "Q8_0": (32, 1 << 12),
    **dict.fromkeys(("Q4_K", "Q5_K"), (64, 256)),
    "Q6_K": (32, 128),
    **dict.fromkeys(("IQ4_XS", "IQ3_XXS", "IQ3_S"), (32, 64)),
}
ROWWISE_STEP_LIMITS = {
    **STEP_LIMITS,
    "Q4_K": (256, 1024),
    "Q5_K": (256, 1024),
    **dict.fromkeys(("IQ4_XS", "IQ3_XXS", "IQ3_S"), (32, 128)),
}
# offsets into `quant_tables` (constexpr: the compiled kernels read them)
IQ3_XXS_GRID, IQ3_S_GRID = tl.constexpr(0), tl.constexpr(256)
# IQ4_NL's levels (kvalues_iq4nl): the first eight plus 128 as the bytes of one word, the last eight (all
# positive) of another, low byte first; both below 2**63
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_LOW = tl.constexpr(sum((level + 128) << (8 * i) for i, level in enumerate(IQ4_NL_LEVELS[:8])))
IQ4_HIGH = tl.constexpr(sum(level << (8 * i) for i, level in enumerate(IQ4_NL_LEVELS[8:])))


@functools.cache
def quant_tables(device: torch.device) -> torch.Tensor:
    """IQ3_XXS's 256 and IQ3_S's 512 grid entries, each entry's 4 magnitudes (small integers) the bytes of
    one int32, lane 0 lowest: int32 on `device`."""
    from app.kernels.gguf_quants import i_quant_tables

    tables = i_quant_tables()
    grids = torch.cat((tables["IQ3_XXS"], tables["IQ3_S"])).to(torch.uint8)
    return grids.view(torch.int32).flatten().to(device)


def quant_step(kind: str, columns: int, wanted: int, rowwise: bool = False) -> int:
    """The step of k for rows of `columns` values of `kind`: the largest power of two up to `wanted` (at
    least the type's smallest step) that divides the row; a tile's step stays within a Q4_K super-block, a
    `rowwise` one is whole super-blocks; a Q6_K step stays within half a super-block."""
    least, most = (ROWWISE_STEP_LIMITS if rowwise else STEP_LIMITS)[kind]
    step = max(least, min(wanted, most))
    while columns % step:
        step //= 2
    if step < least:
        raise ValueError(f"{kind} rows of {columns} values hold no whole steps of {least}")
    return step


@triton.jit
def codes_f32(bits, offset: tl.constexpr):
    """The integers `bits` (int32 in 0..2**23) less `offset`, as exact fp32 without a conversion."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def nibble_codes(q):
    """The low nibbles of bytes `q` (int32, 0..255) and their high nibbles times 16, as exact fp32: the byte
    in the mantissa of 2**23 once, each nibble masked from it, 2**23 taken away."""
    placed = q | 0x4B000000
    low = (placed & 0x4B00000F).to(tl.float32, bitcast=True) - 8388608.0
    high = (placed & 0x4B0000F0).to(tl.float32, bitcast=True) - 8388608.0
    return low, high


@triton.jit
def q8_0_at(rows, block, k):
    """Where block `block` of held Q8_0 rows of `k` values (byte pointers `rows`; both broadcast) keeps its
    32 codes and its fp16 scale: among the row's codes, and among the scales after them."""
    return rows + block * 32, (rows + k).to(tl.pointer_type(tl.float16)) + block


@triton.jit
def q8_0_tile(rows, col_ok, start, k, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 of k in start..start + BLOCK_K from held Q8_0 rows of `k` values (byte
    pointers `rows` [BLOCK_N]; columns not `col_ok` read as 0)."""
    blocks: tl.constexpr = BLOCK_K // 32
    codes, scales = q8_0_at(rows[None, :], (start // 32 + tl.arange(0, blocks))[:, None], k)  # [blocks, N]
    d = tl.load(scales, mask=col_ok[None, :], other=0.0).to(tl.float32)
    q = tl.load(codes[:, None, :] + tl.arange(0, 32)[None, :, None], mask=col_ok[None, None, :], other=0)
    values = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None, :]
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def _k4_scales(packed, j, mask):
    """Q4_K's six-bit scale and min of group j of super-blocks whose 12 packed bytes start at `packed`
    (`packed`, `j` and `mask` broadcast to one shape, that of the results), as fp32."""
    at = packed + j
    b_j = tl.load(at, mask=mask, other=0).to(tl.int32)
    b_up = tl.load(at + 4, mask=mask, other=0).to(tl.int32)
    b_down = tl.load(at - 4, mask=mask & (j >= 4), other=0).to(tl.int32)
    low = j < 4
    scale = tl.where(low, b_j & 63, (b_up & 15) | ((b_down >> 6) << 4))
    least = tl.where(low, b_up & 63, (b_up >> 4) | ((b_j >> 6) << 4))
    return scale.to(tl.float32), least.to(tl.float32)


@triton.jit
def _k_size(FIFTH: tl.constexpr):
    """The bytes of a Q4_K super-block, or of a Q5_K one (FIFTH)."""
    return 176 if FIFTH else 144


@triton.jit
def _k_codes_at(FIFTH: tl.constexpr):
    """Where a Q4_K super-block's nibbles begin, or a Q5_K one's (FIFTH: after its 32 bytes of fifth bits)."""
    return 48 if FIFTH else 16


@triton.jit
def _fifth_bits(block, stretch, lanes, mask):
    """Q5_K's fifth bits of a stretch's low and high groups (2 s and 2 s + 1) at `lanes` of super-blocks
    `block` (all four broadcast to one shape, that of the results), as int32 0 or 1."""
    bits = tl.load(block + 16 + lanes, mask=mask, other=0).to(tl.int32)
    return (bits >> (2 * stretch)) & 1, (bits >> (2 * stretch + 1)) & 1


@triton.jit
def q4_k_tiles(rows, col_ok, start, FIFTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The values of k in start..start + BLOCK_K from Q4_K rows (Q5_K's with FIFTH; byte pointers `rows`
    [BLOCK_N]) as two [BLOCK_K // 2, BLOCK_N] fp32 tiles: the low nibbles (k = start + 64 g + i, i < 32) and
    the high ones (k + 32). The step lies within one super-block."""
    stretches: tl.constexpr = BLOCK_K // 64
    block = rows + (start // 256) * _k_size(FIFTH)  # [BLOCK_N]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=col_ok, other=0.0).to(tl.float32)
    dmin = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=col_ok, other=0.0).to(tl.float32)
    stretch = (start % 256) // 64 + tl.arange(0, stretches)  # [stretches]
    mask = col_ok[None, :]
    scale_lo, min_lo = _k4_scales(block[None, :] + 4, (2 * stretch)[:, None], mask)
    scale_hi, min_hi = _k4_scales(block[None, :] + 4, (2 * stretch + 1)[:, None], mask)
    lanes = tl.arange(0, 32)[None, :, None]
    at = block[None, None, :] + _k_codes_at(FIFTH) + (stretch * 32)[:, None, None] + lanes
    q = tl.load(at, mask=col_ok[None, None, :], other=0).to(tl.int32)  # [stretches, 32, BLOCK_N]
    code_lo, code_hi = q & 15, q >> 4
    if FIFTH:
        fifth_lo, fifth_hi = _fifth_bits(
            block[None, None, :], stretch[:, None, None], lanes, col_ok[None, None, :]
        )
        code_lo += fifth_lo << 4
        code_hi += fifth_hi << 4
    lo = code_lo.to(tl.float32) * (d[None, :] * scale_lo)[:, None, :] - (dmin[None, :] * min_lo)[:, None, :]
    hi = code_hi.to(tl.float32) * (d[None, :] * scale_hi)[:, None, :] - (dmin[None, :] * min_hi)[:, None, :]
    return tl.reshape(lo, (BLOCK_K // 2, BLOCK_N)), tl.reshape(hi, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def q4_k_columns(start, BLOCK_K: tl.constexpr):
    """The k [BLOCK_K // 2] of a step's low-nibble values (`q4_k_tiles`); the high ones are these + 32."""
    half = tl.arange(0, BLOCK_K // 2)
    return start + (half // 32) * 64 + half % 32


@triton.jit
def q8_0_groups(rows, col_ok, start, k, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A step of k of held Q8_0 rows of `k` values (byte pointers `rows` [BLOCK_N]) for sums on the CUDA
    cores: the codes [BLOCK_N, G, 32] fp32 of its G = BLOCK_K / 32 blocks (k = start + 32 g + i), their
    scales [BLOCK_N, G]."""
    blocks: tl.constexpr = BLOCK_K // 32
    codes, scales = q8_0_at(rows[:, None], (start // 32 + tl.arange(0, blocks))[None, :], k)  # [N, G]
    d = tl.load(scales, mask=col_ok[:, None], other=0.0).to(tl.float32)
    q = tl.load(codes[:, :, None] + tl.arange(0, 32)[None, None, :], mask=col_ok[:, None, None], other=0)
    return codes_f32(q.to(tl.int32) ^ 128, 128.0), d


@triton.jit
def q8_0_row(codes, d, x_row, start, BLOCK_K: tl.constexpr):
    """One row's sums [BLOCK_N] with a `q8_0_groups` step: x at `x_row` (a pointer to the row's k = 0)."""
    blocks: tl.constexpr = BLOCK_K // 32
    ks = start + (tl.arange(0, blocks) * 32)[:, None] + tl.arange(0, 32)[None, :]
    x = tl.load(x_row + ks).to(tl.float32)  # [G, 32]
    return tl.sum(tl.sum(codes * x[None, :, :], axis=2) * d, axis=1)


@triton.jit
def q4_k_groups(rows, col_ok, start, FIFTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A step of k (S = BLOCK_K / 256 whole super-blocks) of Q4_K rows (Q5_K's with FIFTH; byte pointers
    `rows` [BLOCK_N]) for sums on the CUDA cores: the codes [BLOCK_N, S, 4, 32] fp32 of each 64-value
    stretch's low nibbles (k = start + 256 s + 64 j + i) and of its high nibbles times 16 (k + 32), Q5_K's
    fifth bits added, and each group's multiplier and offset [BLOCK_N, S, 4] (low groups', then high
    groups', whose multiplier is a sixteenth)."""
    supers: tl.constexpr = BLOCK_K // 256
    block = rows[:, None] + ((start // 256 + tl.arange(0, supers)) * _k_size(FIFTH))[None, :]  # [BLOCK_N, S]
    ok = col_ok[:, None]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)[:, :, None]
    dmin = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)[:, :, None]
    stretch = tl.arange(0, 4)[None, None, :]
    packed = block[:, :, None] + 4
    scale_lo, min_lo = _k4_scales(packed, 2 * stretch, ok[:, :, None])
    scale_hi, min_hi = _k4_scales(packed, 2 * stretch + 1, ok[:, :, None])
    lanes = tl.arange(0, 32)[None, None, None, :]
    at = block[:, :, None, None] + _k_codes_at(FIFTH) + (stretch * 32)[:, :, :, None] + lanes
    low, high = nibble_codes(tl.load(at, mask=ok[:, :, None, None], other=0).to(tl.int32))
    if FIFTH:
        fifth_lo, fifth_hi = _fifth_bits(
            block[:, :, None, None], stretch[:, :, :, None], lanes, ok[:, :, None, None]
        )
        low += (fifth_lo << 4).to(tl.float32)
        high += (fifth_hi << 8).to(tl.float32)
    return low, high, d * scale_lo, dmin * min_lo, d * scale_hi * 0.0625, dmin * min_hi


@triton.jit
def q4_k_row(low, high, mul_lo, off_lo, mul_hi, off_hi, x_row, start, BLOCK_K: tl.constexpr):
    """One row's sums [BLOCK_N] with a `q4_k_groups` step: x at `x_row` (a pointer to the row's k = 0)."""
    supers: tl.constexpr = BLOCK_K // 256
    ks = (
        start
        + (tl.arange(0, supers) * 256)[:, None, None]
        + (tl.arange(0, 4) * 64)[None, :, None]
        + tl.arange(0, 32)[None, None, :]
    )
    x_lo = tl.load(x_row + ks).to(tl.float32)  # [S, 4, 32]
    x_hi = tl.load(x_row + ks + 32).to(tl.float32)
    lo = tl.sum(low * x_lo[None], axis=3) * mul_lo - tl.sum(x_lo, axis=2)[None] * off_lo
    hi = tl.sum(high * x_hi[None], axis=3) * mul_hi - tl.sum(x_hi, axis=2)[None] * off_hi
    return tl.sum(tl.sum(lo + hi, axis=2), axis=1)


@triton.jit
def q6_k_values(rows, col_ok, start, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 of k in start..start + BLOCK_K (within a half of a super-block) from
    Q6_K rows (byte pointers `rows` [BLOCK_N]; columns not `col_ok` read as 0): each quarter's low bytes,
    the half's high bytes and the quarter's two scales loaded as stretches, widened in registers."""
    quarters: tl.constexpr = BLOCK_K // 32
    block = rows + (start // 256) * 210  # [BLOCK_N]
    half = (start % 256) // 128
    j = ((start % 128) // 32 + tl.arange(0, quarters))[:, None, None, None]  # [Q, 1, 1, 1]
    part = tl.arange(0, 2)[None, :, None, None]  # which 16 of the quarter's 32
    lane = part * 16 + tl.arange(0, 16)[None, None, :, None]
    at = block[None, None, None, :]
    mask = col_ok[None, None, None, :]
    low = tl.load(at + half * 64 + 32 * (j % 2) + lane, mask=mask, other=0).to(tl.int32)  # [Q, 2, 16, N]
    high = tl.load(at + 128 + half * 32 + lane, mask=mask, other=0).to(tl.int32)  # [1, 2, 16, N]
    scale = tl.load(at + 192 + half * 8 + 2 * j + part, mask=mask, other=0)  # [Q, 2, 1, N]
    d = tl.load(block.to(tl.pointer_type(tl.float16)) + 104, mask=col_ok, other=0.0).to(tl.float32)
    nibble = tl.where(j >= 2, low >> 4, low & 15)
    q = nibble | (((high >> (2 * j)) & 3) << 4)
    multiplier = scale.to(tl.int8, bitcast=True).to(tl.float32) * d[None, None, None, :]
    values = (q - 32).to(tl.float32) * multiplier
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def _group_lanes(rows, start, size: tl.constexpr, BLOCK_K: tl.constexpr):
    """A step's groups of 32 (within one super-block of `size` bytes): the super-blocks' byte pointers
    [1, 1, BLOCK_N], each group's index in its super-block [G, 1, 1] and the lanes 0..31 [1, 32, 1]."""
    block = (rows + (start // 256) * size)[None, None, :]
    j = ((start % 256) // 32 + tl.arange(0, BLOCK_K // 32))[:, None, None]
    return block, j, tl.arange(0, 32)[None, :, None]


@triton.jit
def iq4_xs_values(rows, col_ok, start, table, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 (within a super-block) from IQ4_XS rows; `table`: `quant_tables`."""
    block, j, lane = _group_lanes(rows, start, 136, BLOCK_K)
    mask = col_ok[None, None, :]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    high = tl.load(block + 2, mask=mask, other=0).to(tl.int32) | (
        tl.load(block + 3, mask=mask, other=0).to(tl.int32) << 8
    )
    low = tl.load(block + 4 + j // 2, mask=mask, other=0).to(tl.int32)
    scale = ((low >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
    q = tl.load(block + 8 + 16 * j + lane % 16, mask=mask, other=0).to(tl.int32)
    level = iq4_level(tl.where(lane < 16, q & 15, q >> 4))
    values = (d * (scale - 32).to(tl.float32)) * level
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def iq4_level(index):
    """IQ4_NL's level `index` (0..15) as fp32, from the two constant words (no memory read)."""
    low = index < 8
    word = tl.where(low, IQ4_LOW, IQ4_HIGH)
    byte = (word >> ((index & 7) * 8).to(tl.int64)) & 255
    return (byte - tl.where(low, 128, 0)).to(tl.float32)


@triton.jit
def _grid_magnitudes(grid, ids):
    """Magnitudes [G, 32, N] fp32 of grid entries `ids` [G, 8, N] (each entry 4 lanes): one word of `grid`
    (int32 pointer) an entry, its bytes the lanes."""
    word = tl.load(grid + ids)
    shifts = (tl.arange(0, 4) * 8)[None, None, :, None]
    magnitudes = (word[:, :, None, :] >> shifts) & 255
    return tl.reshape(magnitudes, (word.shape[0], 32, word.shape[2])).to(tl.float32)


@triton.jit
def _grid_values(grid, ids, signs, lane, multiplier):
    """A group's 32 values: the magnitudes of grid entries `ids` [G, 8, N] (`_grid_magnitudes`) times
    `multiplier`, negated where bit lane % 8 of `signs` is set."""
    negative = ((signs >> (lane % 8)) & 1) == 1
    values = multiplier * _grid_magnitudes(grid, ids)
    return tl.where(negative, -values, values)


@triton.jit
def iq3_xxs_values(rows, col_ok, start, table, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 (within a super-block) from IQ3_XXS rows; `table`: `quant_tables`."""
    block, j, lane = _group_lanes(rows, start, 98, BLOCK_K)
    mask = col_ok[None, None, :]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    word = block + 66 + 4 * j
    bits = tl.load(word, mask=mask, other=0).to(tl.int32)
    for byte in tl.static_range(1, 4):
        bits |= tl.load(word + byte, mask=mask, other=0).to(tl.int32) << (8 * byte)
    multiplier = d * (0.5 + ((bits >> 28) & 15).to(tl.float32)) * 0.5
    entry = tl.arange(0, 8)[None, :, None]
    ids = tl.load(block + 2 + 8 * j + entry, mask=mask, other=0).to(tl.int32)
    sign_id = (bits >> (7 * (lane // 8))) & 127
    parity = sign_id ^ (sign_id >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    grid = table.to(tl.pointer_type(tl.int32)) + IQ3_XXS_GRID
    values = _grid_values(grid, ids, sign_id | ((parity & 1) << 7), lane, multiplier)
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def iq3_s_values(rows, col_ok, start, table, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_K, BLOCK_N] fp32 (within a super-block) from IQ3_S rows; `table`: `quant_tables`."""
    block, j, lane = _group_lanes(rows, start, 110, BLOCK_K)
    mask = col_ok[None, None, :]
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    packed = tl.load(block + 106 + j // 2, mask=mask, other=0).to(tl.int32)
    multiplier = d * (1 + 2 * ((packed >> (4 * (j % 2))) & 15)).to(tl.float32)
    entry = tl.arange(0, 8)[None, :, None]
    ninth = (tl.load(block + 66 + j, mask=mask, other=0).to(tl.int32) >> entry) & 1
    ids = tl.load(block + 2 + 8 * j + entry, mask=mask, other=0).to(tl.int32) | (ninth << 8)
    signs = tl.load(block + 74 + 4 * j + lane // 8, mask=mask, other=0).to(tl.int32)
    grid = table.to(tl.pointer_type(tl.int32)) + IQ3_S_GRID
    values = _grid_values(grid, ids, signs, lane, multiplier)
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def held_values(
    HELD: tl.constexpr, rows, col_ok, start, k, table, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Values [BLOCK_K, BLOCK_N] fp32 of a step of held rows of `k` values of any type but Q4_K and Q5_K
    (`HELD`: triton_moe's HELD_CODES)."""
    if HELD == 1:
        values = q8_0_tile(rows, col_ok, start, k, BLOCK_K, BLOCK_N)
    elif HELD == 3:
        values = q6_k_values(rows, col_ok, start, BLOCK_K, BLOCK_N)
    elif HELD == 5:
        values = iq4_xs_values(rows, col_ok, start, table, BLOCK_K, BLOCK_N)
    elif HELD == 6:
        values = iq3_xxs_values(rows, col_ok, start, table, BLOCK_K, BLOCK_N)
    else:
        values = iq3_s_values(rows, col_ok, start, table, BLOCK_K, BLOCK_N)
    return values
