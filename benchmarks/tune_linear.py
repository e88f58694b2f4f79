"""Times the dense projections of a decode window (few rows) under cuBLAS and the Triton kernels' choices.

    python benchmarks/tune_linear.py [--rows 1 4 16] [--shape "q30 o" ...]

For each weight shape of Qwen3-30B-A3B and Qwen3-Next (projections, routers, shared expert) and each row
count: the time of one projection replayed from a CUDA graph that runs it over weight copies in turn (more
bytes than the L2 holds, so no call reads its weight from L2), and the bandwidth that is on the weight. Two
ways: `alone` (projections back to back) and `after norm` (each projection follows an RMSNorm of its input,
as in a decoder layer, and the norms' own time is taken off): with dependent launches a weight is
read while the kernel before it finishes, which only the second shows. `few_rows_linear` in
app/kernels/triton_linear.py follows the `after norm` table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_linear import (
    MAX_PROGRAM_ELEMENTS,
    SMALL_WEIGHT_TILES,
    TILE,
    WIDE_WEIGHT_TILES,
    few_rows_linear,
    resident_tile_linear,
    row_linear,
)
from app.kernels.triton_moe import tiled_linear
from app.kernels.triton_norm import rms_norm
from benchmarks.roofline import graph_us, measure_copy_bandwidth

SHAPES = {  # name: (out features, in features)
    "q30 qkv": (5120, 2048),
    "q30 o / qnext gdn out": (2048, 4096),
    "q30 router": (128, 2048),
    "qnext qkvz": (12288, 2048),
    "qnext attn qkv": (9216, 2048),
    "qnext router": (512, 2048),
    "qnext shared gate_up": (1024, 2048),
    "qnext shared down": (2048, 512),
    "qnext ba": (64, 2048),
}
# `row_linear` (a lone row): weight elements a program holds, warps
ROW_PROGRAMS = [(elements, warps) for elements in (2048, 4096, 8192, 16384) for warps in (4, 8)]
# resident tiles with k in pieces: the piece, warps
RESIDENT_CHUNKS = [(chunk_k, warps) for chunk_k in (128, 256, 512) for warps in (4, 8)]
L2_BYTES = 60 << 20

Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _time(call: Call, xs: list[torch.Tensor], weights: list[torch.Tensor], after_norm: bool) -> float:
    """Microseconds of one call over the weight copies in turn (less the norms before them)."""
    norm_w = torch.ones(xs[0].shape[1], device="cuda", dtype=xs[0].dtype)
    if not after_norm:
        return graph_us([lambda x=x, w=w: call(x, w) for x, w in zip(xs, weights, strict=True)]) / len(xs)
    pairs = [
        lambda x=x, w=w: call(rms_norm(x, norm_w, 1e-6, False), w) for x, w in zip(xs, weights, strict=True)
    ]
    norms = [lambda x=x: rms_norm(x, norm_w, 1e-6, False) for x in xs]
    return (graph_us(pairs) - graph_us(norms)) / len(xs)


def candidates(n: int, k: int, rows: int) -> dict[str, Call]:
    """cuBLAS, the fixed tiles, the resident tiles and the lone-row programs where they fit this shape, and
    what the engine picks."""
    cells: dict[str, Call] = {"cublas": lambda x, w: torch.nn.functional.linear(x, w)}
    block_k = triton.next_power_of_2(k)
    if rows <= TILE:
        cells["tiles 16x16x512"] = lambda x, w: tiled_linear(x, w, None, SMALL_WEIGHT_TILES)
        cells["tiles 16x64x128"] = lambda x, w: tiled_linear(x, w, None, WIDE_WEIGHT_TILES)
        if TILE * block_k <= MAX_PROGRAM_ELEMENTS:
            cells["resident tiles"] = lambda x, w: resident_tile_linear(x, w, None)
            for chunk_k, warps in RESIDENT_CHUNKS if block_k > 128 else []:
                cells[f"resident {chunk_k}-pieces w{warps}"] = lambda x, w, c=chunk_k, nw=warps: (
                    resident_tile_linear(x, w, None, c, nw)
                )
    for elements, warps in ROW_PROGRAMS if rows <= TILE else []:
        block_n = max(1, elements // block_k)
        if block_n * block_k <= MAX_PROGRAM_ELEMENTS and block_n * block_k // (32 * warps) >= 8:
            label = f"row {block_n}r w{warps}"
            cells[label] = lambda x, w, b=block_n, nw=warps: row_linear(x, w, None, b, nw)
    cells["engine"] = few_rows_linear
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: all")
    args = parser.parse_args()
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds a call (TB/s on the weight)")
    for name in args.shape or SHAPES:
        n, k = SHAPES[name]
        size = n * k * 2
        copies = max(2, -(-2 * L2_BYTES // size))
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        for rows in args.rows:
            xs = [torch.randn(rows, k, device="cuda").bfloat16() for _ in range(copies)]
            for after_norm in (False, True):
                cells = {
                    label: _time(call, xs, weights, after_norm)
                    for label, call in candidates(n, k, rows).items()
                }
                best = min((c for c in cells if c != "engine"), key=cells.get)
                line = "  ".join(f"{label} {us:.1f} ({size / us / 1e6:.2f})" for label, us in cells.items())
                mode = "after norm" if after_norm else "alone"
                print(f"{name} [{n}x{k}] rows {rows} {mode}: best {best}; {line}")
        del weights


if __name__ == "__main__":
    main()
