"""Times the routed-experts kernels under several tile choices at Qwen3-30B-A3B's expert shapes (graphs).

    python benchmarks/tune_moe.py

For each batch size (tokens) and tile choice: the time of `fused_experts` (routing alignment, both grouped
matmuls and the sum) replayed from a CUDA graph, as decode windows run it, and the bandwidth it reaches on the
expert weights it must read, against the copy bandwidth of the card. The tiles in app/kernels/triton_moe.py
come from its table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.triton_moe import EXACT_TILES, MoeTiles, fused_experts
from benchmarks.roofline import expected_experts, measure_copy_bandwidth, replayed_ms

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
CANDIDATES = {
    "16x64x64 w4 s3": MoeTiles(16, 64, 64, 4, 3),
    "16x32x128 w4 s3": MoeTiles(16, 32, 128, 4, 3),
    "16x16x128 w4 s4": MoeTiles(16, 16, 128, 4, 4),
    "16x32x128 w2 s4": MoeTiles(16, 32, 128, 2, 4),
    "16x32x128 w4 s4": MoeTiles(16, 32, 128, 4, 4),
    "16x64x128 w4 s4": MoeTiles(16, 64, 128, 4, 4),
    "16x128x64 w4 s4": MoeTiles(16, 128, 64, 4, 4),
    "16x32x256 w4 s3": MoeTiles(16, 32, 256, 4, 3),
    "64x128x64 w8 s3": MoeTiles(64, 128, 64, 8, 3),
    "64x128x64 w4 s4": MoeTiles(64, 128, 64, 4, 4),
    "128x128x64 w8 s3": MoeTiles(128, 128, 64, 8, 3),
    "64x256x64 w8 s3": MoeTiles(64, 256, 64, 8, 3),
}


def _time(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    sets: list[tuple[torch.Tensor, torch.Tensor]],
    tiles: MoeTiles,
    replays: int = 40,
) -> float:
    """Mean milliseconds of one call replayed from CUDA graphs (as decode windows run it).

    One graph per weight set, replayed in turn, so that repeats do not read the weights from L2.
    """
    calls = [
        lambda gate_up=gate_up, down=down: fused_experts(x, ids, weights, gate_up, down, tiles=tiles)
        for gate_up, down in sets
    ]
    return replayed_ms(calls, replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 8192])
    args = parser.parse_args()
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    sets = []
    for copy in range(4):  # rotate weights so repeats do not run from L2
        g = torch.Generator(device="cuda").manual_seed(copy)
        gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
        down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * 0.02).bfloat16()
        sets.append((gate_up, down))
    expert_bytes = 3 * INTER * HIDDEN * 2
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        weights, ids = torch.randn(tokens, EXPERTS, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
        weights = weights.bfloat16()
        moved = expected_experts(EXPERTS, TOP_K, tokens) * expert_bytes
        for name, tiles in CANDIDATES.items():
            if tokens > 64 and tiles.block_m == 16 and tiles.block_k > 128:
                continue
            ms = _time(x, ids, weights, sets, tiles)
            gate_up, down = sets[0]
            same = torch.equal(
                fused_experts(x, ids, weights, gate_up, down, tiles=tiles),
                fused_experts(x, ids, weights, gate_up, down, tiles=EXACT_TILES),
            )
            print(
                f"tokens {tokens:5d} {name:18s} {ms * 1000:9.1f} us  "
                f"{moved / ms / 1e9:6.2f} TB/s ({moved / ms / 1e9 / (bandwidth / 1e12):.0%} of copy)  "
                f"bits of the exact tiles: {'same' if same else 'differ'}"
            )


if __name__ == "__main__":
    main()
