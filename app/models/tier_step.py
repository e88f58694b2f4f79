"""A tiered layer's host step for a small window as one native call, where the native kernels are built.

At each tiered layer's cut of a captured decode window the host reads the layer's routing, plans which missed
experts are copied into staging slots and which the CPU pool computes, starts the pool's run in the
background and queues the copies; the device waits for both. Until the pool's run and the copies start, host
memory (what bounds such a layer) is idle, and on a GPU machine's host that Python took about 150 us a layer
(docs/PERFORMANCE.md). `NativeSmallStep` does all of that in native/tier_step.cpp and keeps the bookkeeping
(where entries were served, bytes copied, the staging area's zero rows, the timing of copies, the pool's
observed rate) here, after the work has started. `TieredExperts._serve_small` is its reference: given the
same routing, costs and weights both stage the same experts into the same slots with the same copies and
give the same sums (tests/models/test_tier_step.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from app.kernels.interface import HostStepFactory, StepConstants
from app.models import expert_costs
from app.models.pieces import Finish

if TYPE_CHECKING:
    from app.models.expert_tier import TieredExperts


class NativeSmallStep:
    """`TieredExperts._serve_small` for one tier, its routing, input and sums read and written where they lie
    (addresses), through the native step `factory` makes (app/kernels/cpu_experts.py's `small_step`) with
    copies through the function at `copy_address` (None: a plain copy of host memory, staging on a CPU)."""

    def __init__(
        self,
        tier: TieredExperts,
        factory: HostStepFactory,
        entries: int,
        copy_address: int | None,
        split_align: int,
    ) -> None:
        self.tier = tier
        staging, areas = tier.staging, None
        if staging is not None and tier.costs is not None:
            assert staging.gate_up is not None and staging.down is not None
            areas = (staging.gate_up, staging.down)
        self.staged = areas is not None  # whether misses may be copied (else all go to the CPU pool)
        self.device = areas[0].device if areas is not None and areas[0].is_cuda else None
        self.native = factory(
            tier.host_gate_up,
            tier.host_down,
            tier.experts,
            entries,
            areas,
            copy_address,
            StepConstants(
                expert_costs.PROBE_EVERY, split_align, expert_costs.SPLIT_GAIN_S, expert_costs.GATE_UP_SHARE
            ),
        )

    def serve(
        self,
        picks: int,
        rows: int,
        width: int,
        x: int,
        sums: int,
        clear_rows: int,
        done: torch.Tensor | None,
    ) -> tuple[dict[int, int], bool, Finish | None]:
        """`_serve_small` over `rows` rows of `width` picks: ids then weights as fp32 at address `picks`, x
        [rows, hidden] fp32 at `x`, the pool's sums added at `sums` after its first `clear_rows` rows are
        zeroed (what the step before added there). Returns as `_serve_small` does."""
        tier = self.tier
        costs, staging, copy_times = tier.costs, tier.staging, tier.copy_times
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device is not None else 0
        events = copy_times.start() if copy_times is not None and self.staged else None
        fields: tuple[float, ...] = (1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0)  # read only where misses may be copied
        if costs is not None:
            fields = (costs.expert_bytes, costs.pcie_bytes_s, costs.cpu_bytes_s, costs.cpu_row_s)
            fields += (costs.cpu_fixed_s, costs.cpu_call_s, costs.unobserved)
        frac = math.nan if tier.pcie_frac is None else tier.pcie_frac
        try:
            result = self.native.serve(
                picks,
                rows,
                width,
                x,
                sums,
                clear_rows,
                done.data_ptr() if done is not None else 0,
                tier.slot_table.data_ptr(),
                tier.host_table.data_ptr(),
                stream,
                *fields,
                frac,
            )
        except BaseException:
            if events is not None and copy_times is not None:
                copy_times.cancel(events)
            raise
        on_device, copied_entries, cpu_entries, copies, read, staged, pooled, whole, channels, probes = result
        tier.count_served(on_device, cpu_entries, copied_entries)
        if costs is not None:
            costs.unobserved = probes
        if copies:
            assert staging is not None
            tier.pcie_bytes += round(copies * tier.expert_bytes())
            if whole:
                staging.written(whole)
            if channels:
                staging.zero_gate_rows(channels)
        if events is not None and copy_times is not None:
            if copies:
                copy_times.stop(events, copies)
            else:
                copy_times.cancel(events)
        if not pooled:
            return staged, False, None
        finish = self._finish(read, cpu_entries)
        if done is not None:
            return staged, True, finish
        finish()
        return staged, True, None

    def _finish(self, read: float, entries: int) -> Callable[[], None]:
        """What waits for the pool's run of `read` experts' worth over `entries` entries and observes it."""
        tier = self.tier
        host_finish = tier.host_finish
        assert host_finish is not None

        def finish() -> None:
            tier.observe_pool(read, entries, host_finish())

        return finish


def native_small_step(
    tier: TieredExperts, factory: HostStepFactory | None, entries: int, split_align: int
) -> NativeSmallStep | None:
    """The native step of `tier` where it can run: a factory given (the native kernels built), the CPU
    pool's runs in the background, and copies into a GPU's staging area through the CUDA driver
    (STRATA_DRIVER_COPIES=0 leaves them to torch, and the step to `_serve_small`); else None."""
    if factory is None or tier.host_finish is None:
        return None
    staging, address = tier.staging, None
    if staging is not None and staging.gate_up is not None and staging.gate_up.is_cuda:
        address = staging.copies.address()
        if address is None:
            return None
    step = NativeSmallStep(tier, factory, entries, address, split_align)
    return step if step.native is not None else None
