"""Routing reports: how often each MoE layer's router picked each expert, and where the experts live.

The engine process takes one every EXPERT_REPORT_S seconds (and when it falls idle) from its own layers; on
a layer split each stage worker takes its own on the same period and sends it with a window's answer, and
stage 0 joins them into the next report it sends, so `/metrics` and the Monitor see every stage's layers.
"""

from __future__ import annotations

from typing import Any

import torch

from app.engine.protocol import EXPERT_SOURCES, ExpertUsage
from app.models.expert_tier import TieredExperts
from app.models.moe import SparseMoE
from app.models.qwen3 import CausalLM, DecoderLayer


class ExpertReporter:
    """One process's MoE layers (a stage's, on a split) and tiers, read into `ExpertUsage` reports."""

    def __init__(self, model: CausalLM, tiers: list[TieredExperts], device: str) -> None:
        self.layers = [
            (i, layer.mlp)
            for i, layer in enumerate(model.model.layers)
            if isinstance(layer, DecoderLayer) and isinstance(layer.mlp, SparseMoE)
        ]
        self.tiers = tiers
        self.device = device
        self.experts = model.config.num_experts
        self.swaps = 0  # experts the tiers moved onto the device since the last report

    def take(self, seconds: float) -> ExpertUsage | None:
        """The routing counts since the last report (one device sync), None without MoE layers."""
        if not self.layers:
            return None
        counts = [moe.take_routed() for _, moe in self.layers]
        zeros = torch.zeros(self.experts, dtype=torch.long)
        routed = torch.stack([zeros if c is None else c.cpu() for c in counts]).tolist()
        # an untiered layer's experts live beside the model: on the device with a GPU or beside a tier's
        # resident ones (whose place the CPU device also is), in host RAM on a CPU without a tier
        where = 0 if self.device == "cuda" or self.tiers else 1
        swaps, self.swaps = self.swaps, 0
        return ExpertUsage(
            layers=[i for i, _ in self.layers],
            routed=routed,
            location=[
                moe.experts.locations() if isinstance(moe.experts, TieredExperts) else [where] * self.experts
                for _, moe in self.layers
            ],
            seconds=seconds,
            swaps=swaps,
            **self._served(routed),
        )

    def _served(self, routed: list[list[int]]) -> dict[str, Any]:
        """The tiers' counts since the last report: each layer's entries per source (a layer with no tier: its
        `routed` entries, all from VRAM), bytes copied, adapt wait (the MTP head's tiers, outside the reported
        layers, count in the bytes and the wait)."""
        if not self.tiers:
            return {}
        counts = {id(tier): tier.take_counts() for tier in self.tiers}
        served = []
        for (_, moe), layer_routed in zip(self.layers, routed, strict=True):
            tier = counts.get(id(moe.experts))
            # a layer without a tier (a placement that keeps whole layers on the device) serves from VRAM
            untiered = [sum(layer_routed)] + [0] * (len(EXPERT_SOURCES) - 1)
            served.append(tier.served if tier is not None else untiered)
        return {
            "served": served,
            # a CPU engine's tier copies within host RAM: nothing crosses PCIe
            "pcie_bytes": sum(c.pcie_bytes for c in counts.values()) if self.device == "cuda" else 0,
            "adapt_wait_s": sum(c.adapt_wait_s for c in counts.values()),
        }


def joined(first: ExpertUsage, others: list[ExpertUsage], known: dict[int, list[int]]) -> ExpertUsage:
    """Stage 0's report joined with the other stages' reports that came since the last one (a layer's counts
    added up, its latest location kept), over the span of the first. `known` holds the latest location of
    every other stage's layer (updated here), so that a report before a stage's next one still lists that
    stage's layers, with no counts: the Monitor's grid keeps every layer."""
    sources = len(EXPERT_SOURCES)
    rows: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for usage in [first, *others]:
        for i, layer in enumerate(usage.layers):
            served = usage.served[i] if usage.served else [0] * sources
            if layer not in rows:
                rows[layer] = (list(usage.routed[i]), list(usage.location[i]), list(served))
                continue
            routed, _, total = rows[layer]
            rows[layer] = (
                [a + b for a, b in zip(routed, usage.routed[i], strict=True)],
                list(usage.location[i]),
                [a + b for a, b in zip(total, served, strict=True)],
            )
    for usage in others:
        known.update(zip(usage.layers, usage.location, strict=True))
    for layer, location in known.items():
        rows.setdefault(layer, ([0] * len(location), list(location), [0] * sources))
    layers = sorted(rows)
    usages = [first, *others]
    return ExpertUsage(
        layers=layers,
        routed=[rows[layer][0] for layer in layers],
        location=[rows[layer][1] for layer in layers],
        seconds=first.seconds,
        swaps=sum(u.swaps for u in usages),
        served=[rows[layer][2] for layer in layers] if any(u.served for u in usages) else None,
        pcie_bytes=sum(u.pcie_bytes for u in usages),
        adapt_wait_s=sum(u.adapt_wait_s for u in usages),
    )
