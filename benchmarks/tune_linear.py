"""Times the dense projections of a decode window (few rows) under cuBLAS and the Triton tile choices.

    python benchmarks/tune_linear.py

For each weight shape of Qwen3-30B-A3B and Qwen3-Next (projections, router, LM head) and 1 / 4 rows: the time
of one projection replayed from CUDA graphs, as decode windows run it, over weight copies rotated so that no
repeat reads its weight from L2, and the bandwidth that is on the weight. `few_rows_tiles` in
app/kernels/triton_moe.py follows its table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_moe import MoeTiles, tiled_linear
from benchmarks.roofline import measure_copy_bandwidth

SHAPES = {  # name: (out features, in features)
    "q30 qkv": (5120, 2048),
    "q30 o": (2048, 4096),
    "q30 router": (128, 2048),
    "qnext qkvz": (12288, 2048),
    "qnext gdn out": (2048, 4096),
    "qnext attn qkv": (9216, 2048),
    "qnext router": (512, 2048),
    "qnext shared gate_up": (1024, 2048),
    "qnext shared down": (2048, 512),
    "lm head": (151936, 2048),
}
CANDIDATES = {
    "16x16x256 w4 s4": MoeTiles(16, 16, 256, 4, 4),
    "16x32x256 w4 s4": MoeTiles(16, 32, 256, 4, 4),
    "16x16x128 w4 s4": MoeTiles(16, 16, 128, 4, 4),
    "16x32x128 w4 s3": MoeTiles(16, 32, 128, 4, 3),
    "16x64x128 w4 s4": MoeTiles(16, 64, 128, 4, 4),
    "16x16x512 w4 s3": MoeTiles(16, 16, 512, 4, 3),
}
L2_BYTES = 60 << 20


def _time(
    call: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], replays: int = 50
) -> float:
    """Mean microseconds of one call, replayed from one CUDA graph per weight copy in turn."""
    graphs = []
    for w in weights:
        call(w)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                call(w)
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(replays):
        graphs[i % len(graphs)].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / 10 * 1000


def main() -> None:
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds a call (TB/s on the weight)")
    for name, (n, k) in SHAPES.items():
        size = n * k * 2
        copies = max(2, -(-2 * L2_BYTES // size))
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        for rows in (1, 4):
            x = torch.randn(rows, k, device="cuda").bfloat16()
            cells = {"cublas": _time(lambda w, x=x: torch.nn.functional.linear(x, w), weights)}
            for label, tiles in CANDIDATES.items():
                cells[label] = _time(lambda w, x=x, t=tiles: tiled_linear(x, w, None, t), weights)
            best = min(cells, key=cells.get)
            line = "  ".join(f"{label} {us:.1f} ({size / us / 1e6:.2f})" for label, us in cells.items())
            print(f"{name} [{n}x{k}] rows {rows}: best {best}; {line}")
        del weights


if __name__ == "__main__":
    main()
