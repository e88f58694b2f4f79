"""Runs of elements copied host to device (app/models/host_copies.py): on the CPU torch copies them; the
driver's path is checked against the same copies on a GPU (tests/gpu/test_tier_link_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from app.models import host_copies
from app.models.expert_tier import ExpertStaging
from app.models.host_copies import PinnedCopies


def test_runs_land_where_they_are_named_and_nothing_else_moves() -> None:
    source = torch.arange(40, dtype=torch.float32).view(4, 10)
    target = torch.zeros(3, 10)
    PinnedCopies(torch.device("cpu")).queue((target, source, [(0, 20, 10), (12, 3, 5)]))
    want = torch.zeros(30)
    want[:10] = torch.arange(20, 30)
    want[12:17] = torch.arange(3, 8)
    assert torch.equal(target.view(-1), want)


def test_staging_loads_experts_and_a_split_experts_later_channels() -> None:
    """Whole experts (consecutive host slots as one run) and the last slot's kept channels: the bits torch's
    slices give, the split slot's first gate rows zero."""
    experts, inter, hidden = 6, 4, 3
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    staging = ExpertStaging(4)
    staging.allocate(gate_up, down, torch.device("cpu"))
    assert staging.load([7, 9, 8], [4, 1, 2], gate_up, down) == {9: 0, 8: 1, 7: 2}
    assert torch.equal(staging.gate_up[:3], gate_up[[1, 2, 4]])
    assert torch.equal(staging.down[:3], down[[1, 2, 4]])
    assert staging.load_rest(5, 2, gate_up, down) == 3
    assert torch.equal(staging.gate_up[3, :2], torch.zeros(2, hidden))
    assert torch.equal(staging.gate_up[3, 2:inter], gate_up[5, 2:inter])
    assert torch.equal(staging.gate_up[3, inter + 2 :], gate_up[5, inter + 2 :])
    assert torch.equal(staging.down[3], down[5])


def test_the_drivers_copy_is_used_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's entry point, given its argument types; STRATA_DRIVER_COPIES=0 leaves copies to torch."""

    class Driver:
        cuMemcpyHtoDAsync_v2 = type("Function", (), {})()

    monkeypatch.setattr("torch.cuda._utils._get_gpu_runtime_library", lambda: Driver)
    found = host_copies._driver_copy()
    assert found is Driver.cuMemcpyHtoDAsync_v2 and len(found.argtypes) == 4
    monkeypatch.setenv("STRATA_DRIVER_COPIES", "0")
    assert host_copies._driver_copy() is None
