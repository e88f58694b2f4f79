"""The split of a window's missed experts between the CPU pool and PCIe copies, on described machines."""

from __future__ import annotations

import pytest

from app.models.expert_costs import PROBE_EVERY, MissCosts

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
