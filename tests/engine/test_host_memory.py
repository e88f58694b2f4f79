"""The heap trimmer: glibc's malloc_trim, at most once every TRIM_EVERY_S seconds; parking calls it when it
evicts conversations from RAM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import complete, make_core, random_prompt

from app.engine import host_memory
from app.engine.host_memory import TRIM_EVERY_S, HeapTrimmer
from app.engine.paged_state import kv_block_bytes, slot_state_bytes


def test_trims_at_most_once_a_period(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(host_memory.time, "monotonic", lambda: now[0])
    trimmer = HeapTrimmer()
    calls: list[int] = []
    trimmer._trim = calls.append
    trimmer.after_frees()
    trimmer.after_frees()
    now[0] += TRIM_EVERY_S
    trimmer.after_frees()
    assert calls == [0, 0]


def test_the_c_library_has_malloc_trim_here() -> None:
    assert HeapTrimmer()._trim is not None  # glibc: CI and the supported Linux machines


def test_evicting_parked_conversations_trims_the_heap(checkpoint: Path) -> None:
    config = make_core(checkpoint).loaded.model.config
    budget = 6 * kv_block_bytes(config, 16, torch.float32) + 2 * slot_state_bytes(config, torch.float32)
    core = make_core(checkpoint, park_memory=budget)
    for seed in range(4):
        complete(core, random_prompt(60, seed), max_tokens=3, temperature=0, ignore_eos=True)
    assert core.park is not None and core.park._heap.trims == 1  # evictions came within one period
