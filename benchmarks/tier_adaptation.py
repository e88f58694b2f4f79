"""The expert tier's adaptation policy on simulated routing: how much it swaps and what it keeps resident.

    python benchmarks/tier_adaptation.py [--experts 128] [--resident 32] [--top-k 8] [--every 16]
        [--tokens 20000] [--batch 1 8] [--margins 0 1 2] [--memories 0 8] [--routing zipf uniform]
        [--counting windows entries] [--prompt-rows 0] [--prompt-every 2]

Drives `TieredExperts.adapt` itself (tiny weights on the CPU: only its placement is looked at) with each
window's routed experts drawn as the expert-tier benchmark's gates draw them (`zipf`: expert e of a random
order about as likely as 1 / rank, Gumbel top-k without replacement; `uniform`: all alike), adapting every
`--every` windows, for each margin of `SWAP_MARGIN` and each `ADAPT_MEMORY` (0: the older counts halved at
every adaptation, `ADAPT_DECAY`), and each way of counting the routing (`windows`: a window routing to an
expert counts one, as `TieredExperts.count` does; `entries`: every routed entry counts one). With
`--prompt-rows` one window in `--prompt-every` also holds a prompt chunk of so many rows routed uniformly (a
long prompt read beside the decoding slots). Prints a JSON line per configuration, of the decoding rows'
routing: the share of routed entries the tier held on the device (and that the most likely experts, as many as
are resident, would hold), the share of a decode-only window's experts held (`window_share`: a missed expert
costs a window one read of its weights, whatever its rows; a window with a prompt chunk misses every host
expert, wherever the decoding rows route), swaps per token (each an expert's weights copied over PCIe), and
after the routing moves to another random order of the same shares, the share held over the next 400 tokens
(how fast the tier follows it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.cpu_experts import experts_swiglu_sum
from app.kernels.reference import experts_reference
from app.models import expert_tier
from app.models.expert_tier import TieredExperts

FOLLOW_TOKENS = 400  # tokens after the routing moves over which the held share is taken


def _tier(experts: int, resident: int) -> TieredExperts:
    tier = TieredExperts(experts, 4, 4, experts_reference, resident, experts_swiglu_sum)
    tier.fill(torch.zeros(experts, 8, 4), torch.zeros(experts, 4, 4), torch.device("cpu"))
    return tier


def _shares(routing: str, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Log-shares of the experts in a random order."""
    if routing == "uniform":
        return torch.zeros(experts)
    ranked = torch.log(1.0 / torch.arange(1, experts + 1, dtype=torch.float32))
    return ranked[torch.randperm(experts, generator=generator)]


def _draw(logits: torch.Tensor, rows: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, top_k] experts drawn by Gumbel top-k over `logits`."""
    uniform = torch.rand(rows, logits.numel(), generator=generator).clamp(1e-9, 1 - 1e-9)
    return (logits - torch.log(-torch.log(uniform))).topk(top_k, dim=1).indices


def simulate(
    args: argparse.Namespace, routing: str, batch: int, margin: float, memory: int, counting: str
) -> dict[str, object]:
    """Run the routing through a fresh tier, then move it and follow; the figures of the module docstring."""
    generator = torch.Generator().manual_seed(args.seed)
    tier = _tier(args.experts, args.resident)
    expert_tier.SWAP_MARGIN = margin
    expert_tier.ADAPT_MEMORY = memory
    decay = expert_tier.ADAPT_DECAY if memory == 0 else None
    held = {"steady": [0, 0], "moved": [0, 0]}
    touched = [0, 0]  # the steady run's (window, expert) pairs of the decoding rows: held, all
    swaps = 0
    windows = args.tokens // batch
    logits = _shares(routing, args.experts, generator)
    best = torch.zeros(args.experts, dtype=torch.bool)  # the `resident` most likely experts of the steady run
    best[logits.topk(args.resident).indices] = True
    best_held = 0
    for window in range(windows + FOLLOW_TOKENS // batch):
        phase = "steady" if window < windows else "moved"
        if window == windows:
            logits = _shares(routing, args.experts, generator)
        decoded = _draw(logits, batch, args.top_k, generator)
        picks = decoded.flatten()
        resident = torch.tensor([slot >= 0 for slot in tier.slots])
        held[phase][0] += int(resident[picks].sum())
        held[phase][1] += picks.numel()
        reads = args.prompt_rows > 0 and window % args.prompt_every == 0
        if phase == "steady":
            best_held += int(best[picks].sum())
        if phase == "steady" and not reads:
            experts = picks.unique()
            touched[0] += int(resident[experts].sum())
            touched[1] += experts.numel()
        routed = decoded
        if reads:
            prompt = _draw(torch.zeros(args.experts), args.prompt_rows, args.top_k, generator)
            routed = torch.cat([decoded, prompt])
        if counting == "windows":
            tier.count(routed)
        else:
            assert tier.heat is not None
            tier.heat.index_add_(0, routed.flatten(), torch.ones(routed.numel()))
        if (window + 1) % args.every == 0:
            moved = tier.adapt(decay)
            if phase == "steady":
                swaps += moved
    return {
        "routing": routing,
        "batch": batch,
        "prompt_rows": args.prompt_rows,
        "counting": counting,
        "swap_margin": margin,
        "adapt_memory": memory,
        "vram_share": round(held["steady"][0] / held["steady"][1], 4),
        "best_share": round(best_held / held["steady"][1], 4),
        "window_share": round(touched[0] / touched[1], 4),
        "swaps_per_token": round(swaps / (windows * batch), 4),
        "vram_share_after_move": round(held["moved"][0] / held["moved"][1], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--resident", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--every", type=int, default=16, help="windows between adaptations")
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    parser.add_argument("--memories", type=int, nargs="+", default=[0, expert_tier.ADAPT_MEMORY])
    parser.add_argument("--routing", nargs="+", default=["zipf", "uniform"], choices=["zipf", "uniform"])
    counting = ["windows", "entries"]
    parser.add_argument("--counting", nargs="+", default=counting, choices=counting)
    parser.add_argument("--prompt-rows", type=int, default=0, help="uniformly routed prompt rows a window")
    parser.add_argument("--prompt-every", type=int, default=2, help="windows a prompt chunk comes in one of")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for routing, batch, margin, memory, counting in itertools.product(
        args.routing, args.batch, args.margins, args.memories, args.counting
    ):
        print(json.dumps(simulate(args, routing, batch, margin, memory, counting)), flush=True)


if __name__ == "__main__":
    main()
