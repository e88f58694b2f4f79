"""The expert tier of a MoE layer: some experts on the device, the others in host RAM, each routed entry
computed where its expert lives; frozen, it gives the all-resident layer's outputs."""

from __future__ import annotations

import pytest
import torch
from spies import recorded

from app.kernels.cpu_experts import (
    by_expert,
    experts_swiglu_sum,
    experts_swiglu_sum_reference,
    finish_background,
)
from app.kernels.gguf_quants import random_blocks
from app.kernels.reference import experts_reference
from app.models.expert_costs import MissCosts
from app.models.expert_tier import ADAPT_DECAY, ADAPT_MEMORY, ExpertStaging, TierCounts, TieredExperts

EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 12, 3


FULL: dict[TieredExperts, tuple[torch.Tensor, torch.Tensor]] = {}  # each test tier's experts, all of them


def _tier(resident: int, seed: int = 0, spare: int = 0) -> TieredExperts:
    generator = torch.Generator().manual_seed(seed)
    tier = TieredExperts(EXPERTS, HIDDEN, INTER, experts_reference, resident, experts_swiglu_sum, spare)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * 0.2
    tier.fill(gate_up, down, torch.device("cpu"))
    FULL[tier] = (gate_up, down)
    return tier


def _assert_every_expert_intact(tier: TieredExperts) -> None:
    """Each expert lives in exactly one place, a device slot or a host slot, with its own weights there."""
    gate_up, down = FULL[tier]
    for e in range(EXPERTS):
        slot, host = tier.slots[e], tier.host_of[e]
        assert (slot >= 0) != (host >= 0)
        held = (
            (tier.gate_up[slot], tier.down[slot])
            if slot >= 0
            else (tier.host_gate_up[host], tier.host_down[host])
        )
        assert torch.equal(held[0], gate_up[e]) and torch.equal(held[1], down[e])


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return x, ids, weights


def _decode(tier: TieredExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Each row through the tier as a window of its own (batch-1 decode)."""
    for row in range(x.shape[0]):
        tier(x[row : row + 1], ids[row : row + 1], weights[row : row + 1])


@pytest.mark.parametrize("resident", [0, 2, 7])
def test_a_frozen_tier_sums_like_the_reference_term_for_term(resident: int) -> None:
    tier = _tier(resident)
    x, ids, weights = _routing(20, 1)
    expected = experts_reference(x, ids, weights, *FULL[tier])
    assert torch.equal(tier(x, ids, weights), expected)
    assert tier.locations() == [0] * resident + [1] * (EXPERTS - resident)


@pytest.mark.parametrize("resident", [0, 3])
def test_the_device_path_adds_the_host_experts_to_the_kernels_resident_sum(resident: int) -> None:
    """What runs on a GPU: the experts kernel over resident entries (others weighted 0), misses on the CPU."""
    tier = _tier(resident, seed=2)
    for rows, seed in ((9, 3), (2, 4)):  # the second window's CPU share in the first one's buffers
        x, ids, weights = _routing(rows, seed)
        expected = experts_reference(x, ids, weights, *FULL[tier])
        torch.testing.assert_close(tier._split(x, ids, weights), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pcie_frac", [0.5, 1.0])
@pytest.mark.parametrize("read_whole", [True, False], ids=["routing-read", "counts-read"])
def test_missed_experts_copied_to_staging_slots_add_up_like_the_reference(
    pcie_frac: float, read_whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Misses split between staging slots (copied, run by the experts kernel) and the CPU pool; the entries
    of each source counted. A small window reads its routing whole, a large one counts per expert first."""
    monkeypatch.setattr("app.models.expert_tier.HOST_READ_ENTRIES", 1024 if read_whole else 0)
    tier = _tier(2, seed=4)
    tier.staging = ExpertStaging(EXPERTS - 2)
    tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
    tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
    tier.pcie_frac = pcie_frac
    x, ids, weights = _routing(11, 5)
    expected = experts_reference(x, ids, weights, *FULL[tier])
    torch.testing.assert_close(tier._split(x, ids, weights), expected, rtol=1e-5, atol=1e-6)
    counts = tier.take_counts()
    (vram, cpu, pcie), copied = counts.served, counts.pcie_bytes
    assert vram == int((ids < 2).sum()) and vram + cpu + pcie == ids.numel()
    assert pcie > 0 and (cpu == 0) == (pcie_frac == 1.0)
    staged = round(pcie_frac * len(set(ids[ids >= 2].tolist())))
    assert copied == staged * tier.expert_bytes()
    assert tier.take_counts() == TierCounts([0, 0, 0], 0, 0.0)


def test_a_large_windows_pool_runs_while_its_copies_cross_and_reads_its_entries_before_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read to the host waits for every copy queued before it on a GPU: the CPU pool's entries are read
    before the window's copies are queued, and its run comes after them, so that both sides run at once."""
    monkeypatch.setattr("app.models.expert_tier.HOST_READ_ENTRIES", 0)
    tier = _tier(2, seed=4)
    tier.staging = ExpertStaging(EXPERTS - 2)
    tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
    tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
    tier.pcie_frac = 0.5
    order: list[str] = []
    monkeypatch.setattr(tier, "_to_host", recorded(order, "read", tier._to_host))
    monkeypatch.setattr(tier.staging, "load", recorded(order, "copy", tier.staging.load))
    monkeypatch.setattr(tier, "host_kernel", recorded(order, "pool", tier.host_kernel))
    x, ids, weights = _routing(11, 5)
    torch.testing.assert_close(
        tier._split(x, ids, weights), experts_reference(x, ids, weights, *FULL[tier]), rtol=1e-5, atol=1e-6
    )
    assert order == ["read", "read", "copy", "pool"]  # the counts, the pool's entries; then copies, pool


def test_a_lone_miss_shared_by_the_cpu_pool_and_a_staging_slot_adds_up_like_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One missed expert, as fast on either side: the CPU pool sums its first channels, the experts kernel the
    rest from the last staging slot, whose first gate rows are zero (over another expert's weights left there
    by a whole copy), and the sum is the reference's; its entries count as the pool's, the copy's bytes as
    the part copied. Whole copies beside a split take the other slots."""
    monkeypatch.setattr("app.models.expert_tier.SPLIT_ALIGN", 4)
    tier = _tier(5, seed=4)  # experts 5, 6 and 7 in host RAM
    tier.staging = ExpertStaging(2)
    tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
    tier.staging.load([6, 7], [1, 2], tier.host_gate_up, tier.host_down)  # stale weights in both slots
    x, _, weights = _routing(2, 5)
    # a lone miss split; three misses: one copied whole, one split, one on the pool
    for ids, served in (([[7, 0, 1], [2, 3, 4]], [5, 1, 0]), ([[5, 6, 7], [0, 1, 2]], [3, 2, 1])):
        # as described each time (the pool's observed rate would follow its tiny experts)
        tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
        routing = torch.tensor(ids)
        expected = experts_reference(x, routing, weights, *FULL[tier])
        torch.testing.assert_close(tier._split(x, routing, weights), expected, rtol=1e-5, atol=1e-6)
        assert tier.take_counts().served == served
    assert tier.staging.gate_up is not None and tier.staging.gate_up[1, :8].abs().sum() == 0
    # whole experts in every slot (as a layer stream writes them) take the zero rows: the next split zeroes
    tier.staging.load([6, 7], [1, 2], tier.host_gate_up, tier.host_down)
    tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
    routing = torch.tensor([[7, 0, 1], [2, 3, 4]])
    expected = experts_reference(x, routing, weights, *FULL[tier])
    torch.testing.assert_close(tier._split(x, routing, weights), expected, rtol=1e-5, atol=1e-6)
    assert tier.take_counts().pcie_bytes == round((1 - 2 / 3 * 8 / INTER) * tier.expert_bytes())  # f = 0.6


@pytest.mark.parametrize("rows", [3, 40], ids=["routing-read", "counts-read"])
def test_a_tier_of_q4_k_gates_and_q6_k_downs_serves_misses_from_staging_and_the_cpu_pool(rows: int) -> None:
    """A Q4_K_M file's experts as a tier holds them: Q4_K gates and ups, Q6_K down projections, blocks on the
    device and in host RAM alike. Misses copied into staging slots and those the native CPU pool sums from
    host RAM add up to every expert's sum (the experts kernel here the pool's reference, which reads the
    token vectors quantized as the pool does)."""
    hidden = inter = 256
    gate_up = random_blocks("Q4_K", (EXPERTS, 2 * inter, hidden), 1)
    down = random_blocks("Q6_K", (EXPERTS, hidden, inter), 2)

    def kernel(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *experts: torch.Tensor
    ) -> torch.Tensor:
        kept = weights * (ids >= 0)  # entries of experts elsewhere (-1) add nothing
        return experts_swiglu_sum_reference(x, *by_expert(ids.clamp(min=0), kept), *experts)

    tier = TieredExperts(EXPERTS, hidden, inter, kernel, 2, experts_swiglu_sum, 0)
    tier.fill(gate_up, down, torch.device("cpu"))
    assert tier.host_gate_up.dtype == tier.host_down.dtype == torch.uint8
    tier.staging = ExpertStaging(3)
    tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
    tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=generator)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)])
    weights = torch.rand(rows, TOP_K, generator=generator)
    expected = kernel(x, ids, weights, gate_up, down)
    torch.testing.assert_close(tier._split(x, ids, weights), expected, rtol=1e-5, atol=1e-5)
    _, cpu, pcie = tier.take_counts().served
    assert cpu > 0 and pcie > 0


def test_a_pool_run_in_the_background_gives_the_same_bits_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small window's CPU pool run started on its own thread while the staging copies are queued (a split
    expert among them) adds the same sums, and counts the same entries and bytes, as one run after the
    copies."""
    monkeypatch.setattr("app.models.expert_tier.SPLIT_ALIGN", 4)
    x, _, weights = _routing(2, 5)
    results = []
    for finish in (None, finish_background):
        tier = _tier(5, seed=4)
        tier.host_finish = finish
        tier.staging = ExpertStaging(2)
        tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
        out = []
        # a lone miss split; then one copied, one split, one on the pool
        for ids in ([[7, 0, 1], [2, 3, 4]], [[5, 6, 7], [0, 1, 2]]):
            tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
            out.append(tier._split(x, torch.tensor(ids), weights))
        results.append((out, tier.take_counts()))
    (plain, plain_counts), (background, background_counts) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, background, strict=True))
    assert plain_counts == background_counts and plain_counts.served == [8, 3, 1]
    assert plain_counts.pcie_bytes % tier.expert_bytes()  # a split expert's share crossed


@pytest.mark.parametrize("pcie_frac", [None, 0.5])
@pytest.mark.parametrize("read_whole", [True, False], ids=["routing-read", "counts-read"])
def test_the_misses_of_padding_rows_are_left_out(
    pcie_frac: float | None, read_whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows marked dead (graph padding) get only their resident experts' sum, and are not counted (misses
    on the CPU only, or half of them staged)."""
    monkeypatch.setattr("app.models.expert_tier.HOST_READ_ENTRIES", 1024 if read_whole else 0)
    tier = _tier(3, seed=8)
    if pcie_frac is not None:
        tier.staging = ExpertStaging(EXPERTS - 3)
        tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cpu"))
        tier.costs = MissCosts(expert_bytes=1, pcie_bytes_s=1.0, cpu_bytes_s=1.0, cpu_row_s=0.0)
        tier.pcie_frac = pcie_frac
    x, ids, weights = _routing(6, 9)
    live = torch.tensor([1, 1, 0, 1, 0, 0])
    out = tier._split(x, ids, weights, live)
    expected = experts_reference(x, ids, weights, *FULL[tier])
    resident_only = experts_reference(x, ids, weights * (ids < 3), *FULL[tier])
    alive = live.bool()
    torch.testing.assert_close(out[alive], expected[alive], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[~alive], resident_only[~alive], rtol=1e-5, atol=1e-6)
    vram, cpu, pcie = tier.take_counts().served
    assert vram + cpu + pcie == 3 * ids.shape[1] and vram == int((ids[alive] < 3).sum())


def test_staging_copies_runs_of_consecutive_experts_into_the_first_slots() -> None:
    gate_up = torch.arange(8.0).reshape(8, 1, 1).expand(8, 2, 3).contiguous()
    down = gate_up[:, :1, :2].contiguous()
    staging = ExpertStaging(5)
    staging.allocate(gate_up, down, torch.device("cpu"))
    assert staging.load([6, 2, 3, 4], [6, 2, 3, 4], gate_up, down) == {2: 0, 3: 1, 4: 2, 6: 3}
    assert staging.gate_up is not None and staging.gate_up[:4, 0, 0].tolist() == [2.0, 3.0, 4.0, 6.0]


def test_only_the_resident_experts_are_placed_on_the_device() -> None:
    """The resident experts on the device, the others in host RAM (one free host slot beside them)."""
    tier = _tier(3)
    assert tier.host_gate_up.shape[0] == EXPERTS - 3 + 1
    _assert_every_expert_intact(tier)
    assert tier.gate_up is not None and tier.gate_up.shape[0] == 3
    assert tier.slot_of is not None and tier.slot_of.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="resident experts"):
        TieredExperts(EXPERTS, HIDDEN, INTER, experts_reference, EXPERTS, experts_swiglu_sum)


def test_adapting_makes_the_most_routed_experts_resident() -> None:
    tier = _tier(2, seed=4)
    x, _, weights = _routing(12, 5)
    hot = torch.tensor([[5, 6, e % 4] for e in range(12)])  # experts 5 and 6 in every row
    _decode(tier, x, hot, weights)
    assert tier.adapt() == 2
    assert tier.locations() == [1, 1, 1, 1, 1, 0, 0, 1]
    assert tier.gate_up is not None and {tier.slots[5], tier.slots[6]} == {0, 1}
    assert torch.equal(tier.gate_up[tier.slots[5]], FULL[tier][0][5])
    expected = experts_reference(x, hot, weights, *FULL[tier])
    assert torch.equal(tier(x, hot, weights), expected)
    assert tier.adapt() == 0  # still the hottest: nothing moves
    _assert_every_expert_intact(tier)  # the outgoing experts went back to host RAM whole
    counts = tier.take_counts()
    assert counts.pcie_bytes == 2 * tier.expert_bytes() and counts.adapt_wait_s > 0


def test_an_expert_routed_within_noise_of_a_resident_one_does_not_take_its_place() -> None:
    """Experts 0 and 1 resident: expert 2 routed three times against resident 0's once is within the noise
    of their counts (SWAP_MARGIN) and moves nothing; routed four times more (beside 1 and 3), it takes 0's
    place."""
    tier = _tier(2, seed=4)
    x, _, weights = _routing(3, 5)
    _decode(tier, x, torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 0]]), weights)
    assert tier.adapt() == 0 and tier.locations()[:3] == [0, 0, 1]
    x, _, weights = _routing(4, 6)
    _decode(tier, x, torch.tensor([[2, 1, 3]] * 4), weights)
    assert tier.adapt() == 1 and tier.locations()[:3] == [1, 0, 0]


def test_a_window_counts_each_expert_it_routes_to_once_and_padding_rows_not_at_all() -> None:
    """A missed expert costs a window one read of its weights, whatever its rows: a prompt chunk routed to
    every expert counts each once, and the decoding slot's experts, routed in more windows, stay resident
    (counted by entries, the chunk's experts 5 to 7 would have taken their places)."""
    tier = _tier(2, seed=4)
    x, _, weights = _routing(6, 5)
    tier(x, torch.tensor([[5, 6, 7]] * 5 + [[0, 1, 2]]), weights, torch.tensor([1, 1, 1, 1, 1, 0]))
    assert tier.heat is not None and tier.heat.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    tier.heat.zero_()
    chunk = torch.tensor([[0, 1, 2]] + [[5, 6, 7]] * 30 + [[0, 1, 2], [3, 4, 2]])  # a decode row first
    x, _, weights = _routing(chunk.shape[0], 6)
    for _ in range(8):
        tier(x[:1], chunk[:1], weights[:1])  # a decode-only window
        tier(x, chunk, weights)  # the decode row beside a prompt chunk
    assert tier.heat.tolist() == [16, 16, 16, 8, 8, 8, 8, 8]
    assert tier.adapt() == 0 and tier.locations()[:2] == [0, 0]


def test_few_entries_since_the_last_adaptation_keep_more_of_the_older_counts() -> None:
    """The counts remember about ADAPT_MEMORY entries an expert: an adaptation after few entries keeps most
    of the older counts, one after many halves them (ADAPT_DECAY at least)."""
    tier = _tier(2, seed=4)
    memory = ADAPT_MEMORY * tier.experts
    assert tier.heat is not None
    tier.heat[5] = memory / 4
    tier.adapt()
    assert tier.heat[5].item() == pytest.approx(memory / 4 * 0.75)
    tier.heat[6] += 2 * memory
    tier.adapt()
    assert tier.heat[5].item() == pytest.approx(memory / 4 * 0.75 * ADAPT_DECAY)
    assert tier.heat[6].item() == pytest.approx(2 * memory * ADAPT_DECAY)


def test_a_streamed_layers_routing_does_not_steer_adaptation() -> None:
    """A layer computed from its whole host part streamed ahead pays the same whichever experts are resident,
    so a long prompt's window leaves the counts to the windows that do stop for misses (a decoding slot's)."""

    class Streaming:
        active = True

    tier = _tier(2, seed=6)
    tier.stream, tier.position = Streaming(), 1  # type: ignore[assignment]
    x, _, weights = _routing(400, 7)  # more routed entries than a small window's
    tier(x, torch.tensor([[4, 5, 6]] * 400), weights)
    x, _, weights = _routing(8, 8)
    _decode(tier, x, torch.tensor([[3, 7, 1], [3, 7, 2]] * 4), weights)  # a few decode windows
    assert tier.adapt() == 2 and tier.locations() == [1, 1, 1, 0, 1, 1, 1, 0]
    tier.stream = None
    x, _, weights = _routing(20, 7)
    _decode(tier, x, torch.tensor([[4, 5, 6]] * 20), weights)  # unstreamed windows count
    assert tier.adapt() == 2 and tier.slots[4] >= 0 and tier.slots[5] >= 0


def test_asynchronous_swaps_fill_spare_slots_and_land_at_the_next_forward() -> None:
    """One spare slot: one swap a round; the copied expert takes the spare slot when it lands (between
    windows), and the outgoing expert's slot becomes the spare one."""
    tier = _tier(2, seed=6, spare=1)
    assert tier.gate_up is not None and tier.gate_up.shape[0] == 3 and tier.spare_slots == [2]
    x, _, weights = _routing(12, 7)
    hot = torch.tensor([[5, 6, e % 4] for e in range(12)])
    _decode(tier, x, hot, weights)
    assert tier.adapt() == 1  # the hottest expert in host RAM, into the spare slot
    assert tier.locations() == [0, 0, 1, 1, 1, 1, 1, 1]  # not landed yet
    assert tier.adapt() == 0  # one round at a time
    tier.land()
    expected = experts_reference(x, hot, weights, *FULL[tier])
    assert torch.equal(tier(x, hot, weights), expected)
    moved = 5 if tier.slots[5] >= 0 else 6
    assert tier.slots[moved] == 2 and tier.locations().count(0) == 2 and len(tier.spare_slots) == 1
    assert torch.equal(tier.gate_up[2], FULL[tier][0][moved])
    assert tier.adapt() == 1
    tier.land()
    assert tier.locations() == [1, 1, 1, 1, 1, 0, 0, 1]
    _assert_every_expert_intact(tier)
    counts = tier.take_counts()
    assert counts.pcie_bytes == 2 * tier.expert_bytes() and counts.adapt_wait_s == 0.0  # windows never wait
