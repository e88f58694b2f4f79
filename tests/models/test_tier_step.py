"""The expert tier's small-window host step as one native call (native/tier_step.cpp, app/models/tier_step.py)
against its reference, `TieredExperts._serve_small`: the same routing, costs and weights stage the same
experts into the same slots with the same bytes, split the same expert at the same channel, and give the
same sums and counts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from app.kernels.cpu_experts import experts_swiglu_sum, finish_background, native_available, small_step
from app.kernels.gguf_quants import random_blocks
from app.kernels.reference import experts_reference
from app.models.expert_costs import PROBE_EVERY, MissCosts
from app.models.expert_tier import ExpertStaging, TieredExperts
from app.models.tier_step import NativeSmallStep, native_small_step

pytestmark = pytest.mark.skipif(not native_available(), reason="the native kernels are not built")

EXPERTS, HIDDEN, INTER, TOP_K = 16, 16, 12, 4
ALIGN = 4  # channels a split is aligned to (SPLIT_ALIGN, small for these experts)
ENTRIES = 64  # the most a step reads


@pytest.fixture(autouse=True)
def _aligned_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.models.expert_tier.SPLIT_ALIGN", ALIGN)


def _tier(
    resident: int, staging: int, gate_up: torch.Tensor, down: torch.Tensor, costs: MissCosts | None
) -> TieredExperts:
    """A tier of these weights on the CPU, its pool run in the background, with a staging area of `staging`
    slots and the costs where given."""
    tier = TieredExperts(
        EXPERTS,
        HIDDEN,
        INTER,
        experts_reference,
        resident,
        experts_swiglu_sum,
        0,
        finish_background,
        small_step,
    )
    tier.fill(gate_up, down, torch.device("cpu"))
    if staging:
        tier.staging = ExpertStaging(staging)
        tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
        tier.costs = replace(costs) if costs is not None else None
        if tier.costs is not None:
            tier.costs.observe_cpu = lambda *observed: None  # type: ignore[method-assign]
    return tier


def _pair(
    resident: int, staging: int, costs: MissCosts | None, pcie_frac: float | None = None, seed: int = 0
) -> tuple[TieredExperts, TieredExperts, NativeSmallStep]:
    """Two tiers alike: one served by `_serve_small`, one by the native step (returned with it)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator).to(torch.bfloat16)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator).to(torch.bfloat16)
    tiers = [_tier(resident, staging, gate_up, down, costs) for _ in range(2)]
    for tier in tiers:
        tier.pcie_frac = pcie_frac
    step = native_small_step(tiers[1], small_step, ENTRIES, ALIGN)
    assert step is not None
    return tiers[0], tiers[1], step


def _window(rows: int, padding: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A window as the host link holds it: picks (ids, padding rows' pointing past the experts, then
    weights; fp32) and x [rows, hidden] (fp32)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)])
    ids[rows - padding :] = EXPERTS
    weights = torch.rand(rows, TOP_K, generator=generator)
    picks = torch.cat([ids.flatten().float(), weights.flatten()])
    return picks, torch.randn(rows, HIDDEN, generator=generator)


def _serve_both(
    reference: TieredExperts, native: TieredExperts, step: NativeSmallStep, rows: int, padding: int, seed: int
) -> None:
    """One window through each: the same staged slots, pool runs, sums, staging bytes, counts and probes."""
    picks, x = _window(rows, padding, seed)
    entries = rows * TOP_K
    sums = torch.zeros(rows, HIDDEN)
    listed = picks.tolist()
    expected = reference._serve_small(listed[:entries], TOP_K, x, listed[entries:], sums)
    got_sums = torch.full((rows, HIDDEN), 7.0)  # what a step before left: zeroed first
    got = step.serve(picks.data_ptr(), rows, TOP_K, x.data_ptr(), got_sums.data_ptr(), rows, None)
    assert got[0] == expected[0] and got[1] == expected[1] and got[2] is None and expected[2] is None
    assert torch.equal(got_sums, sums)
    assert native.served == reference.served and native.pcie_bytes == reference.pcie_bytes
    if reference.staging is not None:
        assert native.staging is not None and native.staging.gate_up is not None
        assert torch.equal(native.staging.gate_up, reference.staging.gate_up)
        assert torch.equal(native.staging.down, reference.staging.down)
        assert native.staging.zeroed == reference.staging.zeroed
    if reference.costs is not None:
        assert native.costs is not None and native.costs.unobserved == reference.costs.unobserved


# experts of 1 ms over the link: the CPU pool as fast; twice as fast; half as fast and slow per row
COSTS = [
    MissCosts(expert_bytes=10**6, pcie_bytes_s=1e9, cpu_bytes_s=1e9, cpu_row_s=2e-4, cpu_call_s=1e-4),
    MissCosts(expert_bytes=10**6, pcie_bytes_s=1e9, cpu_bytes_s=2e9, cpu_row_s=1e-4, cpu_fixed_s=1e-4),
    MissCosts(expert_bytes=10**6, pcie_bytes_s=2e9, cpu_bytes_s=1e9, cpu_row_s=5e-4, cpu_call_s=3e-4),
]


@pytest.mark.parametrize("costs", COSTS, ids=["even", "pool-fast", "link-fast"])
@pytest.mark.parametrize("resident", [0, 5])
def test_the_native_step_stages_splits_and_sums_as_the_reference(costs: MissCosts, resident: int) -> None:
    """Windows of 1 to 12 rows (some padded) through both, over a staging area with room for every host
    expert: the plans, splits and sums agree."""
    reference, native, step = _pair(resident, EXPERTS - resident + 1, costs)
    shapes = random.Random(resident)
    for seed in range(24):
        rows = shapes.randint(1, 12)
        _serve_both(reference, native, step, rows, shapes.randint(0, rows - 1), seed)
    vram, cpu, pcie = native.served
    assert cpu and pcie and (vram > 0) == (resident > 0)
    assert native.staging is not None and native.staging.zeroed  # experts were split


def test_a_forced_share_few_slots_and_no_staging_agree() -> None:
    """`pcie_frac` forced (no split then); fewer staging slots than misses; no staging area (every miss on
    the pool)."""
    for staging, frac in ((EXPERTS + 1, 0.5), (2, None), (0, None)):
        reference, native, step = _pair(2, staging, COSTS[0], frac, seed=staging)
        for seed in range(8):
            _serve_both(reference, native, step, 1 + seed % 5, 0, 100 + seed)
        assert (native.served[2] > 0) == (staging > 0)


def test_the_probe_every_64th_plan_leaves_one_expert_to_the_pool_on_both() -> None:
    """A pool measured far too slow: every miss goes over PCIe, but each PROBE_EVERY-th plan leaves one to the
    pool, on both paths at the same windows."""
    slow = MissCosts(expert_bytes=10**6, pcie_bytes_s=1e9, cpu_bytes_s=1e6, cpu_row_s=0.0)
    reference, native, step = _pair(0, EXPERTS + 1, slow)
    for seed in range(PROBE_EVERY + 3):
        _serve_both(reference, native, step, 1, 0, seed)
    assert native.served[1] == 1  # one probe, one entry on the pool


def test_a_background_run_with_a_done_word_is_left_running_and_sets_it() -> None:
    reference, _, step = _pair(0, 0, None)
    picks, x = _window(2, 0, 3)
    sums, done = torch.zeros(2, HIDDEN), torch.zeros(1, dtype=torch.int32)
    staged, pooled, finish = step.serve(picks.data_ptr(), 2, TOP_K, x.data_ptr(), sums.data_ptr(), 0, done)
    assert staged == {} and pooled and finish is not None
    finish()
    assert done.item() == 1
    listed = picks.tolist()
    expected = torch.zeros(2, HIDDEN)
    reference._serve_small(listed[: 2 * TOP_K], TOP_K, x, listed[2 * TOP_K :], expected)
    assert torch.equal(sums, expected)


def test_gguf_blocks_are_served_whole_never_split() -> None:
    """Q4_K gates and Q6_K downs (a Q4_K_M file's) held as blocks: no channel range to split, so misses are
    copied or pooled whole, as the reference does."""
    hidden = inter = 256
    gate_up = random_blocks("Q4_K", (EXPERTS, 2 * inter, hidden), 1)
    down = random_blocks("Q6_K", (EXPERTS, hidden, inter), 2)
    tiers = []
    for _ in range(2):
        tier = TieredExperts(
            EXPERTS, hidden, inter, experts_reference, 0, experts_swiglu_sum, 0, finish_background, small_step
        )
        tier.fill(gate_up, down, torch.device("cpu"))
        tier.staging = ExpertStaging(EXPERTS + 1)
        tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
        tier.costs = MissCosts(expert_bytes=10**6, pcie_bytes_s=1e9, cpu_bytes_s=1e9, cpu_row_s=0.0)
        tier.costs.observe_cpu = lambda *observed: None  # type: ignore[method-assign]
        tiers.append(tier)
    step = native_small_step(tiers[1], small_step, ENTRIES, ALIGN)
    assert step is not None
    generator = torch.Generator().manual_seed(5)
    ids = torch.randperm(EXPERTS, generator=generator)[:TOP_K][None]
    weights = torch.rand(1, TOP_K, generator=generator)
    x = torch.randn(1, hidden, generator=generator)
    picks = torch.cat([ids.flatten().float(), weights.flatten()])
    expected = torch.zeros(1, hidden)
    staged, _, _ = tiers[0]._serve_small(
        ids.flatten().tolist(), TOP_K, x, weights.flatten().tolist(), expected
    )
    sums = torch.zeros(1, hidden)
    got = step.serve(picks.data_ptr(), 1, TOP_K, x.data_ptr(), sums.data_ptr(), 0, None)
    assert got[0] == staged and 0 < len(staged) < TOP_K and torch.equal(sums, expected)
    assert torch.equal(tiers[1].staging.gate_up, tiers[0].staging.gate_up)
    assert tiers[1].pcie_bytes == tiers[0].pcie_bytes == len(staged) * tiers[0].expert_bytes()


def test_bad_routing_is_refused_and_harms_nothing_after() -> None:
    """More entries than the step reads, or a missed expert whose host slot is out of range (a corrupt
    table): a ValueError, no pool run left going; the next window is served as the reference serves it."""
    reference, native, step = _pair(0, EXPERTS + 1, COSTS[0])
    picks, x = _window(ENTRIES // TOP_K + 1, 0, 1)
    sums = torch.zeros(x.shape)
    with pytest.raises(ValueError, match="at most 64 entries"):
        step.serve(picks.data_ptr(), x.shape[0], TOP_K, x.data_ptr(), sums.data_ptr(), 0, None)
    native.host_table[:] = 10**6
    picks, x = _window(1, 0, 2)
    with pytest.raises(ValueError, match="host slot"):
        step.serve(picks.data_ptr(), 1, TOP_K, x.data_ptr(), sums.data_ptr(), 0, None)
    native.host_table = torch.tensor(native.host_of)
    _serve_both(reference, native, step, 3, 1, 4)
