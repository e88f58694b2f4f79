"""The Monitor feed's own figures: expert heat from routing reports and a slot's tok/s."""

from __future__ import annotations

import base64

import pytest

from app.engine.protocol import ExpertUsage, WindowStats
from webui import monitor
from webui.experts import HEAT_SPAN_S, ExpertHeat
from webui.monitor import slot_tok_s, stage_shares


def _stats(routed: list[list[int]] | None, location: list[list[int]] | None = None) -> WindowStats:
    experts = None
    if routed is not None:
        where = location or [[0] * len(row) for row in routed]
        layers = list(range(1, len(routed) + 1))
        experts = ExpertUsage(layers=layers, routed=routed, location=where, seconds=0.5)
    return WindowStats(
        window=1,
        started=0.0,
        duration_s=0.1,
        rows=1,
        prompt_tokens=0,
        decode_tokens=1,
        slots=[],
        waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=8,
        experts=experts,
    )


def _bytes(text: str) -> list[int]:
    return list(base64.b64decode(text))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    return now


def test_heat_sums_recent_reports_per_layer(clock: list[float]) -> None:
    heat = ExpertHeat()
    assert heat.grid() is None
    heat.on_window(_stats(None))
    assert heat.grid() is None
    heat.on_window(_stats([[3, 1, 0, 0], [0, 0, 2, 2]], location=[[0, 0, 1, 1], [1, 1, 1, 0]]))
    heat.on_window(_stats([[1, 1, 0, 0], [0, 0, 0, 0]]))
    grid = heat.grid()
    assert grid["layers"] == [1, 2] and grid["experts"] == 4
    assert [_bytes(row) for row in grid["location"]] == [[0, 0, 0, 0], [0, 0, 0, 0]]  # the latest report's
    assert grid["max_share"] == pytest.approx(4 / 6)  # layer 1: 4 of its 6 picks went to expert 0
    assert [_bytes(row) for row in grid["heat"]] == [[255, 128, 0, 0], [0, 0, 191, 191]]


def test_heat_forgets_old_reports(clock: list[float]) -> None:
    heat = ExpertHeat()
    heat.on_window(_stats([[4, 0]]))
    clock[0] += HEAT_SPAN_S / 2
    heat.on_window(_stats([[0, 4]]))
    first = heat.version()
    assert _bytes(heat.grid()["heat"][0]) == [255, 255]
    clock[0] += HEAT_SPAN_S / 2 + 0.1
    assert heat.version() != first
    assert _bytes(heat.grid()["heat"][0]) == [0, 255]
    clock[0] += HEAT_SPAN_S
    grid = heat.grid()
    assert grid["max_share"] == 0 and _bytes(grid["heat"][0]) == [0, 0]
    assert grid is heat.grid()  # rendered once per change


def test_heat_keeps_only_the_span_when_nothing_reads_it(clock: list[float]) -> None:
    """A server without a Monitor or scrape still receives a report every few windows: it keeps the span's."""
    heat = ExpertHeat()
    for _ in range(1000):
        heat.on_window(_stats([[1, 0]]))
        clock[0] += HEAT_SPAN_S / 100
    assert len(heat.reports) <= 101 and heat.totals == [[len(heat.reports), 0]]


def test_slot_tok_s_counts_the_last_seconds() -> None:
    assert slot_tok_s([], 10.0) == 0.0
    assert slot_tok_s([10.0], 10.1) == 0.0  # too short a span to say
    assert slot_tok_s([10.0, 10.5, 11.0], 11.0) == pytest.approx(2.0)  # 2 tokens after the first in 1 s
    times = [float(t) for t in range(100)]  # one a second for 100 s
    assert slot_tok_s(times, 99.0) == pytest.approx(1.0)  # the tokens at 97, 98, 99 over the last 3 s


def test_a_stages_shares_are_its_busy_and_waiting_seconds_since_the_frame_before() -> None:
    def totals(*pairs: tuple[float, float]) -> list[dict]:
        return [
            {"stage": i, "busy_seconds_total": busy, "wait_seconds_total": wait}
            for i, (busy, wait) in enumerate(pairs)
        ]

    before, now = totals((1.0, 0.5), (2.0, 0.0)), totals((1.5, 1.0), (2.9, 0.05))
    shares = stage_shares(before, now, 1.0)
    assert [s["busy_share"] for s in shares] == pytest.approx([0.5, 0.9])
    assert [s["wait_share"] for s in shares] == pytest.approx([0.5, 0.05])
    assert stage_shares([], totals((0.25, 0.0)), 0.5)[0]["busy_share"] == 0.5  # first seen: from zero
    assert stage_shares([], [], 1.0) == []  # no split
