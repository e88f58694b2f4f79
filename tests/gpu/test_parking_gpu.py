"""Parked conversations on the GPU: the park's worker copies them to pinned host memory beside the windows;
a follow-up restored from the device copies, from host RAM, or from a file after a restart continues as one
that never left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.engine.core import EngineCore
from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.loading.checkpoint import CheckpointDir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    return write_checkpoint(path, request.param, max_position_embeddings=4096)


def _core(checkpoint: Path, **overrides: object) -> EngineCore:
    config = CheckpointDir(checkpoint).config
    memory = 80 * kv_block_bytes(config, 16, torch.float32) + 16 * slot_state_bytes(config, torch.float32)
    return make_core(checkpoint, device="cuda", kv_memory=memory, **overrides)


def _follow_up_after_eviction(core: EngineCore, flush: bool) -> tuple[list[int], list[int], int]:
    """A first turn, an unrelated request that reuses its blocks, then the follow-up: its tokens, the
    follow-up prompt and how many prompt tokens came from the park."""
    first = random_prompt(600, 1)
    answer = complete(core, first, **GREEDY).token_ids
    follow_up = [*first, *answer, *random_prompt(20, 2)]
    complete(core, random_prompt(1200, 3), max_tokens=5, temperature=0, ignore_eos=True)
    if flush:
        assert core.park is not None
        core.park.flush()
    add = request(follow_up, **GREEDY)
    results, windows = run(core, [(0, add)])
    return results[add.request_id].token_ids, follow_up, sum(w.prefix_cache_hits for w in windows)


@pytest.mark.parametrize("flush", [False, True], ids=["maybe-still-on-device", "host"])
def test_a_follow_up_restored_from_the_park_continues_as_if_it_never_left(
    checkpoint: Path, flush: bool
) -> None:
    core = _core(checkpoint, park_memory=64 << 20)
    tokens, follow_up, hits = _follow_up_after_eviction(core, flush)
    assert core.park is not None and core.park.stats().restores == 1 and hits > 0
    stayed = make_core(checkpoint, device="cuda", park_memory=0)
    complete(stayed, follow_up[:600], **GREEDY)
    assert tokens == complete(stayed, follow_up, **GREEDY).token_ids


def test_a_follow_up_restored_from_a_file_after_a_restart(checkpoint: Path, tmp_path: Path) -> None:
    park = {"park_dir": str(tmp_path), "park_disk": 64 << 20}
    first = _core(checkpoint, park_memory=64 << 20, **park)
    expected, follow_up, _ = _follow_up_after_eviction(first, flush=True)
    assert first.park is not None
    first.park.flush()
    restarted = _core(checkpoint, park_memory=64 << 20, **park)
    add = request(follow_up, **GREEDY)
    results, _ = run(restarted, [(0, add)])
    assert restarted.park is not None and restarted.park.stats().restores == 1
    assert results[add.request_id].token_ids == expected


def test_parking_within_the_ram_budget_pins_no_memory_beside_the_windows(checkpoint: Path) -> None:
    """The park pins its RAM budget's blocks when it starts: the worker's copies of parked conversations take
    cached pinned memory and never call into the driver to pin more while windows run."""
    core = _core(checkpoint, park_memory=64 << 20)
    assert core.park is not None
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    arrivals = [(i, request(random_prompt(100 + 40 * i, 30 + i), **GREEDY)) for i in range(4)]
    run(core, arrivals)
    core.park.flush()
    assert core.park.stats().conversations_ram == 4
    # 40 full blocks were parked; what was pinned meanwhile is their tails, states and the windows' tokens
    assert torch.cuda.host_memory_stats()["num_host_alloc"] - before < 30


def test_a_resumed_conversation_brings_its_experts_back_on_the_gpu(checkpoint: Path) -> None:
    """An adapting expert tier with parking: decode graphs count routing per slot, the parked turn's counts
    come off the device, and its follow-up makes those experts resident before its first window; the
    follow-up's tokens are those of an engine without a tier."""
    tiered = _core(checkpoint, park_memory=64 << 20, expert_cache=2, adapt_every=1000, dtype="float32")
    assert tiered.runner.graphs is not None and all(t.slot_heat is not None for t in tiered.tiers)
    brought: list[list[int]] = []
    bring_back = tiered._bring_back

    def watched(routed: object) -> None:
        bring_back(routed)
        brought.extend(hot[:2] for hot in routed.hot())  # type: ignore[attr-defined]

    tiered._bring_back = watched  # type: ignore[method-assign]
    tokens, follow_up, _ = _follow_up_after_eviction(tiered, flush=True)
    assert tiered.park is not None and tiered.park.stats().restores == 1
    assert len(brought) == len(tiered.tiers) and all(len(hot) == 2 for hot in brought)
    resident = [{e for e, slot in enumerate(t.slots) if slot >= 0} for t in tiered.tiers]
    assert resident == [set(hot) for hot in brought]  # no adaptation ran: only the follow-up moved them
    plain = make_core(checkpoint, device="cuda", dtype="float32", park_memory=0)
    assert tokens == complete(plain, follow_up, **GREEDY).token_ids
