"""The host's own work in one tiered layer's step, on the CPU: what a window pays per layer beyond copies
and kernels.

    python benchmarks/tier_host_step.py

A layer of 128 experts, top-8, with tiny experts (hidden 64: the CPU pool's arithmetic is negligible) and
the costs of the H200 machine (PCIe 52 GB/s, CPU pool 50 GB/s + 28 us a row), torch on one thread as in the
engine: microseconds per host step of a small window as a captured decode window runs it (read the routing
from the host link's buffers, count entries per expert, plan, queue staging copies, run the CPU share into
the link's sums: `_serve_small`, the pool's run on its own thread unless STRATA_POOL_BACKGROUND=0) for 96
and 0 experts resident at 1 and 16 rows, and the batch-1 step with none resident without its copies, then
without its CPU pool call too (its planning in Python alone); then, where the native kernels are built, the
same steps as one native call (app/models/tier_step.py: `native_*`). The costs stay the described ones (the
CPU pool's observed rate on these tiny experts would say nothing of the machine). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.cpu_experts import background_finish, experts_swiglu_sum, host_step, small_step
from app.kernels.reference import experts_reference
from app.models.expert_costs import MissCosts
from app.models.expert_tier import SPLIT_ALIGN, ExpertStaging, TieredExperts
from app.models.tier_step import native_small_step

EXPERTS, HIDDEN, INTER, TOP_K = 128, 64, 32, 8
H200_HOST = MissCosts(9_437_184, pcie_bytes_s=52e9, cpu_bytes_s=50e9, cpu_row_s=28e-6)


def step_us(
    resident: int, rows: int, calls: int = 250, copies: bool = True, pool: bool = True, native: bool = False
) -> float:
    """Microseconds a host step of `rows` rows takes at `resident` experts resident; without `copies` the
    staging copies are not queued (on a GPU they are the driver's, not these torch copies), without `pool`
    the CPU pool is not called: what is left is the step's planning in Python. With `native`, the native
    step (app/models/tier_step.py, its copies plain ones of host memory) instead of `_serve_small`."""
    finish = background_finish()  # the engine's default: the pool's run beside the copies' queueing
    kernel = experts_swiglu_sum if pool else _no_pool
    tier = TieredExperts(EXPERTS, HIDDEN, INTER, experts_reference, resident, kernel, 0, finish)
    if not pool:
        tier.host_finish = lambda: 0.0
    tier.fill(
        torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.1,
        torch.randn(EXPERTS, HIDDEN, INTER) * 0.1,
        torch.device("cpu"),
    )
    tier.staging = ExpertStaging(EXPERTS - resident)
    tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
    tier.costs = replace(H200_HOST)
    tier.costs.observe_cpu = lambda *observed: None  # type: ignore[method-assign]
    if not copies:
        staging = tier.staging
        staging.load = lambda experts, *_: {e: slot for slot, e in enumerate(experts)}  # type: ignore[method-assign]
        staging.load_rest = lambda *_: staging.slots - 1  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(0)
    inputs = [
        (
            torch.randn(rows, HIDDEN, generator=generator),
            torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)]),
            torch.rand(rows, TOP_K, generator=generator),
        )
        for _ in range(calls + 50)
    ]
    sums = torch.zeros(rows, HIDDEN)
    native_step = native_small_step(tier, small_step, rows * TOP_K, SPLIT_ALIGN) if native else None
    picked = [torch.cat([ids.flatten().float(), weights.flatten()]) for _, ids, weights in inputs]
    at = {id(ids): i for i, (_, ids, _) in enumerate(inputs)}

    def step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if native_step is not None:
            picks = picked[at[id(ids)]].data_ptr()
            native_step.serve(picks, rows, TOP_K, x.data_ptr(), sums.data_ptr(), rows, None)
            return
        sums.zero_()
        tier._serve_small(ids.flatten().tolist(), TOP_K, x, weights.flatten().tolist(), sums)

    for inputs_ in inputs[:50]:
        step(*inputs_)
    began = time.perf_counter()
    for inputs_ in inputs[50:]:
        step(*inputs_)
    return (time.perf_counter() - began) / calls * 1e6


def _no_pool(*args: Any, **kwargs: Any) -> None:
    """A CPU pool call that computes nothing (`step_us` without `pool`)."""


def main() -> None:
    torch.set_num_threads(1)
    line = {
        f"resident{resident}_rows{rows}_us": round(step_us(resident, rows), 1)
        for resident in (96, 0)
        for rows in (1, 16)
    }
    # the batch-1 step with no expert resident without its copies, then without its CPU pool call too
    line["resident0_rows1_no_copies_us"] = round(step_us(0, 1, copies=False), 1)
    line["resident0_rows1_planning_us"] = round(step_us(0, 1, copies=False, pool=False), 1)
    if host_step() is not None:  # the same steps in one native call
        for resident in (96, 0):
            for rows in (1, 16):
                native = step_us(resident, rows, native=True)
                line[f"native_resident{resident}_rows{rows}_us"] = round(native, 1)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), **line}))


if __name__ == "__main__":
    main()
