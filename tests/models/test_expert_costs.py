"""The split of a window's missed experts between the CPU pool and PCIe copies, on described machines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.models.expert_costs import (
    GATE_UP_SHARE,
    OBSERVED_WEIGHT,
    PROBE_EVERY,
    CopyTimes,
    MissCosts,
    pool_costs,
)

EXPERT = 9_437_184  # one Qwen3-30B-A3B expert in bf16: 3 x 2048 x 768 x 2 bytes
H200_HOST = MissCosts(EXPERT, pcie_bytes_s=55e9, cpu_bytes_s=60e9, cpu_row_s=150e-6)  # 16 cores, PCIe 5
OLD_DESKTOP = MissCosts(EXPERT, pcie_bytes_s=12e9, cpu_bytes_s=35e9, cpu_row_s=600e-6)  # PCIe 3 x16, 6 cores
RISER = MissCosts(EXPERT, pcie_bytes_s=0.9e9, cpu_bytes_s=40e9, cpu_row_s=300e-6)  # a card on a x1 riser


def test_a_single_token_splits_its_misses_between_both_sides_by_their_rates() -> None:
    copied = H200_HOST.plan([1] * 8)
    assert 3 <= copied <= 5  # similar rates: about half each way
    assert OLD_DESKTOP.plan([1] * 8) in (1, 2)  # PCIe a third as fast as the CPU


def test_a_prompt_chunk_sends_every_busy_expert_over_pcie() -> None:
    """128 rows an expert: the CPU pays per row, the copy once; it keeps what it ends within the copies."""
    copied = H200_HOST.plan([128] * 128)
    assert copied == 128 - int(128 * H200_HOST.pcie_s() / H200_HOST.cpu_s(128))
    assert OLD_DESKTOP.plan([128] * 128) >= 120


def test_a_slow_link_leaves_a_token_on_the_cpu() -> None:
    assert RISER.plan([1] * 8) == 0


def test_the_experts_with_most_rows_go_first_and_the_split_is_no_worse_than_either_side() -> None:
    rows = [40, 12, 3, 1, 1, 1]
    copied = H200_HOST.plan(rows)
    split = max(copied * H200_HOST.pcie_s(), sum(H200_HOST.cpu_s(r) for r in rows[copied:]))
    assert split <= sum(H200_HOST.cpu_s(r) for r in rows)
    assert split <= len(rows) * H200_HOST.pcie_s()
    assert copied >= 1  # the 40-row expert is the costliest on the CPU


def test_a_lone_miss_is_shared_by_both_sides_where_that_evens_them() -> None:
    """One miss read by one side leaves the other idle: the expert is split so that the CPU pool's first
    channels and the copy of the rest (gate and up rows, all of down) end together, well before either side
    alone would; misses that already split evenly by whole experts are left whole, and where the link is
    useless nothing is shared."""
    host = H200_HOST
    shared = host.share([1], host.plan([1]))
    assert shared is not None and shared[0] == 0
    f = shared[1]
    cpu, copy = f * host.cpu_s(1), (1 - GATE_UP_SHARE * f) * host.pcie_s()
    assert cpu == pytest.approx(copy) and cpu < 0.7 * min(host.cpu_s(1), host.pcie_s())
    assert host.share([1, 1], host.plan([1, 1])) is None
    fixed = replace(host, cpu_fixed_s=0.2 * host.cpu_s(1))  # what summing fewer channels does not shrink
    shared = fixed.share([1], 0)
    assert shared is not None and shared[1] < f
    cpu = fixed.cpu_fixed_s + shared[1] * (host.cpu_s(1) - fixed.cpu_fixed_s)
    assert cpu == pytest.approx((1 - GATE_UP_SHARE * shared[1]) * host.pcie_s())
    eight = host.share([1] * 8, host.plan([1] * 8))
    assert eight is not None and eight[0] in (host.plan([1] * 8) - 1, host.plan([1] * 8))
    assert RISER.share([1], RISER.plan([1])) is None


def test_a_calls_own_cost_is_paid_once_so_a_token_leaves_more_of_its_misses_to_the_pool() -> None:
    """The GPU machine's host with Q4_K experts (2.6 MB; PCIe at 41 GB/s: 63 us a copy): one expert alone
    took 92 us in the CPU pool, eight in one call 299 us. Counting each of eight at one alone's cost sends
    six over PCIe; with the call's cost paid once (and the fit of the timings giving it back) the pool takes
    five of eight, and the token's misses take 30% less time."""
    q4k = 2_621_440
    per_expert, _, _, call = pool_costs(92e-6, 92e-6, 299e-6, None, 32, 8)
    assert per_expert == pytest.approx(207e-6 / 7) and call == pytest.approx(92e-6 - 207e-6 / 7)
    alone = MissCosts(q4k, pcie_bytes_s=41e9, cpu_bytes_s=q4k / 92e-6, cpu_row_s=0.0)
    in_calls = MissCosts(q4k, pcie_bytes_s=41e9, cpu_bytes_s=q4k / per_expert, cpu_row_s=0.0, cpu_call_s=call)
    assert alone.plan([1] * 8) == 5
    copied = in_calls.plan([1] * 8)
    assert copied == 3
    assert max(copied * in_calls.pcie_s(), call + (8 - copied) * per_expert) < 0.7 * 5 * alone.pcie_s()
    # a lone miss: the pool's call alone takes about a copy's time, so sharing the expert would gain nothing
    assert in_calls.plan([1]) == 1 and in_calls.share([1], 1) is None
    assert alone.plan([1]) == 1 and alone.share([1], 1) is not None
    # a call's time, less its own cost, is what its experts are observed at
    rate = in_calls.cpu_bytes_s
    in_calls.observe_cpu(4, 4, call + 4 * 40e-6)
    assert in_calls.cpu_bytes_s == pytest.approx(rate + OBSERVED_WEIGHT * (q4k / 40e-6 - rate))


@pytest.mark.parametrize(("frac", "copied"), [(0.0, 0), (0.5, 4), (1.0, 8)])
def test_pcie_frac_forces_the_share(frac: float, copied: int) -> None:
    assert RISER.plan([1] * 8, pcie_frac=frac) == copied


def test_a_cpu_rate_measured_too_low_is_probed_and_corrected_by_what_the_pool_takes() -> None:
    """A busy host at start measured the CPU pool at 0.8 GB/s: every miss goes over PCIe, until a plan leaves
    one expert to the pool to time it; what that run takes moves the rate, and the split follows."""
    costs = MissCosts(EXPERT, pcie_bytes_s=52e9, cpu_bytes_s=0.8e9, cpu_row_s=30e-6)
    plans = [costs.plan([1] * 8) for _ in range(PROBE_EVERY)]
    assert plans[:-1] == [8] * (PROBE_EVERY - 1) and plans[-1] == 7
    for _ in range(12):  # the pool reads an expert at 50 GB/s
        costs.observe_cpu(1, 1, EXPERT / 50e9)
    assert 45e9 < costs.cpu_bytes_s < 50e9
    assert 3 <= costs.plan([1] * 8) <= 5 and costs.unobserved == 0


class _Event:
    """A CUDA event as `CopyTimes` uses one: recorded, queried, timed against another (milliseconds)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.at, self.ran = clock, 0.0, False

    def record(self) -> None:
        self.at, self.ran = self.clock[0], False

    def query(self) -> bool:
        return self.ran

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3


def _fake_events(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[_Event]]:
    """CopyTimes' events made as `_Event`s on one clock (seconds, moved by the test); returns the clock and
    the events made so far (a list the fakes append to)."""
    clock = [0.0]
    made: list[_Event] = []

    def events() -> tuple[_Event, _Event]:
        made.extend((_Event(clock), _Event(clock)))
        return made[-2], made[-1]

    monkeypatch.setattr("app.models.expert_costs._timing_events", events)
    return clock, made


def test_the_links_rate_follows_the_copies_timed_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured alone at 52 GB/s, the link copies at 26 while the CPU pool reads the same host memory: the
    copies' device time, read at later steps once they have run (never waited for), moves the rate there,
    and the split leaves more of a token's misses to the CPU."""
    costs = MissCosts(EXPERT, pcie_bytes_s=52e9, cpu_bytes_s=60e9, cpu_row_s=30e-6)
    before = costs.plan([1] * 8)
    clock, made = _fake_events(monkeypatch)
    times = CopyTimes(costs, most=3, every=1)
    for step in range(12):
        pair = times.start()
        clock[0] += 2 * EXPERT / 26e9  # two experts' copies at 26 GB/s
        times.stop(pair, 2)
        if step % 2:  # the device has run the copies of every step so far
            for event in made:
                event.ran = True
    assert len(made) <= 2 * 3  # each pair is used again once read
    assert 26e9 < costs.pcie_bytes_s < 30e9
    assert costs.plan([1] * 8) < before


def test_copies_the_device_has_not_run_are_not_read_and_the_oldest_are_dropped() -> None:
    """Five steps' copies, none run yet: nothing is read; once they have run, only the newest `most` (2) are,
    each moving the rate a step (OBSERVED_WEIGHT) towards 26 GB/s."""
    costs = MissCosts(EXPERT, pcie_bytes_s=52e9, cpu_bytes_s=60e9, cpu_row_s=30e-6)
    times = CopyTimes(costs, most=2, every=1)
    clock = [0.0]
    pairs = []
    for _ in range(5):
        pairs.append((_Event(clock), _Event(clock)))
        pairs[-1][0].record()
        clock[0] += EXPERT / 26e9
        times.stop(pairs[-1], 1)  # type: ignore[arg-type]
        times.poll()
    assert costs.pcie_bytes_s == 52e9
    for pair in pairs:
        pair[1].ran = True
    times.poll()
    once = 52e9 + OBSERVED_WEIGHT * (26e9 - 52e9)
    assert costs.pcie_bytes_s == pytest.approx(once + OBSERVED_WEIGHT * (26e9 - once))


def test_only_every_nth_steps_copies_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `every` 4, three steps in four record nothing (their host step pays no event), the fourth is timed
    and moves the link's rate."""
    costs = MissCosts(EXPERT, pcie_bytes_s=52e9, cpu_bytes_s=60e9, cpu_row_s=30e-6)
    clock, made = _fake_events(monkeypatch)
    times = CopyTimes(costs, every=4)
    timed = []
    for _ in range(8):
        pair = times.start()
        timed.append(pair is not None)
        clock[0] += EXPERT / 26e9
        if pair is not None:
            times.stop(pair, 1)
    assert timed == [False, False, False, True] * 2
    for event in made:
        event.ran = True
    times.poll()
    assert costs.pcie_bytes_s < 52e9
