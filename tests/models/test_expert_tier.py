"""The expert tier of a MoE layer: some experts on the device, every expert in host RAM, each routed entry
computed where its expert lives; frozen, it gives the all-resident layer's outputs."""

from __future__ import annotations

import pytest
import torch

from app.kernels.cpu_experts import expert_swiglu
from app.kernels.reference import experts_reference
from app.models.expert_tier import TieredExperts

EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 12, 3


def _tier(resident: int, seed: int = 0) -> TieredExperts:
    generator = torch.Generator().manual_seed(seed)
    tier = TieredExperts(EXPERTS, HIDDEN, INTER, experts_reference, resident, expert_swiglu)
    with torch.no_grad():
        tier.host_gate_up.copy_(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.2)
        tier.host_down.copy_(torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * 0.2)
    tier.place(torch.device("cpu"))
    return tier


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return x, ids, weights


@pytest.mark.parametrize("resident", [0, 2, 7])
def test_a_frozen_tier_sums_like_the_reference_term_for_term(resident: int) -> None:
    tier = _tier(resident)
    x, ids, weights = _routing(20, 1)
    expected = experts_reference(x, ids, weights, tier.host_gate_up, tier.host_down)
    assert torch.equal(tier(x, ids, weights), expected)
    assert tier.locations() == [0] * resident + [1] * (EXPERTS - resident)


@pytest.mark.parametrize("resident", [0, 3])
def test_the_device_path_adds_the_host_experts_to_the_kernels_resident_sum(resident: int) -> None:
    """What runs on a GPU: the experts kernel over resident entries (others weighted 0), misses on the CPU."""
    tier = _tier(resident, seed=2)
    x, ids, weights = _routing(9, 3)
    expected = experts_reference(x, ids, weights, tier.host_gate_up, tier.host_down)
    torch.testing.assert_close(tier._split(x, ids, weights), expected, rtol=1e-5, atol=1e-6)


def test_only_the_resident_experts_are_placed_on_the_device() -> None:
    tier = _tier(3)
    assert tier.gate_up is not None and tier.gate_up.shape[0] == 3
    assert tier.slot_of is not None and tier.slot_of.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="resident experts"):
        TieredExperts(EXPERTS, HIDDEN, INTER, experts_reference, EXPERTS, expert_swiglu)


def test_adapting_makes_the_most_routed_experts_resident() -> None:
    tier = _tier(2, seed=4)
    x, _, weights = _routing(12, 5)
    hot = torch.tensor([[5, 6, e % 4] for e in range(12)])  # experts 5 and 6 in every row
    tier(x, hot, weights)
    assert tier.adapt() == 2
    assert tier.locations() == [1, 1, 1, 1, 1, 0, 0, 1]
    assert tier.gate_up is not None and {tier.slots[5], tier.slots[6]} == {0, 1}
    assert torch.equal(tier.gate_up[tier.slots[5]], tier.host_gate_up[5])
    expected = experts_reference(x, hot, weights, tier.host_gate_up, tier.host_down)
    assert torch.equal(tier(x, hot, weights), expected)
    assert tier.adapt() == 0  # still the hottest: nothing moves
