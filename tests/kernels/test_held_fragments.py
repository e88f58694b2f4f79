"""The CUDA held kernels' arithmetic (native/held_experts.cu), step by step on the CPU: each lane's words of
codes widened by the kernels' bit operations into bf16 fragment registers, the activations permuted into
theirs, each m16n8k16 MMA assembled from the 32 lanes' registers by PTX's fragment layout, the group sums
from MMAs against ones, Q4_K's scales from the word-wide decode of its packed bytes, and the fp32 scaling
(Q8_0 also as the Q8_HALF build's fp16 operands); its result against the `gguf` package's dequantized
weights. The codes and scales come through a warp's stage as its lanes' copies lay it out. The GPU runs the
kernels themselves (tests/gpu/test_cuda_held_gpu.py); this keeps the scheme checked where CI runs, for
changes to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.kernels.gguf_quants import dequantize, random_blocks, to_held

ROWS, PAIRS = 32, 8  # a block's rows (two 16-row MMA blocks) and pair slots (the MMA's 8 columns)
ROW_BYTES = 160  # a row's stride in a warp's stage
ITERATION_BYTES = {"Q4_K": 144, "Q8_0": 128}  # a row's bytes an iteration of a warp's loop
BF16_128 = 0x43004300  # two bf16 128.0: a code ORed into the mantissa is 128 + code
# Q8_0's (shift, magic) passes: 128 + low nibble, 2048 + 16 (high nibble ^ 8)
Q8_0_PASSES = [(0, BF16_128), (4, 0x45084508)]
F16_EXPONENT = 0x64646464  # fp16 1024.0's high byte, four times: a byte under it is 1024 + byte (Q8_HALF)


def _halves(register: int, half: bool = False) -> tuple[float, float]:
    """A 32-bit register's two bf16 values (fp16 where `half`), low half first."""
    if half:
        return tuple(
            np.array([register & 0xFFFF, register >> 16], np.uint16).view(np.float16).astype(np.float64)
        )
    pair = np.array([register & 0xFFFF, register >> 16], dtype=np.uint32) << 16
    return tuple(pair.view(np.float32).astype(np.float64))


def _to_f16x2(register: int) -> int:
    """`bf16x2_to_f16x2`: a register's two bf16 as two fp16, rounded to nearest."""
    low, high = np.array(_halves(register), np.float32).astype(np.float16).view(np.uint16)
    return int(low) | int(high) << 16


def _widen(word: int, shift: int, magic: int) -> int:
    return ((word >> shift) & 0x000F000F) ^ magic


def _byte_perm(a: int, b: int, selector: int) -> int:
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(source[(selector >> (4 * i)) & 0xF] for i in range(4)), "little")


def _mma(a_regs: list[list[int]], b_regs: list[list[int]], half: bool = False) -> np.ndarray:
    """D [32 lanes, 4] of one m16n8k16 MMA from each lane's 4 A registers and 2 B registers, bf16 (fp16 where
    `half`) (PTX's layouts: lane = 4 g + t holds A rows g and g + 8 at k 2t, 2t + 1 and + 8; B column g at
    the same k; D rows g and g + 8 at columns 2t, 2t + 1)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a[row, k], a[row, k + 1] = _halves(a_regs[lane][reg], half)
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            b[k, g], b[k + 1, g] = _halves(b_regs[lane][reg], half)
    d = a @ b
    return np.array([[d[g, c], d[g, c + 1], d[g + 8, c], d[g + 8, c + 1]] for g, c in _columns()])


def _lanes() -> list[tuple[int, int]]:
    return [(lane >> 2, lane & 3) for lane in range(32)]


def _columns() -> list[tuple[int, int]]:
    """Each lane's D row g and first column 2 t."""
    return [(g, 2 * t) for g, t in _lanes()]


def _word(data: np.ndarray, at: int) -> int:
    return int.from_bytes(data[at : at + 4].tobytes(), "little")


def _q4_k_scales(head: np.ndarray) -> list[tuple[int, int]]:
    """The kernels' decode of a super-block's 12 packed bytes: (scale, min) of its 8 groups."""
    y, z, w = _word(head, 4), _word(head, 8), _word(head, 12)
    scales = [y & 0x3F3F3F3F, (w & 0x0F0F0F0F) | (((y >> 6) & 0x03030303) << 4)]
    mins = [z & 0x3F3F3F3F, ((w >> 4) & 0x0F0F0F0F) | (((z >> 6) & 0x03030303) << 4)]
    return [(_byte(scales, j), _byte(mins, j)) for j in range(8)]


def _byte(words: list[int], j: int) -> int:
    return (words[j >> 2] >> (8 * (j & 3))) & 0xFF


def _copy_iteration(kind: str, held: np.ndarray, it: int, k: int) -> np.ndarray:
    """A warp's stage after its lanes' copies of iteration `it` (`copy_iteration`): in pass p, lane L copies
    16-byte piece L % 8 of row 4 p + L / 8, and the lane of piece 0 the row's remainder."""
    stage = np.zeros(ROWS * ROW_BYTES, np.uint8)
    size = ITERATION_BYTES[kind]
    for p in range(8):
        for lane in range(32):
            row, piece = 4 * p + lane // 8, lane % 8
            start, to = it * size, row * ROW_BYTES
            pieces = [(16 * piece, held[row, start + 16 * piece : start + 16 * piece + 16])]
            if piece == 0:
                rest = (
                    held[row, start + 128 : start + 144]
                    if kind == "Q4_K"
                    else held[row, k + 8 * it : k + 8 * it + 8]
                )
                pieces.append((128, rest))
            for at, data in pieces:
                stage[to + at : to + at + len(data)] = data
    return stage


def _stage_row(stage: np.ndarray, row: int) -> np.ndarray:
    return stage[row * ROW_BYTES : (row + 1) * ROW_BYTES]


def _unit_groups(kind: str, stage: np.ndarray, unit: int, half: bool) -> list[tuple[list, int, list, list]]:
    """A unit's groups: (widening passes, x offset, D [row], E [row]) for each 32-code group of its bytes,
    its scales read from the stage (Q8_0's offset 1152 where `half`, whose codes take no passes)."""
    it, step = divmod(unit, 4)
    rows = [_stage_row(stage, row) for row in range(ROWS)]
    if kind == "Q8_0":
        d = [
            float(np.frombuffer(row[128 + 2 * step : 130 + 2 * step].tobytes(), np.float16)[0])
            for row in rows
        ]
        return [(Q8_0_PASSES, 32 * unit, d, [(1152.0 if half else 2304.0) * v for v in d])]
    groups = []
    for half in range(2):
        d_rows, e_rows = [], []
        for row in rows:
            head = row[:16]
            d, dmin = np.frombuffer(head[:4].tobytes(), np.float16).astype(np.float32)
            scale, least = _q4_k_scales(head)[2 * step + half]
            d_rows.append(float(np.float32(d * scale)))
            e_rows.append(128.0 * d_rows[-1] + float(dmin) * least)
        groups.append(([(4 * half, BF16_128)], it * 256 + step * 64 + 32 * half, d_rows, e_rows))
    return groups


def _codes_at(kind: str, step: int, t: int) -> int:
    """Where a lane's 8 bytes of a row's unit `step` of an iteration lie in the row's stretch of the stage."""
    return (16 if kind == "Q4_K" else 0) + 32 * step + 8 * t


def _half_codes(words: list[int]) -> list[int]:
    """`group_mma_half`'s A registers of half h from a lane's word of row g and of row g + 8: each byte with
    its top bit flipped, under fp16 1024's exponent, bytes {0, 2} then {1, 3}."""
    flipped = [word ^ 0x80808080 for word in words]
    return [_byte_perm(word, F16_EXPONENT, selector) for selector in (0x4240, 0x4341) for word in flipped]


def _emulate(
    kind: str, held: np.ndarray, x: np.ndarray, k: int, half: bool = False, x16: bool = False
) -> np.ndarray:
    """The block's result [pairs, 32 rows] as the kernels compute it (`half`: Q8_0's codes as fp16 operands,
    the Q8_HALF build's gate and up; `x16`: the activations' bytes given as fp16, as DOWN_HALF's down reads
    gate_up's output, not converted from bf16)."""
    acc = np.zeros((2, 32, 4))
    units = k // (64 if kind == "Q4_K" else 32)
    ones = [[0x3C003C00 if half else 0x3F803F80] * 4 for _ in range(32)]
    for unit in range(units):
        if unit % 4 == 0:
            stage = _copy_iteration(kind, held, unit // 4, k)
        words = {}  # (block, r, lane) -> the lane's two words of row (16 block + g + 8 r)
        for lane, (g, t) in enumerate(_lanes()):
            for b in range(2):
                for r in range(2):
                    at = _codes_at(kind, unit % 4, t)
                    row = _stage_row(stage, 16 * b + g + 8 * r)
                    words[b, r, lane] = [_word(row, at), _word(row, at + 4)]
        for passes, offset, d, e in _unit_groups(kind, stage, unit, half):
            b_regs = []  # [lane][half] -> (reg0, reg1)
            for g, t in _lanes():
                v = [_word(x[g], 2 * (offset + 8 * t) + 4 * i) for i in range(4)]
                halves = [(v[0], v[1]), (v[2], v[3])]
                regs = [[_byte_perm(lo, hi, s) for s in (0x5410, 0x7632)] for lo, hi in halves]
                converted = half and not x16  # bf16 activations as fp16 operands
                b_regs.append([[_to_f16x2(reg) for reg in pair] for pair in regs] if converted else regs)
            sums = sum(_mma(ones, [b_regs[lane][h] for lane in range(32)], half) for h in range(2))
            for b in range(2):
                c = np.zeros((32, 4))
                for h in range(2) if half else ():
                    a_regs = [_half_codes([words[b, 0, lane][h], words[b, 1, lane][h]]) for lane in range(32)]
                    c += _mma(a_regs, [b_regs[lane][h] for lane in range(32)], half=True)
                for shift, magic in () if half else passes:
                    for h in range(2):
                        a_regs = [
                            [
                                _widen(words[b, r, lane][h], shift + extra, magic)
                                for extra, r in ((0, 0), (0, 1), (8, 0), (8, 1))
                            ]
                            for lane in range(32)
                        ]
                        c += _mma(a_regs, [b_regs[lane][h] for lane in range(32)])
                for lane, (g, _) in enumerate(_lanes()):
                    for i in range(4):
                        row = 16 * b + g + 8 * (i >> 1)
                        acc[b, lane, i] += d[row] * c[lane, i] - e[row] * sums[lane, i]
    out = np.zeros((PAIRS, ROWS))
    for lane, (g, t) in enumerate(_lanes()):
        for i in range(4):
            for b in range(2):
                out[2 * t + (i & 1), 16 * b + g + 8 * (i >> 1)] = acc[b, lane, i]
    return out


@pytest.mark.parametrize(("kind", "half"), [("Q4_K", False), ("Q8_0", False), ("Q8_0", True)])
def test_the_kernels_fragment_arithmetic_gives_the_dequantized_products(kind: str, half: bool) -> None:
    k = 512
    blocks = random_blocks(kind, (ROWS, k), seed=3)
    held = to_held(kind, blocks).numpy()
    x = torch.randn(PAIRS, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    bits = x.view(torch.int16).numpy().view(np.uint16).view(np.uint8).reshape(PAIRS, -1)
    expected = x.double().numpy() @ dequantize(kind, blocks, (ROWS, k)).double().numpy().T
    got = _emulate(kind, held, bits, k, half)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_q8_0_down_in_halves_scales_its_fp16_input_back() -> None:
    """DOWN_HALF: down reads gate_up's output as fp16 of act / ACT_SCALE (64) and scales its sums back, so
    activations far beyond fp16's range (here up to about 10^6) give the products of the values they hold."""
    k = 512
    blocks = random_blocks("Q8_0", (ROWS, k), seed=5)
    held = to_held("Q8_0", blocks).numpy()
    act = torch.randn(PAIRS, k, generator=torch.Generator().manual_seed(6)) * 2.0 ** torch.randint(
        -12, 20, (PAIRS, k), generator=torch.Generator().manual_seed(7)
    )
    given = (act / 64).clamp(-65504, 65504).half()
    bits = given.view(torch.int16).numpy().view(np.uint16).view(np.uint8).reshape(PAIRS, -1)
    values = given.double().numpy() * 64
    assert np.abs(values).max() > 65504
    expected = values @ dequantize("Q8_0", blocks, (ROWS, k)).double().numpy().T
    got = _emulate("Q8_0", held, bits, k, half=True, x16=True) * 64
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_a_half_warps_reads_of_a_units_codes_are_apart_in_banks(kind: str) -> None:
    """Each 8-byte read of a unit's codes from the stage: the 16 lanes of a half-warp (one pass of shared
    memory for 64-bit reads) touch 32 different 4-byte banks, for every row set and unit."""
    for step in range(4):
        for b in range(2):
            for r in range(2):
                for half in range(2):
                    banks = set()
                    for g, t in _lanes()[16 * half : 16 * half + 16]:
                        at = (16 * b + g + 8 * r) * ROW_BYTES + _codes_at(kind, step, t)
                        banks |= {(at // 4) % 32, (at // 4 + 1) % 32}
                    assert len(banks) == 32
