"""The CUDA held kernels' arithmetic (native/held_experts.cu), step by step on the CPU: each lane's words of
codes widened by the kernels' bit operations into bf16 fragment registers, the activations permuted into
theirs, each m16n8k16 MMA assembled from the 32 lanes' registers by PTX's fragment layout, the group sums
from MMAs against ones, Q4_K's scales from the word-wide decode of its packed bytes, and the fp32 scaling;
its result against the `gguf` package's dequantized weights. The GPU runs the kernels themselves
(tests/gpu/test_cuda_held_gpu.py); this keeps the scheme checked where CI runs, for changes to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.kernels.gguf_quants import dequantize, random_blocks, to_held

ROWS, PAIRS = 32, 8  # a block's rows (two 16-row MMA blocks) and pair slots (the MMA's 8 columns)
BF16_128 = 0x43004300  # two bf16 128.0: a code ORed into the mantissa is 128 + code
# Q8_0's (shift, magic) passes: 128 + low nibble, 2048 + 16 (high nibble ^ 8)
Q8_0_PASSES = [(0, BF16_128), (4, 0x45084508)]


def _halves(register: int) -> tuple[float, float]:
    """A 32-bit register's two bf16 values, low half first."""
    pair = np.array([register & 0xFFFF, register >> 16], dtype=np.uint32) << 16
    return tuple(pair.view(np.float32).astype(np.float64))


def _widen(word: int, shift: int, magic: int) -> int:
    return ((word >> shift) & 0x000F000F) ^ magic


def _byte_perm(a: int, b: int, selector: int) -> int:
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(source[(selector >> (4 * i)) & 0xF] for i in range(4)), "little")


def _mma(a_regs: list[list[int]], b_regs: list[list[int]]) -> np.ndarray:
    """D [32 lanes, 4] of one m16n8k16 MMA from each lane's 4 A registers and 2 B registers (PTX's layouts:
    lane = 4 g + t holds A rows g and g + 8 at k 2t, 2t + 1 and + 8; B column g at the same k; D rows g and
    g + 8 at columns 2t, 2t + 1)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a[row, k], a[row, k + 1] = _halves(a_regs[lane][reg])
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            b[k, g], b[k + 1, g] = _halves(b_regs[lane][reg])
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


def _unit_groups(kind: str, held: np.ndarray, k: int, unit: int) -> list[tuple[list, int, list, list]]:
    """A unit's groups: (widening passes, x offset, D [row], E [row]) for each 32-code group of its bytes."""
    if kind == "Q8_0":
        at = k + 2 * unit
        d = [float(np.frombuffer(row[at : at + 2].tobytes(), np.float16)[0]) for row in held]
        return [(Q8_0_PASSES, 32 * unit, d, [2304.0 * v for v in d])]
    block, stretch = divmod(unit, 4)
    groups = []
    for half in range(2):
        d_rows, e_rows = [], []
        for row in held:
            head = row[block * 144 : block * 144 + 16]
            d, dmin = np.frombuffer(head[:4].tobytes(), np.float16).astype(np.float32)
            scale, least = _q4_k_scales(head)[2 * stretch + half]
            d_rows.append(float(np.float32(d * scale)))
            e_rows.append(128.0 * d_rows[-1] + float(dmin) * least)
        groups.append(([(4 * half, BF16_128)], block * 256 + stretch * 64 + 32 * half, d_rows, e_rows))
    return groups


def _codes_at(kind: str, unit: int, t: int) -> int:
    return 32 * unit + 8 * t if kind == "Q8_0" else (unit // 4) * 144 + 16 + 32 * (unit % 4) + 8 * t


def _emulate(kind: str, held: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """The block's result [pairs, 32 rows] as the kernels compute it."""
    acc = np.zeros((2, 32, 4))
    units = k // (64 if kind == "Q4_K" else 32)
    ones = [[0x3F803F80] * 4 for _ in range(32)]
    for unit in range(units):
        words = {}  # (block, r, lane) -> the lane's two words of row (16 block + g + 8 r)
        for lane, (g, t) in enumerate(_lanes()):
            for b in range(2):
                for r in range(2):
                    at = _codes_at(kind, unit, t)
                    row = held[16 * b + g + 8 * r]
                    words[b, r, lane] = [_word(row, at), _word(row, at + 4)]
        for passes, offset, d, e in _unit_groups(kind, held, k, unit):
            b_regs = []  # [lane][half] -> (reg0, reg1)
            for g, t in _lanes():
                v = [_word(x[g], 2 * (offset + 8 * t) + 4 * i) for i in range(4)]
                halves = [(v[0], v[1]), (v[2], v[3])]
                b_regs.append([[_byte_perm(lo, hi, s) for s in (0x5410, 0x7632)] for lo, hi in halves])
            sums = sum(_mma(ones, [b_regs[lane][h] for lane in range(32)]) for h in range(2))
            for b in range(2):
                c = np.zeros((32, 4))
                for shift, magic in passes:
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


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_the_kernels_fragment_arithmetic_gives_the_dequantized_products(kind: str) -> None:
    k = 512
    blocks = random_blocks(kind, (ROWS, k), seed=3)
    held = to_held(kind, blocks).numpy()
    x = torch.randn(PAIRS, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    bits = x.view(torch.int16).numpy().view(np.uint16).view(np.uint8).reshape(PAIRS, -1)
    expected = x.double().numpy() @ dequantize(kind, blocks, (ROWS, k)).double().numpy().T
    got = _emulate(kind, held, bits, k)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
