"""The scheduler alone (no torch): slots, queue, window budget, decode share, KV blocks, preemption."""

from __future__ import annotations

import sys
from pathlib import Path

from app.engine.protocol import SamplingParams
from app.engine.scheduler import Phase, Request, Scheduler, SchedulerConfig, Window
from app.engine.window_cost import WindowCost


def _scheduler(**overrides: object) -> Scheduler:
    settings = {"parallel": 4, "max_batched_tokens": 512, "block_size": 16, "kv_blocks": 1024, **overrides}
    return Scheduler(SchedulerConfig(**settings))


def _request(name: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def _run(scheduler: Scheduler, seconds: float = 0.01) -> Window:
    """Plan a window, account for it, and give every sampling chunk a token."""
    window = scheduler.schedule()
    scheduler.advance(window, seconds)
    for chunk in window.chunks:
        if chunk.samples:
            scheduler.append_token(chunk.request, 7)
    return window


def test_scheduler_imports_no_torch() -> None:
    assert "app.engine.scheduler" in sys.modules
    source = Path(sys.modules["app.engine.scheduler"].__file__).read_text()
    assert "import torch" not in source


def test_requests_beyond_the_slots_wait_in_fifo_order() -> None:
    scheduler = _scheduler(parallel=2)
    for name in "abc":
        scheduler.add(_request(name, 10))
    window = _run(scheduler)
    assert [c.request.request_id for c in window.chunks] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.requests["a"], "stop")
    window = _run(scheduler)
    assert [c.request.request_id for c in window.chunks] == ["b", "c"]
    assert window.chunks[0].decode and not window.chunks[1].decode


def test_decode_rows_come_first_then_prompt_chunks_within_the_budget() -> None:
    scheduler = _scheduler(max_batched_tokens=100)
    scheduler.add(_request("a", 5))
    _run(scheduler)
    scheduler.add(_request("b", 300))
    window = _run(scheduler)
    assert [(c.request.request_id, len(c.tokens)) for c in window.chunks] == [("a", 1), ("b", 99)]
    assert not window.chunks[1].samples  # a partial prompt chunk yields no token


def test_four_prompts_arriving_together_share_windows() -> None:
    scheduler = _scheduler(max_batched_tokens=512)
    for name in "abcd":
        scheduler.add(_request(name, 300))
    first, second = _run(scheduler), _run(scheduler)
    assert [(c.request.request_id, len(c.tokens)) for c in first.chunks] == [("a", 300), ("b", 212)]
    # "a" now decodes; until window costs are known, prompt chunks beside it take at most 256 tokens.
    assert [(c.request.request_id, len(c.tokens)) for c in second.chunks] == [("a", 1), ("b", 88), ("c", 168)]


def test_a_decoding_slot_gets_a_row_in_every_window_while_a_long_prompt_is_read() -> None:
    scheduler = _scheduler(max_batched_tokens=256)
    scheduler.add(_request("a", 8, max_tokens=1000))
    _run(scheduler)
    scheduler.add(_request("long", 2000))
    windows = []
    while scheduler.requests["long"].phase is not Phase.DECODE:
        windows.append(_run(scheduler))
    assert len(windows) > 4
    assert all(w.chunks[0].request.request_id == "a" and w.chunks[0].decode for w in windows)
    assert sum(len(c.tokens) for w in windows for c in w.chunks if c.request.request_id == "long") == 2000


def test_window_cost_recovers_fixed_per_row_and_per_sequence_costs() -> None:
    cost = WindowCost()
    assert not cost.calibrated
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        cost.observe(rows, sequences, 0.010 + 0.0001 * rows + 0.001 * sequences)
    assert cost.calibrated
    assert abs(cost.predict(300, 4) - (0.010 + 0.030 + 0.004)) < 1e-9
    assert cost.rows_within(0.0111) == 100  # one more sequence (1 ms) and 100 rows (10 ms)


def test_decode_share_limits_prompt_chunks_once_window_cost_is_known() -> None:
    scheduler = _scheduler(max_batched_tokens=4096, decode_share=0.5)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, 0.010 + 0.0001 * rows + 0.001 * sequences)
    scheduler.add(_request("a", 4, max_tokens=1000))
    _run(scheduler)
    scheduler.add(_request("long", 3000))
    scheduler.add(_request("next", 3000))
    window = scheduler.schedule()
    # A decode-only window takes 11.1 ms; at share 0.5 the window may take 22.2 ms: one prompt sequence (1 ms)
    # and ~100 rows (0.1 ms each); no room is left for a second prompt sequence.
    prompt = [(c.request.request_id, len(c.tokens)) for c in window.chunks if not c.decode]
    assert len(prompt) == 1 and prompt[0][0] == "long" and 95 <= prompt[0][1] <= 105


def test_pool_exhaustion_preempts_the_newest_request_which_is_read_again_later() -> None:
    scheduler = _scheduler(parallel=2, block_size=4, kv_blocks=6, max_batched_tokens=64)
    scheduler.add(_request("old", 8))
    scheduler.add(_request("new", 8))
    _run(scheduler)  # both prompts read; each holds 3 blocks (12 tokens)
    for _ in range(5):  # the fifth decode row of "old" needs a fourth block
        _run(scheduler)
    old, new = scheduler.requests["old"], scheduler.requests["new"]
    assert new.phase is Phase.WAITING and new.computed == 0 and new.slot is None and not new.blocks
    assert old.phase is Phase.DECODE
    generated = len(new.output)
    scheduler.finish(old, "stop")
    window = _run(scheduler)
    assert window.chunks[0].request is new and window.chunks[0].fresh
    assert window.chunks[0].tokens == new.prompt + new.output[:generated]


def test_finish_frees_slot_and_blocks() -> None:
    scheduler = _scheduler(parallel=1)
    scheduler.add(_request("a", 40))
    _run(scheduler)
    assert scheduler.pool.used == 3 and not scheduler.free_slots
    scheduler.finish(scheduler.requests["a"], "abort")
    assert scheduler.pool.used == 0 and scheduler.free_slots == [0] and not scheduler.has_work()
