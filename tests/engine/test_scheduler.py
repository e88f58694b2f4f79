"""The scheduler alone (no torch): slots, queue, window budget, decode share, KV blocks, preemption."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from app.engine.protocol import SamplingParams
from app.engine.scheduler import (
    HOLD_S,
    HOLD_WINDOWS,
    SHARE_MARGIN,
    Phase,
    Request,
    Scheduler,
    SchedulerConfig,
    Window,
    window_pairs,
)
from app.engine.window_cost import DecodeWindowCost, WindowCost, chunk_pairs


def _scheduler(**overrides: object) -> Scheduler:
    settings = {"parallel": 4, "max_batched_tokens": 512, "block_size": 16, "kv_blocks": 1024, **overrides}
    return Scheduler(SchedulerConfig(**settings))


def _request(name: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def _run(scheduler: Scheduler, seconds: float = 0.01) -> Window:
    """Plan a window, account for it, and give every sampling chunk a token."""
    window = scheduler.schedule()
    scheduler.advance(window)
    scheduler.observe(window, seconds)
    for chunk in window.chunks:
        if chunk.samples:
            chunk.request.output.append(7)
    return window


@pytest.mark.parametrize("module", ["app.engine.scheduler", "webui.app"])
def test_the_scheduler_and_the_web_server_load_no_torch(module: str) -> None:
    """Imported alone in a fresh interpreter, neither brings torch in, directly or through what it imports."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


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
    first, second, third, fourth = (_run(scheduler) for _ in range(4))
    assert [(c.request.request_id, len(c.tokens)) for c in first.chunks] == [("a", 300), ("b", 212)]
    # "a" has its first token, and holds its decoding while the others' prompts are read at the full budget.
    assert [(c.request.request_id, len(c.tokens)) for c in second.chunks] == [
        ("b", 88),
        ("c", 300),
        ("d", 124),
    ]
    assert [(c.request.request_id, len(c.tokens)) for c in third.chunks] == [("d", 176)]
    assert [(c.request.request_id, len(c.tokens)) for c in fourth.chunks] == [(name, 1) for name in "abcd"]


def test_a_slot_decoding_before_a_burst_keeps_its_row_while_the_bursts_readers_wait_for_each_other() -> None:
    scheduler = _scheduler(max_batched_tokens=128)
    scheduler.add(_request("a", 8))
    _run(scheduler)
    for name in "bc":
        scheduler.add(_request(name, 200))
    windows = [_run(scheduler) for _ in range(4)]
    rows = [[(c.request.request_id, len(c.tokens)) for c in w.chunks] for w in windows]
    assert rows[:3] == [[("a", 1), ("b", 127)], [("a", 1), ("b", 73), ("c", 54)], [("a", 1), ("c", 127)]]
    assert rows[3] == [("a", 1), ("c", 19)]  # "b" was read two windows ago and waits for "c"
    assert [(c.request.request_id, len(c.tokens)) for c in _run(scheduler).chunks] == [
        ("a", 1),
        ("b", 1),
        ("c", 1),
    ]


def test_a_read_request_waits_for_others_prompts_at_most_hold_s() -> None:
    now = [0.0]
    scheduler = Scheduler(
        SchedulerConfig(parallel=4, max_batched_tokens=64, block_size=16, kv_blocks=1024),
        clock=lambda: now[0],
    )
    scheduler.add(_request("a", 10))
    scheduler.add(_request("b", 1000))
    _run(scheduler)
    assert [c.request.request_id for c in _run(scheduler).chunks] == ["b"]  # "a" holds
    now[0] = HOLD_S
    assert [c.request.request_id for c in _run(scheduler).chunks] == ["a", "b"]


def test_a_read_request_holds_for_two_prompt_windows_where_those_take_longer_than_hold_s() -> None:
    # An expert tier that copies its host experts for every window of prompt rows: 2 s a window, whatever its
    # rows. "a" is read in one such window while "b" waits; it holds until "b" is read in the next (else it
    # would decode beside it, and its decode share would pace the read), but not beyond two windows.
    now = [0.0]
    config = SchedulerConfig(parallel=4, max_batched_tokens=64, block_size=16, kv_blocks=1024)
    scheduler = Scheduler(config, clock=lambda: now[0])
    for rows, sequences in [(16, 1), (64, 2), (40, 3)]:
        scheduler.cost.observe(rows, sequences, 2.0 + 1e-5 * rows)
    assert scheduler.hold_limit() == pytest.approx(HOLD_WINDOWS * (2.0 + 64e-5), rel=1e-3)
    scheduler.add(_request("a", 10))
    scheduler.add(_request("b", 1000))
    _run(scheduler, 2.0)
    now[0] = 2.0  # "a"'s window has run: beyond HOLD_S, within two windows
    assert [c.request.request_id for c in _run(scheduler, 2.0).chunks] == ["b"]
    now[0] = 4.1
    assert [c.request.request_id for c in _run(scheduler, 2.0).chunks] == ["a", "b"]


def test_without_a_decode_share_read_requests_decode_at_once() -> None:
    scheduler = _scheduler(max_batched_tokens=64, decode_share=1.0)
    scheduler.add(_request("a", 10))
    scheduler.add(_request("b", 1000))
    _run(scheduler)
    assert [c.request.request_id for c in _run(scheduler).chunks] == ["a", "b"]


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


def test_window_cost_learns_what_a_chunk_late_in_a_long_prompt_costs() -> None:
    # Attention pairs: a chunk of 100 rows after 10,000 positions attends to 1,005,050 pairs of positions.
    assert chunk_pairs(100, 10_000) == 100 * 10_000 + 5050
    cost = WindowCost()
    true = (0.004, 0.0001, 0.001, 2e-9)
    shapes = [(1, 1, 0), (64, 2, 0), (512, 2, 0), (512, 2, 8000), (2048, 3, 20_000), (256, 5, 50_000)]
    for rows, sequences, past in shapes:
        pairs = chunk_pairs(rows, past)
        cost.observe(rows, sequences, true[0] + true[1] * rows + true[2] * sequences + true[3] * pairs, pairs)
    late = chunk_pairs(1000, 90_000)  # a late chunk's attention costs nearly twice its rows
    assert cost.predict(1001, 2, late) == pytest.approx(0.004 + 0.1001 + 0.002 + 2e-9 * late, rel=1e-6)
    # one more sequence of r rows after 90,000 positions within 0.2 s: 0.001 + 1e-4 r + 2e-9 (90,000 r +
    # r (r + 1) / 2) <= 0.2 holds up to r = 708 (0.19974 s; 709 rows take 0.20002)
    assert cost.rows_within(0.2, past=90_000) == 708
    assert cost.rows_within(0.2) == 1951  # at the start of a prompt


def test_a_fit_whose_fixed_cost_comes_out_negative_is_made_again_without_it() -> None:
    # Windows whose cost grows faster than their rows: a line through them has a fixed cost below 0 s. Taken
    # as 0 s, it would leave the line's steeper slope, pricing the five windows at 1.32 times what they took
    # (a 16-row one at 4.9); made again through the origin (the weighted least-squares slope), at 1.16.
    cost = WindowCost(decay=0.95)
    sizes = [16, 64, 256, 512, 1024]
    seconds = [0.00005 * rows + 2e-7 * rows**2 for rows in sizes]
    for rows, took in zip(sizes, seconds, strict=True):
        cost.observe(rows, 2, took)
    weights = [0.95 ** (len(sizes) - 1 - i) for i in range(len(sizes))]
    slope = sum(w * r * t for w, r, t in zip(weights, sizes, seconds, strict=True)) / sum(
        w * r * r for w, r in zip(weights, sizes, strict=True)
    )
    assert cost.predict(16, 2) == pytest.approx(16 * slope, rel=1e-9)
    assert sum(cost.predict(rows, 2) for rows in sizes) < 1.2 * sum(seconds)


def test_decode_share_limits_prompt_chunks_once_window_cost_is_known() -> None:
    scheduler = _scheduler(max_batched_tokens=4096, decode_share=0.5)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, 0.010 + 0.0001 * rows + 0.001 * sequences)
    scheduler.add(_request("a", 4, max_tokens=1000))
    _run(scheduler)
    scheduler.add(_request("long", 3000))
    scheduler.add(_request("next", 3000))
    window = scheduler.schedule()
    # A decode-only window takes 11.1 ms; planned at share 0.5 * (1 + SHARE_MARGIN) the window may take
    # 19.8 ms: one prompt sequence (1 ms) and ~77 rows (0.1 ms each); no room is left for a second one.
    prompt = [(c.request.request_id, len(c.tokens)) for c in window.chunks if not c.decode]
    rows = (0.0111 / (0.5 * (1 + SHARE_MARGIN)) - 0.0121) / 0.0001
    assert len(prompt) == 1 and prompt[0][0] == "long" and rows - 8 <= prompt[0][1] <= rows


def test_windows_padded_to_graph_buckets_fill_the_largest_bucket_the_share_affords() -> None:
    scheduler = _scheduler(max_batched_tokens=256, decode_share=0.5, window_rows=(32, 64, 128, 256))
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, 0.010 + 0.0001 * rows + 0.001 * sequences)
    scheduler.add(_request("a", 4, max_tokens=1000))
    _run(scheduler)
    scheduler.add(_request("long", 3000))
    window = scheduler.schedule()
    # 22.2 ms afford ~102 rows in two sequences: the window runs as the 64-row bucket, which the chunk fills.
    assert [len(c.tokens) for c in window.chunks] == [1, 63]
    assert scheduler.padded(64) == 64 and scheduler.padded(65) == 128 and scheduler.padded(300) == 300
    assert scheduler.fill(102) == 64 and scheduler.fill(20) == 0


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


def test_decode_window_cost_is_kept_per_row_count() -> None:
    cost = DecodeWindowCost(decay=0.5)
    assert cost.predict(4) is None
    cost.observe(1, 0.002)
    cost.observe(8, 0.004)
    cost.observe(8, 0.006)
    assert cost.predict(8) == 0.005
    assert cost.predict(2) == 0.002 and cost.predict(7) == 0.005  # the nearest row count seen


def _simulate(
    scheduler: Scheduler,
    windows: int,
    eager: WindowCost | Callable[[int, int, int], float],
    replayed_seconds: float,
    overlap: bool = False,
    graphs: bool = True,
) -> list[tuple]:
    """Run windows whose time comes from a model of (rows, sequences, attention pairs): decode-only windows
    take `replayed_seconds` (replaying graphs, unless not `graphs`: a CPU's), others run eagerly.

    With `overlap`, each window is observed only after the next one is planned (as the engine runs them).
    """
    cost = eager.predict if isinstance(eager, WindowCost) else eager
    log: list[tuple] = []
    ran: tuple[Window, float, bool] | None = None
    for _ in range(windows):
        window = scheduler.schedule()
        scheduler.advance(window)
        if ran is not None:
            scheduler.observe(ran[0], ran[1], replayed=ran[2])
            ran = None
        if not window.chunks:
            break
        rows = sum(len(c.tokens) for c in window.chunks)
        decode_only = rows == window.decode_tokens
        pairs = window_pairs(window.chunks, rows)
        seconds = replayed_seconds if decode_only else cost(rows, len(window.chunks), pairs)
        replayed = decode_only and graphs
        if overlap:
            ran = (window, seconds, replayed)
        else:
            scheduler.observe(window, seconds, replayed=replayed)
        for chunk in window.chunks:
            if chunk.samples:
                chunk.request.output.append(7)
        log.append((window.decode_tokens, window.prompt_tokens, seconds))
    return log


def test_expensive_prompt_windows_alternate_with_decode_only_ones_and_keep_the_share() -> None:
    # Eager windows cost 8 ms before their rows; a decode-only window replays a graph in 1 ms. Not even one
    # block fits beside the decode row within the share, so windows decode only until their credit pays for a
    # whole chunk: decoding keeps half its solo speed on average and the prompt is read in full-budget chunks.
    eager = WindowCost()
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        eager.observe(rows, sequences, 0.008 + 0.00001 * rows + 0.0001 * sequences)
    scheduler = _scheduler(max_batched_tokens=512, decode_share=0.5)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, eager.predict(rows, sequences))
    scheduler.add(_request("a", 4, max_tokens=10_000))
    _simulate(scheduler, 3, eager, 0.001)
    scheduler.add(_request("long", 3000))
    log = _simulate(scheduler, 400, eager, 0.001)
    reading = log[: max(i for i, w in enumerate(log) if w[1]) + 1]
    decode_tokens = sum(w[0] for w in reading)
    share = decode_tokens * 0.001 / sum(w[2] for w in reading)
    assert 0.45 <= share <= 0.6
    chunks = [w[1] for w in reading if w[1]]
    assert sum(chunks) == 3000 and all(c == 511 for c in chunks[:-1])
    assert all(w[0] == 1 for w in reading)  # "a" got a token in every window


def test_a_prompt_the_share_keeps_waiting_takes_no_blocks_and_evicts_no_cached_ones() -> None:
    # Eager windows cost 8 ms, a decode-only one replays in 1 ms: with the share at 0.5 windows decode only
    # until their credit pays for a chunk. Meanwhile the long prompt waiting for a slot must not take its
    # blocks: taking and giving them back every window costs the host a pass over its table (6,000 blocks for
    # a 96K-token prompt) and evicts cached blocks of other conversations to make room for nothing.
    scheduler = _scheduler(max_batched_tokens=512, decode_share=0.5, prefix_cache=True, kv_blocks=64)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, 0.008 + 0.00001 * rows + 0.0001 * sequences)
    earlier = _request("earlier", 400, max_tokens=1)
    scheduler.add(earlier)
    _simulate(scheduler, 3, lambda *_: 0.012, 0.001)
    scheduler.finish(earlier, "stop")
    assert len(scheduler.pool.match(earlier.prompt, 400)) == 25
    scheduler.add(_request("a", 4, max_tokens=10_000))
    _simulate(scheduler, 2, lambda *_: 0.012, 0.001)
    long = Request("long", [9] * 700, SamplingParams(max_tokens=100), 0.0)  # 44 blocks; 38 free or cached
    scheduler.add(long)
    window = _run(scheduler, 0.001)
    assert window.prompt_tokens == 0 and [r.request_id for r in scheduler.waiting] == ["long"]
    assert not long.blocks
    assert len(scheduler.pool.match(earlier.prompt, 400)) == 25


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_the_share_holds_when_prompt_windows_cost_more_than_the_fit_predicts(overlap: bool) -> None:
    # Mixture-of-experts windows cost a step, not a line: a few rows already read most experts' weights, so
    # the linear fit misjudges them; what they take beyond it is paid back by the windows after. Overlapped,
    # a window is planned before the one before it has been observed: its charge is taken when planned.
    def true_cost(rows: int, sequences: int, pairs: int = 0) -> float:
        return 0.002 + 0.006 * min(rows, 32) / 32 + 0.00001 * rows

    scheduler = _scheduler(max_batched_tokens=1024, decode_share=0.5, parallel=9, kv_blocks=400)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (1000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, true_cost(rows, sequences))
    scheduler.add(_request("a", 4, max_tokens=10_000))
    _simulate(scheduler, 3, true_cost, 0.002, overlap)
    for i in range(8):
        scheduler.add(_request(f"peer{i}", 512))
    log = _simulate(scheduler, 2000, true_cost, 0.002, overlap)
    reading = log[: max(i for i, w in enumerate(log) if w[1]) + 1]
    share = len(reading) * 0.002 / sum(w[2] for w in reading)  # "a" gets a token in every window
    assert sum(w[1] for w in reading) == 8 * 512
    assert 0.49 <= share <= 0.6


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "cpu"])
def test_the_share_holds_while_a_long_prompts_late_chunks_attend_to_all_of_it(graphs: bool) -> None:
    # A window's attention grows with the positions its chunks follow: the last chunks of a 24K-token prompt
    # cost over four times its first (2 ns a pair). The fit starts from windows at the prompt's start, as
    # calibrated graphs give it; it learns the pairs' cost from the chunks read, and prices each next chunk
    # at its own position, so the decoding slot keeps its share throughout. On a CPU, where decode-only
    # windows run eagerly too, the many of them between two chunks do not wash the chunks out of the fit.
    def true_cost(rows: int, sequences: int, pairs: int) -> float:
        return 0.004 + 0.00001 * rows + 2e-9 * pairs

    scheduler = _scheduler(max_batched_tokens=2048, decode_share=0.5, kv_blocks=4096)
    for rows in (64, 256, 1024, 2048):
        scheduler.cost.observe(rows, 2, true_cost(rows, 2, chunk_pairs(rows, 0)), chunk_pairs(rows, 0))
    scheduler.add(_request("a", 4, max_tokens=100_000))
    _simulate(scheduler, 3, true_cost, 0.002, overlap=True, graphs=graphs)
    scheduler.add(_request("long", 24_000))
    log = _simulate(scheduler, 20_000, true_cost, 0.002, overlap=True, graphs=graphs)
    reading = log[: max(i for i, w in enumerate(log) if w[1]) + 1]
    assert sum(w[1] for w in reading) == 24_000
    share = len(reading) * 0.002 / sum(w[2] for w in reading)  # "a" gets a token in every window
    assert 0.49 <= share <= 0.6


def test_windows_decode_only_while_an_overrun_is_paid_back() -> None:
    # One block beside the decode row is predicted to fit the share (3 ms of 4), but windows with prompt rows
    # take 6 ms (a fit that misjudges small windows, held fixed here): each leaves a debt that the next
    # windows pay back by decoding only, so the share holds.
    scheduler = _scheduler(max_batched_tokens=512, decode_share=0.5)
    for rows, sequences in [(17, 2), (100, 2), (400, 3), (60, 5)]:
        scheduler.cost.observe(rows, sequences, 0.0025 + 0.00002 * rows)
    scheduler.cost.observe = lambda *args: None  # type: ignore[method-assign]
    scheduler.add(_request("a", 4, max_tokens=10_000))
    _simulate(scheduler, 3, lambda *_: 0.006, 0.002)
    scheduler.add(_request("long", 3000))
    log = _simulate(scheduler, 400, lambda *_: 0.006, 0.002, overlap=True)
    reading = log[: max(i for i, w in enumerate(log) if w[1]) + 1]
    assert any(w[1] == 0 for w in reading)  # decode-only windows between the prompt pieces
    assert 0.49 <= len(reading) * 0.002 / sum(w[2] for w in reading) <= 0.6


def test_credit_is_dropped_once_no_prompt_waits() -> None:
    scheduler = _scheduler(decode_share=0.5)
    scheduler.add(_request("a", 4, max_tokens=1000))
    _run(scheduler)
    for _ in range(5):
        _run(scheduler, seconds=0.001)
    assert scheduler.credit == 0.0


def test_prompt_chunks_that_stop_short_end_on_multiples_of_the_alignment() -> None:
    scheduler = _scheduler(max_batched_tokens=100, prompt_align=64)
    scheduler.add(_request("a", 5))
    _run(scheduler)
    scheduler.add(_request("b", 300))
    scheduler.add(_request("c", 90))
    pieces: dict[str, list[tuple[int, int]]] = {"b": [], "c": []}
    while any(scheduler.requests[n].phase is not Phase.DECODE for n in pieces):
        for chunk in _run(scheduler).chunks:
            if not chunk.decode:
                pieces[chunk.request.request_id].append((chunk.past, chunk.past + len(chunk.tokens)))
    assert pieces["b"] == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    assert all(end % 64 == 0 or end == 90 for _, end in pieces["c"]) and pieces["c"][-1][1] == 90


def test_a_budget_below_the_alignment_still_reads_prompts() -> None:
    scheduler = _scheduler(max_batched_tokens=20, prompt_align=64)
    scheduler.add(_request("a", 150))
    window = _run(scheduler)
    assert [(c.past, len(c.tokens)) for c in window.chunks] == [(0, 64)]


def test_a_request_kept_waiting_is_looked_up_in_the_park_once() -> None:
    lookups: list[int] = []

    class Park:
        def ready(self, tokens: list[int], limit: int) -> bool:
            return True

        def find(self, tokens: list[int], limit: int) -> None:
            lookups.append(limit)

    scheduler = _scheduler(parallel=2, kv_blocks=30, prefix_cache=True)
    scheduler.parked = Park()
    scheduler.add(_request("a", 8))
    _run(scheduler)
    scheduler.add(_request("b", 600))  # needs 38 blocks: it waits for "a"'s
    for _ in range(5):
        _run(scheduler)
    assert scheduler.requests["b"].phase is Phase.WAITING and lookups == [599]


def test_a_request_whose_parked_conversation_is_being_read_waits_while_others_run() -> None:
    class Park:
        reads_left = 3

        def ready(self, tokens: list[int], limit: int) -> bool:
            Park.reads_left -= 1
            return Park.reads_left < 0

        def find(self, tokens: list[int], limit: int) -> None:
            return None

    scheduler = _scheduler(parallel=2, prefix_cache=True)
    scheduler.parked = Park()
    scheduler.add(_request("a", 8))
    _run(scheduler)
    scheduler.add(_request("b", 600))
    windows = [_run(scheduler) for _ in range(4)]
    assert [[c.request.request_id for c in w.chunks] for w in windows[:3]] == [["a"], ["a"], ["a"]]
    assert [c.request.request_id for c in windows[3].chunks] == ["a", "b"]


def test_measured_windows_calibrate_the_cost_before_any_window_runs() -> None:
    scheduler = _scheduler(max_batched_tokens=512, decode_share=0.5)
    assert not scheduler.cost.calibrated
    scheduler.calibrate([(32, 0.004), (128, 0.005), (512, 0.009)])
    assert scheduler.cost.calibrated
    assert 0.0035 < scheduler.cost.predict(64, 2) < 0.0055


def test_pipelined_groups_take_turns_and_a_busy_groups_slots_wait() -> None:
    scheduler = _scheduler(groups=2)
    for name in "abcd":
        scheduler.add(_request(name, 20))
    first = scheduler.schedule()
    assert {c.slot % 2 for c in first.chunks} == {0} and len(first.chunks) == 2  # slots 0 and 2
    scheduler.advance(first)
    second = scheduler.schedule(busy=frozenset({0}))
    assert {c.slot % 2 for c in second.chunks} == {1} and len(second.chunks) == 2
    scheduler.advance(second)
    assert not scheduler.schedule(busy=frozenset({0, 1})).chunks  # both groups still run
    for chunk in [*first.chunks, *second.chunks]:
        chunk.request.output.append(7)
    third = scheduler.schedule(busy=frozenset({1}))
    assert [c.request for c in third.chunks] == [c.request for c in first.chunks]
    assert all(c.decode for c in third.chunks)


def test_a_groups_prompt_windows_spend_the_credit_of_the_slot_they_hold_up_and_keep_the_share() -> None:
    # Two slot groups: "a" decodes in one (1 ms a window alone) while a long prompt is read in the other.
    # Each of the reader's windows holds up "a"'s next one in the stages, so what that one takes (from the
    # tokens before it to its own) carries half the reader's window. The reader's windows are charged to
    # "a"'s credit, and "a"'s windows beside the read do not teach its solo cost: "a" keeps about half its
    # speed. (The reader's group plans empty windows while it saves credit: they take no time.)
    eager = WindowCost()
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        eager.observe(rows, sequences, 0.008 + 0.00001 * rows + 0.0001 * sequences)
    scheduler = _scheduler(max_batched_tokens=512, decode_share=0.5, groups=2, parallel=2)
    for rows, sequences in [(1, 1), (100, 1), (400, 2), (2000, 3), (50, 5), (8, 8)]:
        scheduler.cost.observe(rows, sequences, eager.predict(rows, sequences))
    decoding, reading = _request("a", 4, max_tokens=10_000), _request("long", 3000)
    scheduler.add(decoding)
    log: list[tuple[int, int, float]] = []
    held = 0.0  # what the next window of "a" carries of the reader's window before it
    for index in range(2000):
        if index == 40:  # "a"'s solo cost learnt
            scheduler.add(reading)
            start = len(log)
        window = scheduler.schedule()
        scheduler.advance(window)
        if not window.chunks:
            continue
        if window.prompt_tokens and not window.decode_tokens:
            whole = eager.predict(window.prompt_tokens, len(window.chunks))
            seconds, held = whole / 2, whole / 2
        else:
            seconds, held = 0.001 * window.decode_tokens + held, 0.0
        scheduler.observe(window, seconds)
        for chunk in window.chunks:
            if chunk.samples:
                chunk.request.output.append(7)
        log.append((window.decode_tokens, window.prompt_tokens, seconds))
        if index > 40 and reading.phase is not Phase.PROMPT and not scheduler.waiting:
            break
    assert scheduler.group_of(decoding.slot) != scheduler.group_of(reading.slot)
    read = log[start:]
    assert sum(w[1] for w in read) == 3000
    share = sum(w[0] for w in read) * 0.001 / sum(w[2] for w in read)
    assert 0.45 <= share <= 0.65
    assert scheduler.solo_seconds(1) == pytest.approx(0.001, rel=0.01)


class _Guesses:
    """A draft source that always guesses the same tokens."""

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return [1, 2, 3][:k]


def test_a_wrong_guess_restores_the_state_after_the_last_accepted_row_and_reads_nothing_again() -> None:
    # Two batch slots, three draft slots each (slot 1's after slot 0's): the state after the newest token
    # and j guesses goes to draft slot j.
    scheduler = _scheduler(parallel=2, recurrent=True, spec_tokens=3, draft_slots=(10, 11, 12, 13, 14, 15))
    request = _request("a", 5)
    scheduler.add(request)
    _run(scheduler)
    request.drafter = _Guesses()  # type: ignore[assignment]
    window = _run(scheduler)
    [chunk] = window.chunks
    assert chunk.tokens == [7, 1, 2, 3] and chunk.step_saves == (10, 11, 12)
    scheduler.accept(chunk, 1)  # the first guess right, the second wrong
    request.output[-1:] = [1, 9]  # the guess accepted and the token drawn at the miss
    assert request.computed == 7 and scheduler.state_slot(request) == 11
    window = _run(scheduler)
    assert window.restores == [(11, 0)]  # draft slot 1 into the request's slot, before the window
    assert window.chunks[0].tokens[0] == 9 and window.chunks[0].past == 7  # only the token drawn at the miss
    assert scheduler.state_slot(request) == 0
