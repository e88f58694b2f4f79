"""The Monitor's feed: one JSON frame built from the metrics snapshot, expert usage, host and GPU figures.

Slot states, queue, KV usage and the aggregate tok/s come from `ServerMetrics.snapshot()` (the same values
as `/metrics`); a slot's own tok/s from its request's token times in the engine link; the expert grid from
the engine's `ExpertUsage` reports; the host, the processes and the GPUs from the system sampler that
`/metrics` reads too (webui/system.py). Frames are built at most every `FRAME_S` and shared by every viewer.
"""

from __future__ import annotations

import asyncio
import base64
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from app.engine.protocol import ExpertUsage, WindowStats
from webui.engine_link import EngineLink
from webui.metrics import ServerMetrics
from webui.system import SystemSampler

FRAME_S = 0.1  # a frame younger than this is reused
HISTORY_S = 300.0  # the tok/s chart spans this many seconds
HISTORY_STEP_S = 1.0  # one chart point per this many seconds
HEAT_SPAN_S = 10.0  # expert heat sums the routing reports of this many seconds
SLOT_RATE_S = 3.0  # a slot's tok/s counts the tokens of this many seconds


def slot_tok_s(token_times: list[float], now: float) -> float:
    """Tokens per second of one request over the last SLOT_RATE_S seconds.

    Counts the tokens after the span's start, or after the request's first token when that came later.
    """
    if not token_times:
        return 0.0
    start = max(now - SLOT_RATE_S, token_times[0])
    span = now - start
    if span < 0.25:
        return 0.0
    return (len(token_times) - bisect_right(token_times, start)) / span


class ExpertHeat:
    """Where each expert lives and its share of its layer's recent routing, from the engine's reports.

    The routed counts of the reports of the last HEAT_SPAN_S seconds are kept summed (added as reports
    arrive, taken off as they age out), and the grid is rendered once per change.
    """

    def __init__(self) -> None:
        self.reports: deque[tuple[float, ExpertUsage]] = deque()
        self.latest: ExpertUsage | None = None
        self.totals: list[list[int]] = []
        self.received = 0
        self._grid: tuple[tuple[int, int], dict[str, Any] | None] = ((0, 0), None)

    def on_window(self, stats: WindowStats) -> None:
        """Add a window's expert report (windows without one change nothing)."""
        usage = stats.experts
        if usage is None:
            return
        if self.latest is None or _shape(usage.routed) != _shape(self.latest.routed):
            self.reports.clear()
            self.totals = [[0] * len(row) for row in usage.routed]
        self.latest = usage
        self.reports.append((time.monotonic(), usage))
        _add(self.totals, usage.routed, 1)
        self.received += 1

    def version(self) -> tuple[int, int]:
        """Changes whenever the grid does: a report arrives or an old one leaves the span."""
        now = time.monotonic()
        while self.reports and self.reports[0][0] < now - HEAT_SPAN_S:
            _add(self.totals, self.reports.popleft()[1].routed, -1)
        return self.received, len(self.reports)

    def grid(self) -> dict[str, Any] | None:
        """The grid as JSON, or None before the first report.

        `location` holds one base64 string per layer, one byte per expert (0 GPU, 1 RAM); `heat` the same
        with bytes 0..255, the expert's share of its layer's routing scaled so the hottest cell is 255;
        `max_share` that hottest share.
        """
        version = self.version()
        if self._grid[0] == version or self.latest is None:
            return self._grid[1]
        shares = [[count / total for count in row] if (total := sum(row)) else row for row in self.totals]
        max_share = max((max(row, default=0) for row in shares), default=0)
        scale = 255 / max_share if max_share else 0
        grid = {
            "layers": self.latest.layers,
            "experts": len(self.totals[0]) if self.totals else 0,
            "location": [_bytes64(row) for row in self.latest.location],
            "heat": [_bytes64([round(share * scale) for share in row]) for row in shares],
            "max_share": max_share,
            "span_s": HEAT_SPAN_S,
        }
        self._grid = (version, grid)
        return grid


def _shape(rows: list[list[int]]) -> list[int]:
    return [len(row) for row in rows]


def _add(totals: list[list[int]], counts: list[list[int]], sign: int) -> None:
    for total, row in zip(totals, counts, strict=True):
        for expert, count in enumerate(row):
            total[expert] += sign * count


def _bytes64(values: list[int]) -> str:
    return base64.b64encode(bytes(values)).decode()


@dataclass
class Viewer:
    """What one Monitor connection has been sent: the chart history once, the expert grid when it changes."""

    sent_history: bool = False
    expert_version: tuple[int, int] | None = None
    chart_point: float = 0.0


@dataclass
class _Cache:
    built: float = -1.0
    frame: dict[str, Any] = field(default_factory=dict)


class MonitorFeed:
    """Builds the Monitor's frames for every viewer of one server."""

    def __init__(self, link: EngineLink, metrics: ServerMetrics, system: SystemSampler) -> None:
        self.link = link
        self.metrics = metrics
        self.heat = ExpertHeat()
        self.history: deque[tuple[float, float]] = deque()
        self.system = system
        self._cache = _Cache()
        self._lock = asyncio.Lock()
        link.client.add_stats_listener(self.heat.on_window)

    async def frame_for(self, viewer: Viewer) -> dict[str, Any]:
        """The current frame, with what this viewer has not seen yet (history, a changed expert grid)."""
        async with self._lock:
            now = time.monotonic()
            await self.system.refresh()
            if now - self._cache.built >= FRAME_S:
                self._cache.frame = self._build()
                self._cache.built = now
        frame = dict(self._cache.frame, **self.system.latest)
        if not viewer.sent_history:
            frame["history"] = list(self.history)
            viewer.sent_history = True
        elif self.history and self.history[-1][0] > viewer.chart_point:
            frame["point"] = self.history[-1]
        if self.history:
            viewer.chart_point = self.history[-1][0]
        version = self.heat.version()
        if version != viewer.expert_version:
            frame["experts"] = self.heat.grid()
            viewer.expert_version = version
        return frame

    def _build(self) -> dict[str, Any]:
        metrics = self.metrics.snapshot()
        wall = time.time()
        for slot in metrics["slots"]:
            record = self.link.running.get(slot["request_id"]) if slot["request_id"] else None
            slot["tok_s"] = slot_tok_s(record.token_times, wall) if record is not None else 0.0
        if not self.history or wall - self.history[-1][0] >= HISTORY_STEP_S:
            self.history.append((wall, metrics["live_tok_s"]))
        while self.history and self.history[0][0] < wall - HISTORY_S:
            self.history.popleft()
        ready = self.link.ready
        return {
            "type": "frame",
            "time": wall,
            "engine": {
                "model": self.link.model_name,
                "device": ready.device,
                "backends": ready.backends,
                "parallel": ready.parallel,
                "max_model_len": ready.max_model_len,
                "dead": self.link.dead,
            },
            "metrics": metrics,
            "history_s": HISTORY_S,
        }
