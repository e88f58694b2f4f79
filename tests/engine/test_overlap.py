"""Overlapped windows (the next window planned and queued before the last one's tokens are read) against the
plain loop: the same tokens, text, logprobs and finish reasons, with requests ending in every way."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from engine_helpers import Completion, make_core, random_prompt, request, run

from app.engine.core import EngineCore
from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.engine.protocol import AddRequest
from app.engine.runner import Launched
from app.engine.scheduler import Window


def _feeding_placeholders(core: EngineCore) -> list[int]:
    """Count, per window the core launches, the chunks whose newest token was still on the device."""
    counts: list[int] = []
    launch = core.runner.launch

    def launch_and_count(window: Window) -> Launched:
        counts.append(sum(c.tokens[-1] < 0 for c in window.chunks))
        return launch(window)

    core.runner.launch = launch_and_count  # type: ignore[method-assign]
    return counts


def _clocked(core: EngineCore) -> EngineCore:
    """`core` with each window taken to have lasted 0.6 ms and 0.05 ms a row (about what this tiny model's
    windows take on a quiet CPU): the windows its scheduler plans then follow the requests alone, not how
    busy the machine running the test is."""
    observe = core.scheduler.observe

    def observe_rows(window: Window, seconds: float, replayed: bool = False) -> None:
        observe(window, 6e-4 + 5e-5 * sum(len(c.tokens) for c in window.chunks), replayed)

    core.scheduler.observe = observe_rows  # type: ignore[method-assign]
    return core


def _same(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert a.finish_reason == b.finish_reason
    assert [p.chosen.token_id for p in a.logprobs] == [p.chosen.token_id for p in b.logprobs]
    for x, y in zip(a.logprobs, b.logprobs, strict=True):  # windows batch rows differently: rounding
        assert abs(x.chosen.logprob - y.chosen.logprob) < 1e-4


def test_overlapped_windows_give_the_plain_loops_outputs(checkpoint: Path) -> None:
    """Greedy, seeded, penalised and logprob rows; stop strings, stop tokens and max_tokens; arrivals
    mid-run and a pool so tight that requests are preempted and read again."""
    probe = make_core(checkpoint, overlap=False)
    base = random_prompt(20, 40)
    full = run(probe, [(0, request(base, max_tokens=24, temperature=0, ignore_eos=True))])[0]
    (reference,) = full.values()
    stop_text = reference.text[len(reference.text) // 2 :][:3]
    stop_token = reference.token_ids[9]

    def arrivals() -> list[tuple[int, AddRequest]]:
        return [
            (0, request(base, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop_text])),
            (0, request(base, max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_token])),
            (1, request(random_prompt(50, 41), max_tokens=30, temperature=0.9, seed=3, logprobs=2)),
            (2, request(random_prompt(9, 42), max_tokens=1, temperature=0)),
            (2, request(random_prompt(33, 43), max_tokens=17, temperature=0.7, seed=8, presence_penalty=0.8)),
            (5, request(random_prompt(70, 44), max_tokens=40, temperature=0, ignore_eos=True)),
            (6, request(random_prompt(12, 45), max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)),
        ]

    config = probe.loaded.model.config  # 40 blocks of 4: too few for every request at its longest
    memory = 40 * kv_block_bytes(config, 4, torch.float32) + 12 * slot_state_bytes(config, torch.float32)
    settings = {"kv_memory": memory, "block_size": 4, "parallel": 6, "max_batched_tokens": 48}
    plain_core = _clocked(make_core(checkpoint, overlap=False, **settings))
    plain, _ = run(plain_core, arrivals())
    overlapped_core = _clocked(make_core(checkpoint, **settings))
    fed = _feeding_placeholders(overlapped_core)
    overlapped, windows = run(overlapped_core, arrivals())
    assert sum(w.preempted for w in windows) >= 1
    assert sum(fed) > len(fed) // 2  # most windows fed tokens the host had not read yet
    assert [c.finish_reason for c in plain.values()][:2] == ["stop", "stop"]
    for a, b in zip(plain.values(), overlapped.values(), strict=True):
        _same(a, b)
    for core in (plain_core, overlapped_core):
        assert not core.has_work() and core.scheduler.pool.used == 0 and not core.streams


def test_follow_ups_continue_overlapped_conversations_exactly(checkpoint: Path) -> None:
    """A conversation that ended while a window after its last token ran is parked and cached at what the
    state holds: follow-up turns continue from it with the tokens of a plain loop's follow-ups."""
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    firsts = [random_prompt(40 + 8 * i, 50 + i) for i in range(3)]
    results = {}
    for overlap in (False, True):
        core = make_core(checkpoint, overlap=overlap, park_memory=64 << 20)
        turns, _ = run(core, [(i, request(p, **params)) for i, p in enumerate(firsts)])
        follow = [
            request(p + t.token_ids + random_prompt(6, 60 + i), **params)
            for i, (p, t) in enumerate(zip(firsts, turns.values(), strict=True))
        ]
        again, windows = run(core, [(i, f) for i, f in enumerate(follow)])
        assert sum(w.prefix_cache_hits for w in windows) >= 40 * 3
        results[overlap] = list(turns.values()) + list(again.values())
    for a, b in zip(results[False], results[True], strict=True):
        _same(a, b)


def test_overlapped_windows_on_a_cpu_are_charged_what_they_cost_not_what_the_next_one_did(
    checkpoint: Path,
) -> None:
    """On a CPU a window is computed as it is launched, and overlapped, the step that hands out one window's
    tokens computes the next: each window's rows are learned with its own time (here a launch made to take
    20 ms and 1 ms a row), so a decoding slot keeps its share beside long prompts. Charging a window what
    the next one cost once left a slot at 4% of its speed while three 4K prompts were read."""
    core = make_core(checkpoint, max_batched_tokens=256)
    seen: list[tuple[int, float]] = []
    launch, observe = core.runner.launch, core.scheduler.observe

    def slow_launch(window: Window) -> Launched:
        time.sleep(0.02 + 0.001 * sum(len(c.tokens) for c in window.chunks))
        return launch(window)

    def record(window: Window, seconds: float, replayed: bool = False) -> None:
        seen.append((sum(len(c.tokens) for c in window.chunks), seconds))
        observe(window, seconds, replayed)

    core.runner.launch = slow_launch  # type: ignore[method-assign]
    core.scheduler.observe = record  # type: ignore[method-assign]
    params = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    run(core, [(0, request(random_prompt(10, 1), **params)), (5, request(random_prompt(300, 2), **params))])
    sizes = {rows for rows, _ in seen}
    assert min(sizes) <= 2 and max(sizes) >= 8  # decode windows and prompt windows
    for rows, seconds in seen:  # charged the next window's time, a large window is charged a small one's
        assert 0.02 + 0.001 * rows <= seconds < 0.07 + 0.001 * rows, (rows, seconds)
