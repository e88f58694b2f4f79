"""How a budget of experts on the device is laid over the MoE layers: spread alike, or in whole layers."""

from __future__ import annotations

import pytest

from app.models.placement import layer_residency


def test_spread_gives_every_layer_the_same_share() -> None:
    assert layer_residency(96 * 24, 24, 128, "spread") == [96] * 24
    assert layer_residency(10, 4, 8, "spread") == [2] * 4  # what does not divide evenly stays in host RAM


def test_layers_fills_whole_layers_then_one_in_part_and_leaves_the_rest_in_host_ram() -> None:
    assert layer_residency(96 * 24, 24, 128, "layers") == [128] * 18 + [0] * 6
    assert layer_residency(21, 4, 8, "layers") == [8, 8, 5, 0]
    assert layer_residency(0, 3, 8, "layers") == [0, 0, 0]
    assert layer_residency(100, 3, 8, "layers") == [8, 8, 8]  # more than the model holds: every expert


def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="spread, layers"):
        layer_residency(8, 2, 8, "rows")
