"""Times the kernels that read weights held as GGUF blocks, under several tile choices, at Qwen3-30B-A3B's
shapes (replayed from CUDA graphs, weights rotated so that repeats do not run from L2).

    python benchmarks/tune_held.py [--kinds Q4_K Q8_0 bf16] [--tokens 1 8 16 32] [--default-only]

Routed experts (`fused_experts`, routing alignment to the sum) and the dense projections (`tiled_linear`:
attention's qkv and output, the LM head) for each quant type, beside bf16 weights (their default tiles
alone), on tensor-core tiles ("tiles") and with each row summed on the CUDA cores ("rows": block_m, block_n,
block_k, warps); each line gives the time
and the bytes of weights it must read over that time. The tiles in app/kernels/triton_linear.py
(`held_tiles`) and app/kernels/triton_moe.py come from these lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.gguf_quants import random_blocks
from app.kernels.triton_linear import held_tiles
from app.kernels.triton_moe import EXACT_TILES, MoeTiles, fused_experts, moe_tiles, tiled_linear
from benchmarks.roofline import expected_experts, replayed_ms

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DENSE = {"qkv": (5120, HIDDEN), "o": (HIDDEN, 4096), "lm_head": (151936, HIDDEN)}
EXPERT_TILES = {
    "tiles 16x64x128 w4 s4": EXACT_TILES,
    "tiles 16x64x128 w8 s3": MoeTiles(16, 64, 128, 8, 3),
    "rows 1x8x256 w2": MoeTiles(1, 8, 256, 2, 2, rowwise=True),
    "rows 1x4x256 w1": MoeTiles(1, 4, 256, 1, 2, rowwise=True),
    "rows 1x16x256 w4": MoeTiles(1, 16, 256, 4, 2, rowwise=True),
}
DENSE_TILES = {
    "tiles 16x32x128 w4 s4": MoeTiles(16, 32, 128, 4, 4),
    "tiles 16x64x128 w4 s4": MoeTiles(16, 64, 128, 4, 4),
    "rows 1x8x256 w2": MoeTiles(1, 8, 256, 2, 2, rowwise=True),
    "rows 1x4x256 w1": MoeTiles(1, 4, 256, 1, 2, rowwise=True),
    "rows 1x2x256 w1": MoeTiles(1, 2, 256, 1, 2, rowwise=True),
    "rows 1x4x512 w1": MoeTiles(1, 4, 512, 1, 2, rowwise=True),
}
SETS = 3


def _weights(kind: str, shape: tuple[int, ...], copy: int) -> torch.Tensor:
    if kind == "bf16":
        g = torch.Generator(device="cuda").manual_seed(copy)
        return (torch.randn(shape, device="cuda", generator=g) * 0.02).bfloat16()
    return random_blocks(kind, shape, copy, device="cuda")


def _report(what: str, ms: float, moved: float) -> None:
    print(f"{what:44s} {ms * 1000:9.1f} us  {moved / ms / 1e9:6.2f} TB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["Q4_K", "Q8_0", "bf16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--default-only", action="store_true", help="time the default tiles alone")
    args = parser.parse_args()
    for kind in args.kinds:
        sets = [
            (_weights(kind, (EXPERTS, 2 * INTER, HIDDEN), c), _weights(kind, (EXPERTS, HIDDEN, INTER), c + 9))
            for c in range(SETS)
        ]
        per_expert = sum(w[0].numel() * w.element_size() for w in sets[0])
        for tokens in args.tokens:
            x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
            weights, ids = torch.randn(tokens, EXPERTS, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
            weights = weights.bfloat16()
            moved = expected_experts(EXPERTS, TOP_K, tokens) * per_expert
            choices = {"default": moe_tiles(tokens, exact=False, held=kind != "bf16")}
            if kind != "bf16" and not args.default_only:
                choices |= EXPERT_TILES
            for name, tiles in choices.items():
                calls = [
                    lambda w=w, t=tiles, x=x, i=ids, r=weights: fused_experts(x, i, r, *w, tiles=t)
                    for w in sets
                ]
                _report(f"{kind} experts tokens {tokens} {name}", replayed_ms(calls, 30), moved)
        del sets
        for label, shape in DENSE.items():
            dense = [_weights(kind, shape, c) for c in range(SETS)]
            moved = dense[0].numel() * dense[0].element_size()
            for tokens in args.tokens:
                x = torch.randn(tokens, shape[1], device="cuda").bfloat16()
                choices = {"default": held_tiles(tokens, shape[0])}
                if kind != "bf16" and not args.default_only:
                    choices |= DENSE_TILES
                for name, tiles in choices.items():
                    calls = [lambda w=w, t=tiles, x=x: tiled_linear(x, w, None, t) for w in dense]
                    _report(f"{kind} {label} tokens {tokens} {name}", replayed_ms(calls, 30), moved)
            del dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
