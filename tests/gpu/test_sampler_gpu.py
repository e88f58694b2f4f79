"""Sampling on the GPU: drawing a greedy window's tokens never waits for the device, and no window's draw
synchronises once per row."""

from __future__ import annotations

import warnings

import pytest
import torch

from app.engine.protocol import SamplingParams
from app.engine.sampler import RowSampling, Sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _syncs(sampler: Sampler, logits: torch.Tensor, rows: list[RowSampling]) -> int:
    """How many synchronising CUDA calls drawing tokens and queueing their copy to the host make (torch's
    sync debug mode); reading them back waits on an event, after the host has planned the next window."""
    sampler(logits, rows)  # warm-up: generators, caches
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sampler.sample(logits, rows).to_host()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def _rows(count: int, **params: object) -> list[RowSampling]:
    return [RowSampling(SamplingParams(**params), i, [1, 2], []) for i in range(count)]


@pytest.mark.parametrize(
    "params", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"]
)
def test_synchronisations_do_not_grow_with_the_rows(params: dict) -> None:
    sampler = Sampler(0)
    few = _syncs(sampler, torch.randn(2, 4096, device="cuda"), _rows(2, **params))
    many = _syncs(sampler, torch.randn(16, 4096, device="cuda"), _rows(16, **params))
    assert few == many


def test_drawing_a_greedy_window_never_waits_for_the_device() -> None:
    assert _syncs(Sampler(0), torch.randn(16, 4096, device="cuda"), _rows(16, temperature=0)) == 0
