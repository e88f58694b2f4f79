"""Times the kernels that read weights held as GGUF blocks, under several tile choices, at Qwen3-30B-A3B's
shapes (replayed from CUDA graphs, weights rotated so that repeats do not run from L2).

    python benchmarks/tune_held.py [--kinds Q4_K Q8_0 bf16] [--tokens 1 8 16 32] [--default-only]
    python benchmarks/tune_held.py --kinds IQ3_S IQ4_XS --tokens 8 32 2048
    python benchmarks/tune_held.py --kinds Q4_K Q8_0 --tokens 1 8 32 --default-only --experts-only \
        --warps 2 4 --variants - "STAGES=3" --per-pair 8 --per-expert 8  # then --dense-only: pick_held.py
    python benchmarks/tune_held.py --kinds Q4_K Q8_0 --tokens 1 8 32 --default-only --dense-only \
        --split-waves 1 2 4 --variants - DENSE_STAGES=5   # a dense projection's k split, its ring

Routed experts (`fused_experts`, routing alignment to the sum) and the dense projections (`tiled_linear`:
attention's qkv and output, the LM head) for each quant type, beside bf16 weights (their default tiles
alone): the Triton kernels' default ("default"), Q4_K and Q8_0 experts' CUDA kernels ("cuda",
app/kernels/cuda_held.py), tensor-core tiles ("tiles"), each row summed on the CUDA cores ("rows": block_m,
block_n, block_k, warps) and, for Q8_0, widened columns first ("columns-first"). Each line gives the time,
the bytes of weights it must read over that time, and its result's largest difference from the default
tiles' on the same inputs ("drift", relative to the result's largest magnitude). The tiles in
app/kernels/triton_linear.py (`held_tiles`) and app/kernels/triton_moe.py come from these lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels import cuda_held
from app.kernels.gguf_quants import random_blocks, to_held
from app.kernels.triton_linear import held_tiles
from app.kernels.triton_moe import EXACT_TILES, MoeTiles, fused_experts, moe_tiles, tiled_linear
from benchmarks.roofline import expected_experts, replayed_ms

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DENSE = {"qkv": (5120, HIDDEN), "o": (HIDDEN, 4096), "lm_head": (151936, HIDDEN)}
# Q8_0 only: its weights widened columns first, the dot's left operand (`MoeTiles.columns_first`)
COLUMNS_FIRST_TILES = {
    f"columns-first 16x{n}x{k} w4 s{st}": MoeTiles(16, n, k, 4, st, columns_first=True)
    for n, k, st in [(64, 256, 1), (64, 256, 2), (64, 256, 3), (64, 256, 4), (64, 128, 2), (64, 128, 4)]
}
EXPERT_TILES = {
    "tiles 16x64x128 w4 s4": EXACT_TILES,
    # fewer stages: the i-quants' grid reads are staged in shared memory (an IQ3_S pair 34 KB a program at 4
    # stages since a grid entry is one word, 120 KB before)
    "tiles 16x64x64 w4 s1": MoeTiles(16, 64, 64, 4, 1),
    "tiles 16x64x64 w4 s2": MoeTiles(16, 64, 64, 4, 2),
    "tiles 16x64x64 w4 s4": MoeTiles(16, 64, 64, 4, 4),
    "tiles 128x128x64 w8 s1": MoeTiles(128, 128, 64, 8, 1),  # a prompt's (default: 3 stages)
    "tiles 128x128x64 w8 s3": MoeTiles(128, 128, 64, 8, 3),
    "rows 1x4x256 w1": MoeTiles(1, 4, 256, 1, 2, rowwise=True),  # the i-quants' step capped at 128
    "rows 1x4x64 w1": MoeTiles(1, 4, 64, 1, 2, rowwise=True),  # the i-quants' step before
}
DENSE_TILES = {
    "tiles 16x32x128 w4 s4": MoeTiles(16, 32, 128, 4, 4),
    "tiles 16x64x128 w4 s4": MoeTiles(16, 64, 128, 4, 4),
    "rows 1x4x512 w1": MoeTiles(1, 4, 512, 1, 2, rowwise=True),
}
SETS = 3


def _weights(kind: str, shape: tuple[int, ...], copy: int) -> torch.Tensor:
    if kind == "bf16":
        g = torch.Generator(device="cuda").manual_seed(copy)
        return (torch.randn(shape, device="cuda", generator=g) * 0.02).bfloat16()
    return to_held(kind, random_blocks(kind, shape, copy, device="cuda"))


def _use_defines(defines: dict[str, str]) -> None:
    """The CUDA kernels from here on compiled with `defines` (none: the source's own choices)."""
    if defines != cuda_held.DEFINES:
        cuda_held.DEFINES = defines
        cuda_held._kernels.cache_clear()


def _report(what: str, ms: float, moved: float, drift: float) -> None:
    print(f"{what:44s} {ms * 1000:9.1f} us  {moved / ms / 1e9:6.2f} TB/s  drift {drift:.1e}", flush=True)


def _time(what: str, calls: list, moved: float, first: torch.Tensor | None) -> torch.Tensor | None:
    """Times `calls` (`replayed_ms`) and reports their result's largest difference from `first` (the
    default tiles' result on the same set), relative to its largest magnitude; a tile choice that does
    not compile or launch is reported, not fatal."""
    try:
        out = calls[0]().float()
        drift = 0.0 if first is None else ((out - first).abs().max() / first.abs().max()).item()
        _report(what, replayed_ms(calls, 30), moved, drift)
    except Exception as error:
        print(f"{what:44s} failed: {str(error).splitlines()[0][:120]}", flush=True)
        return None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["Q4_K", "Q8_0", "bf16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--default-only", action="store_true", help="time the default tiles alone")
    parser.add_argument("--experts-only", action="store_true", help="leave the dense projections out")
    parser.add_argument("--dense-only", action="store_true", help="leave the routed experts out")
    parser.add_argument(
        "--warps",
        type=int,
        nargs="+",
        default=[],
        help="time the experts' CUDA kernels at most these warps a block",
    )
    parser.add_argument(
        "--down-warps",
        type=int,
        nargs="+",
        default=[],
        help="and the experts' down projection at most these (else as --warps)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help='compile the CUDA kernels with each of these defines ("STAGES=3 MIN_BLOCKS=3", or with commas'
        ' "STAGES=3,MIN_BLOCKS=3"; "-": none)',
    )
    parser.add_argument(
        "--per-pair",
        type=int,
        nargs="+",
        default=[],
        help="time the CUDA kernels also with a block a pair (no grouping launch) up to these many tokens",
    )
    parser.add_argument(
        "--per-expert",
        type=int,
        nargs="+",
        default=[],
        help="and with a block an expert finding its pairs (no grouping launch) up to these many tokens",
    )
    parser.add_argument(
        "--split-waves",
        type=float,
        nargs="+",
        default=[],
        help="time the CUDA kernels' dense projections also with k split over about this many blocks an SM",
    )
    args = parser.parse_args()
    args.variants = [variant.replace(",", " ") for variant in args.variants]  # one shell word a variant
    for kind in args.kinds:
        if not args.dense_only:
            _time_experts(kind, args)
        if not args.experts_only:
            _time_dense(kind, args)
        torch.cuda.empty_cache()


def _time_experts(kind: str, args: argparse.Namespace) -> None:
    """A layer's routed experts held as `kind` at each window, under each choice the arguments ask for."""
    kinds_before, warps_before = cuda_held.EXPERT_KINDS, dict(cuda_held.BLOCK_WARPS)
    per_pair_before, per_expert_before = cuda_held.PER_PAIR_TOKENS, dict(cuda_held.PER_EXPERT_TOKENS)
    down_before = dict(cuda_held.DOWN_WARPS)
    defines_before = dict(cuda_held.DEFINES)
    sets = [
        (_weights(kind, (EXPERTS, 2 * INTER, HIDDEN), c), _weights(kind, (EXPERTS, HIDDEN, INTER), c + 9))
        for c in range(SETS)
    ]
    expert_bytes = sum(w[0].numel() * w.element_size() for w in sets[0])
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        weights, ids = torch.randn(tokens, EXPERTS, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
        weights = weights.bfloat16()
        moved = expected_experts(EXPERTS, TOP_K, tokens) * expert_bytes
        choices = {"default": moe_tiles(tokens, exact=False, held=() if kind == "bf16" else (kind, kind))}
        if kind in cuda_held.KINDS and tokens <= cuda_held.DECODE_TOKENS:
            for variant in args.variants or ["-"]:
                for warps in args.warps or [0]:
                    for down in args.down_warps or [0]:
                        groupings = [
                            (0, 0),
                            *((p, 0) for p in args.per_pair),
                            *((0, e) for e in args.per_expert),
                        ]
                        for per_pair, per_expert in groupings:
                            # no tiles: `fused_experts` takes app/kernels/cuda_held.py's kernels
                            name = (f"cuda w{warps}" if warps else "cuda") + (f" d{down}" if down else "")
                            name += (f" p{per_pair}" if per_pair else "") + (
                                f" e{per_expert}" if per_expert else ""
                            )
                            name = name if variant == "-" else f"{name} {variant}"
                            choices[name] = (warps, down, per_pair, per_expert, variant)
        if kind != "bf16" and not args.default_only:
            choices |= EXPERT_TILES | (COLUMNS_FIRST_TILES if kind == "Q8_0" else {})
        first = None
        for name, tiles in choices.items():
            if isinstance(tiles, tuple):  # the CUDA kernels: at most this many warps a block, its defines
                warps, down, per_pair, per_expert, variant = tiles
                cuda_held.EXPERT_KINDS = (kind,)
                cuda_held.PER_PAIR_TOKENS = per_pair or per_pair_before
                cuda_held.PER_EXPERT_TOKENS[kind] = per_expert  # 0: the grouping launch's tiles
                cuda_held.BLOCK_WARPS[kind] = warps or warps_before[kind]
                cuda_held.DOWN_WARPS[kind] = down or warps or down_before[kind]
                _use_defines({} if variant == "-" else dict(word.split("=") for word in variant.split()))
                tiles = None
                if not cuda_held.enabled(x.device):  # else the Triton kernels would be timed under its name
                    print(f"{kind} experts tokens {tokens} {name} failed: the CUDA kernels did not compile")
                    continue
            calls = [
                lambda w=w, t=tiles, x=x, i=ids, r=weights: fused_experts(x, i, r, *w, tiles=t) for w in sets
            ]
            out = _time(f"{kind} experts tokens {tokens} {name}", calls, moved, first)
            first = out if first is None else first
            cuda_held.EXPERT_KINDS = kinds_before
            cuda_held.PER_PAIR_TOKENS = per_pair_before
            cuda_held.PER_EXPERT_TOKENS.update(per_expert_before)
            cuda_held.BLOCK_WARPS.update(warps_before)
            cuda_held.DOWN_WARPS.update(down_before)
    del sets
    _use_defines(defines_before)


def _time_dense(kind: str, args: argparse.Namespace) -> None:
    """The dense projections held as `kind` at each window: the default tiles, the CUDA kernels (also with
    k split over blocks, `--split-waves`), and the other tiles unless `--default-only`; then the CUDA kernels
    again compiled with each of `--variants`' defines (one compile a variant)."""
    waves_before = cuda_held.SPLIT_WAVES
    defines_before = dict(cuda_held.DEFINES)
    firsts: dict[tuple[str, int], torch.Tensor | None] = {}
    for variant in args.variants or ["-"]:
        _use_defines({} if variant == "-" else dict(word.split("=") for word in variant.split()))
        suffix = "" if variant == "-" else f" {variant}"
        for label, shape in DENSE.items():
            dense = [_weights(kind, shape, c) for c in range(SETS)]
            moved = dense[0].numel() * dense[0].element_size()
            for tokens in args.tokens:
                x = torch.randn(tokens, shape[1], device="cuda", generator=_seeded(tokens)).bfloat16()
                choices: dict[str, object] = {}
                if (label, tokens) not in firsts:  # the first variant's pass: the Triton tiles too
                    choices["default"] = held_tiles(tokens, shape[0])
                if kind in cuda_held.KINDS and tokens <= cuda_held.DECODE_TOKENS:
                    # app/kernels/cuda_held.py's `linear` ("cuda"), k split over blocks ("cuda sW")
                    for waves in [0.0, *args.split_waves]:
                        choices["cuda" + (f" s{waves:g}" if waves else "") + suffix] = waves
                if kind != "bf16" and not args.default_only and (label, tokens) not in firsts:
                    choices |= DENSE_TILES | (COLUMNS_FIRST_TILES if kind == "Q8_0" else {})
                for name, tiles in choices.items():
                    cuda = isinstance(tiles, float)
                    if cuda and not cuda_held.enabled(x.device):
                        print(
                            f"{kind} {label} tokens {tokens} {name} failed: the CUDA kernels did not compile"
                        )
                        continue
                    cuda_held.SPLIT_WAVES = tiles or waves_before if cuda else waves_before
                    calls = [
                        (lambda w=w, x=x, k=kind: cuda_held.linear(x, w, k))
                        if cuda
                        else (lambda w=w, t=tiles, x=x: tiled_linear(x, w, None, t))
                        for w in dense
                    ]
                    first = firsts.get((label, tokens))
                    out = _time(f"{kind} {label} tokens {tokens} {name}", calls, moved, first)
                    firsts[(label, tokens)] = out if first is None else first
                    cuda_held.SPLIT_WAVES = waves_before
            del dense
    _use_defines(defines_before)


def _seeded(seed: int) -> torch.Generator:
    """A generator on the GPU seeded with `seed` (the same inputs in every variant's pass)."""
    return torch.Generator(device="cuda").manual_seed(seed)


if __name__ == "__main__":
    main()
