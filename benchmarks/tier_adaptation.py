"""The expert tier's adaptation policy on simulated routing: how much it swaps and what it keeps resident.

    python benchmarks/tier_adaptation.py [--experts 128] [--resident 32] [--top-k 8] [--every 16]
        [--tokens 20000] [--batch 1 8] [--margins 0 1 2] [--memories 0 8] [--routing zipf uniform]

Drives `TieredExperts.adapt` itself (tiny weights on the CPU: only its placement is looked at) with each
window's routed experts drawn as the expert-tier benchmark's gates draw them (`zipf`: expert e of a random
order about as likely as 1 / rank, Gumbel top-k without replacement; `uniform`: all alike), adapting every
`--every` windows, for each margin of `SWAP_MARGIN` and each `ADAPT_MEMORY` (0: the older counts halved at
every adaptation, `ADAPT_DECAY`). Prints a JSON line per configuration: the share of routed entries the tier
held on the device (and that the most likely experts, as many as are resident, would hold), swaps per token
(each an expert's weights copied over PCIe), and after the routing moves to another random order of the same
shares, the share held over the next 400 tokens (how fast the tier follows it).
"""

from __future__ import annotations

import argparse
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


def simulate(
    args: argparse.Namespace, routing: str, batch: int, margin: float, memory: int
) -> dict[str, object]:
    """Run the routing through a fresh tier, then move it and follow; the figures of the module docstring."""
    generator = torch.Generator().manual_seed(args.seed)
    tier = _tier(args.experts, args.resident)
    expert_tier.SWAP_MARGIN = margin
    expert_tier.ADAPT_MEMORY = memory
    decay = expert_tier.ADAPT_DECAY if memory == 0 else None
    held = {"steady": [0, 0], "moved": [0, 0]}
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
        gumbel = -torch.log(
            -torch.log(torch.rand(batch, args.experts, generator=generator).clamp(1e-9, 1 - 1e-9))
        )
        picks = (logits + gumbel).topk(args.top_k, dim=1).indices.flatten()
        resident = torch.tensor([slot >= 0 for slot in tier.slots])
        held[phase][0] += int(resident[picks].sum())
        held[phase][1] += picks.numel()
        best_held += int(best[picks].sum()) if phase == "steady" else 0
        assert tier.heat is not None
        tier.heat.index_add_(0, picks, torch.ones(picks.numel()))
        if (window + 1) % args.every == 0:
            moved = tier.adapt(decay)
            if phase == "steady":
                swaps += moved
    return {
        "routing": routing,
        "batch": batch,
        "swap_margin": margin,
        "adapt_memory": memory,
        "vram_share": round(held["steady"][0] / held["steady"][1], 4),
        "best_share": round(best_held / held["steady"][1], 4),
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for routing in args.routing:
        for batch in args.batch:
            for margin in args.margins:
                for memory in args.memories:
                    print(json.dumps(simulate(args, routing, batch, margin, memory)), flush=True)


if __name__ == "__main__":
    main()
