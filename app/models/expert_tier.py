"""The expert tier of one MoE layer: some experts in device memory, every expert in host RAM.

A layer built with a tier keeps all its experts' weights in host memory (pinned on a GPU machine, so copies
to the device run at full speed) and `resident` of them in device memory as well. Each forward computes a
routed entry where its expert lives: the entries of resident experts with the backends' experts kernel on the
device, the others on the CPU from host RAM (the CPU pool's native kernel, app/kernels/cpu_experts.py), and
adds the two. With the device itself the CPU, every entry is computed in expert order with the reference's
arithmetic, so the tier gives the all-resident model's outputs exactly wherever the experts live.
The resident experts are the first `resident` ones at load; `adapt` (every `--adapt-every` windows, the
engine calls it) makes the most routed ones resident, copying them over in place of the coldest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.kernels.interface import ExpertsFn, HostExpertFn
from app.models.moe import RoutedExperts, SparseMoE, expert_parts

ADAPT_DECAY = 0.5  # how much of the earlier routing counts when the tier adapts again


class TieredExperts(nn.Module):
    """Routed experts of one layer, `resident` of them on the device.

    `host_gate_up` [experts, 2 * intermediate, hidden] and `host_down` [experts, hidden, intermediate] hold
    every expert (loaded straight to host memory: experts beyond the device budget never touch the device);
    `place(device)` copies the resident ones into `gate_up` / `down` [resident, ...] on the device, in slot
    order, and `slot_of` [experts] gives each expert's slot, -1 for one that lives in host RAM only.
    """

    HOST_PARAMETERS = ("host_gate_up", "host_down")

    def __init__(
        self,
        experts: int,
        hidden: int,
        intermediate: int,
        kernel: ExpertsFn,
        resident: int,
        host_kernel: HostExpertFn,
    ) -> None:
        super().__init__()
        if not 0 <= resident < experts:
            raise ValueError(f"resident experts must be in [0, {experts}), got {resident}")
        self.kernel = kernel
        self.host_kernel = host_kernel
        self.intermediate = intermediate
        self.resident = resident
        self.host_gate_up = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.host_down = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.slot_of: torch.Tensor | None = None
        self.slots: list[int] = []  # each expert's device slot, -1 in host RAM only (host copy of slot_of)
        self.heat: torch.Tensor | None = None  # routed entries per expert since the last adaptation, decayed

    def checkpoint_parts(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint tensor name -> (parameter name, index into it), for every expert's projections."""
        experts = self.host_gate_up.shape[0]
        return expert_parts(prefix, experts, self.intermediate, "host_gate_up", "host_down")

    @torch.no_grad()
    def place(self, device: torch.device) -> None:
        """Pin the host copies on a GPU machine and copy the resident experts to `device`."""
        if device.type == "cuda" and not self.host_gate_up.is_pinned():
            self.host_gate_up = nn.Parameter(self.host_gate_up.data.pin_memory(), requires_grad=False)
            self.host_down = nn.Parameter(self.host_down.data.pin_memory(), requires_grad=False)
        experts = self.host_gate_up.shape[0]
        self.gate_up = self.host_gate_up[: self.resident].to(device, copy=True)  # never a view of the host's
        self.down = self.host_down[: self.resident].to(device, copy=True)
        self.slots = [e if e < self.resident else -1 for e in range(experts)]
        self.slot_of = torch.tensor(self.slots, dtype=torch.long).to(device)
        self.heat = torch.zeros(experts, dtype=torch.float32, device=device)

    def locations(self) -> list[int]:
        """Where each expert is computed: 0 on the device, 1 in host RAM (the Monitor's residency grid)."""
        return [0 if slot >= 0 else 1 for slot in self.slots]

    @torch.no_grad()
    def adapt(self, decay: float = ADAPT_DECAY) -> int:
        """Make the experts routed most since the last adaptation (the older counts decayed) the resident
        ones: the hottest experts in host RAM take the slots of the coldest resident ones. Returns how many
        were swapped. The copies are queued behind the windows already launched, so a window runs with the
        experts it was planned with; on a frozen tier (never adapted) nothing moves."""
        assert self.heat is not None and self.gate_up is not None and self.down is not None
        heat = self.heat.tolist()
        self.heat.mul_(decay)
        if not self.resident:
            return 0
        resident = [e for e, slot in enumerate(self.slots) if slot >= 0]
        # residents win ties, so equally hot experts do not move back and forth
        ranked = sorted(range(len(heat)), key=lambda e: (heat[e], self.slots[e] >= 0), reverse=True)
        wanted = set(ranked[: self.resident])
        incoming = [e for e in ranked[: self.resident] if self.slots[e] < 0]
        outgoing = sorted((e for e in resident if e not in wanted), key=lambda e: heat[e])
        for new, old in zip(incoming, outgoing, strict=True):
            slot = self.slots[old]
            self.gate_up[slot].copy_(self.host_gate_up[new], non_blocking=True)
            self.down[slot].copy_(self.host_down[new], non_blocking=True)
            self.slots[new], self.slots[old] = slot, -1
        if incoming:
            self.slot_of.copy_(torch.tensor(self.slots, dtype=torch.long))
        return len(incoming)

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], top_ids / top_weights [tokens, k] -> the weighted sum of expert outputs."""
        if self.slot_of is None or self.heat is None:
            raise RuntimeError("TieredExperts.place() must run before the first forward")
        self.heat.index_add_(0, top_ids.flatten(), torch.ones_like(top_ids, dtype=torch.float32).flatten())
        if x.device.type == "cpu":
            return self._in_order(x, top_ids, top_weights)
        return self._split(x, top_ids, top_weights)

    def _weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert's gate_up and down where it is computed: its device slot, or host RAM."""
        assert self.gate_up is not None and self.down is not None
        slot = self.slots[expert]
        if slot >= 0:
            return self.gate_up[slot], self.down[slot]
        return self.host_gate_up[expert], self.host_down[expert]

    def _in_order(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """Every entry on the CPU, expert by expert in expert order: the reference kernel's sum, term for
        term (so a frozen tier gives the all-resident model's outputs exactly)."""
        out = torch.zeros_like(x)
        entries = torch.stack(
            torch.meshgrid(torch.arange(top_ids.shape[0]), torch.arange(top_ids.shape[1]), indexing="ij"),
            dim=-1,
        ).reshape(-1, 2)
        self._add_entries(out, x, top_ids, top_weights, entries)
        return out

    def _split(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """Resident experts' entries with the experts kernel on the device (the others weighted 0 there),
        the others on the CPU from host RAM while the device runs the kernel; the sums added on the device.

        The host reads the routing (one wait for the layer so far) before it queues the kernel, so the CPU
        pool's work overlaps the device's instead of waiting for it too.
        """
        assert self.slot_of is not None and self.gate_up is not None and self.down is not None
        slots = self.slot_of[top_ids]
        on_device = slots >= 0
        missed = (~on_device).nonzero().cpu()
        routed = (x.cpu(), top_ids.cpu(), top_weights.cpu()) if missed.numel() else None
        if self.resident:
            out = self.kernel(x, slots.clamp_min(0), top_weights * on_device, self.gate_up, self.down)
        else:
            out = torch.zeros_like(x)
        if routed is not None:
            host = torch.zeros(out.shape, dtype=torch.float32)
            self._add_entries(host, *routed, missed, pool=True)
            out += host.to(out.device, dtype=out.dtype)
        return out

    def _add_entries(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        entries: torch.Tensor,
        pool: bool = False,
    ) -> None:
        """Add the routed entries (row, column of top_ids) into `out`, expert by expert in expert order, each
        expert's weights read where it lives (all tensors on the CPU); with `pool`, through the CPU expert
        pool's kernel (`host_kernel`: app/kernels/cpu_experts.py) into an fp32 `out`."""
        rows, cols = entries.unbind(1)
        ids = top_ids[rows, cols]
        order = ids.argsort(stable=True)
        rows, ids, weights = rows[order], ids[order], top_weights[rows, cols][order]
        experts, counts = ids.unique_consecutive(return_counts=True)
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            picked = rows[start : start + count]
            gate_up, down = self._weights(expert)
            if pool:
                y = self.host_kernel(x[picked], gate_up, down) * weights[start : start + count, None].float()
            else:
                gate, up = F.linear(x[picked], gate_up).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, down) * weights[start : start + count, None]
            out.index_add_(0, picked, y.to(out.dtype))
            start += count


def use_expert_tier(model: nn.Module, resident: int, host_kernel: HostExpertFn) -> None:
    """Give every MoE layer of a model built on the meta device (not loaded yet) an expert tier with the
    first `resident` experts on the device and `host_kernel` for the others. Call it under the meta device."""
    for module in model.modules():
        if isinstance(module, SparseMoE) and isinstance(module.experts, RoutedExperts):
            routed = module.experts
            experts, _, hidden = routed.gate_up.shape
            module.experts = TieredExperts(
                experts, hidden, routed.intermediate, routed.kernel, resident, host_kernel
            )
