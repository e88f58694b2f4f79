"""Routed mixture-of-experts block: top-k router, stacked expert weights, optional gated shared expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from app.kernels.interface import ExpertsFn, LinearKernel, MoEBlockFn, Picks, RouteKernel
from app.models.config import ModelConfig
from app.models.layers import DenseMLP, Linear


def expert_parts(
    prefix: str, experts: int, intermediate: int, where: Callable[[int], tuple[str, str, int]]
) -> dict[str, tuple[str, tuple]]:
    """Where each expert's checkpoint projections go in stacked gate_up (gate rows first) and down
    parameters, `where(expert)` naming the two parameters and the index in them: checkpoint tensor name ->
    (parameter name, index into it)."""
    parts: dict[str, tuple[str, tuple]] = {}
    for e in range(experts):
        gate_up, down, index = where(e)
        parts[f"{prefix}{e}.gate_proj.weight"] = (gate_up, (index, slice(0, intermediate)))
        parts[f"{prefix}{e}.up_proj.weight"] = (gate_up, (index, slice(intermediate, 2 * intermediate)))
        parts[f"{prefix}{e}.down_proj.weight"] = (down, (index,))
    return parts


class RoutedExperts(nn.Module):
    """All experts of one layer, stacked as kernels want them.

    gate_up [experts, 2 * intermediate, hidden] (gate rows first), down [experts, hidden, intermediate];
    either may be held as a file's GGUF blocks (`layers.hold_blocks`) for kernels that read them in place.
    Checkpoints store one tensor per expert and projection; `checkpoint_parts` maps them here.
    """

    def __init__(self, experts: int, hidden: int, intermediate: int, kernel: ExpertsFn) -> None:
        super().__init__()
        self.kernel = kernel
        self.intermediate = intermediate
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def checkpoint_parts(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint tensor name -> (parameter name, index into it), for every expert's projections."""
        return expert_parts(
            prefix, self.gate_up.shape[0], self.intermediate, lambda e: ("gate_up", "down", e)
        )

    def forward(
        self,
        x: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        live: torch.Tensor | None = None,
        row_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [tokens, hidden], top_ids / top_weights [tokens, k] -> the weighted sum of expert outputs
        (`live`, which marks padding rows, and `row_slots`, each row's state slot, matter only to an expert
        tier)."""
        return self.kernel(x, top_ids, top_weights, self.gate_up, self.down)


class SparseMoE(nn.Module):
    """Router + routed experts (+ a shared expert behind a sigmoid gate, when the model has one)."""

    def __init__(
        self,
        config: ModelConfig,
        experts_kernel: ExpertsFn,
        route_kernel: RouteKernel | None = None,
        linear_kernel: LinearKernel | None = None,
        block_kernel: MoEBlockFn | None = None,
    ) -> None:
        super().__init__()
        self.route_kernel = route_kernel
        self.block_kernel = block_kernel
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed: torch.Tensor | None = None
        self.gate = Linear(config.hidden_size, config.num_experts, kernel=linear_kernel)
        self.experts = RoutedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, experts_kernel
        )
        self.shared_expert: DenseMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                config.hidden_size, config.shared_expert_intermediate_size, linear_kernel
            )
            self.shared_expert_gate = Linear(config.hidden_size, 1, kernel=linear_kernel)

    def _counter(self, device: torch.device) -> torch.Tensor:
        """The routing counter [experts] int64, made on first use (an inference tensor, updated in place)."""
        if self.routed is None:
            with torch.inference_mode():
                self.routed = torch.zeros(self.gate.out_features, dtype=torch.int64, device=device)
        return self.routed

    def count_routes(self, ids: torch.Tensor, live: torch.Tensor | None = None) -> None:
        """Add this forward's picks to `routed` [experts]: how often the router chose each expert.

        Counted in place on the device (no host sync, so a CUDA graph can replay it); `live` [tokens] is 0 on
        padding rows, which are not counted.
        """
        counter = self._counter(ids.device)
        with torch.inference_mode():
            picks = torch.ones_like(ids) if live is None else live[:, None].expand_as(ids)
            counter.scatter_add_(0, ids.flatten(), picks.flatten())

    def take_routed(self) -> torch.Tensor | None:
        """The picks counted since the last call (None before the first forward); counting starts afresh."""
        if self.routed is None:
            return None
        with torch.inference_mode():
            routed = self.routed.clone()
            self.routed.zero_()
        return routed

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token and their weights (softmax over all experts, optionally renormalised)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(
        self,
        x: torch.Tensor,
        live: torch.Tensor | None = None,
        row_slots: torch.Tensor | None = None,
        picks: bool = False,
    ) -> torch.Tensor | Picks:
        """The block's output for x [tokens, hidden] (`live` marks padding rows, `row_slots` each row's state
        slot, for an expert tier); with `picks` the block kernel may leave its `Picks` for the norm after the
        block to sum (`RMSNorm.add_forward` takes them)."""
        if self.block_kernel is not None and type(self.experts) is RoutedExperts:
            shared = None
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                mlp = self.shared_expert
                projections = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
                shared = (*projections, self.shared_expert_gate.weight)
            out = self.block_kernel(
                x,
                self.gate.weight,
                self.top_k,
                self.norm_topk_prob,
                self._counter(x.device),
                live,
                self.experts.gate_up,
                self.experts.down,
                shared,
                picks,
            )
            if out is not None:
                return out
        logits = self.gate(x)
        if self.route_kernel is not None:
            counter = self._counter(x.device)
            ids, weights = self.route_kernel(logits, self.top_k, self.norm_topk_prob, counter, live)
        else:
            ids, weights = self.route(logits)
            self.count_routes(ids, live)
        out = self.experts(x, ids, weights, live, row_slots)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
