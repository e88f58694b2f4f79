"""The Monitor's feed: one JSON frame built from the metrics snapshot, expert usage, host and GPU figures.

Slot states, queue, KV usage and the aggregate tok/s come from `ServerMetrics.snapshot()` (the same values
as `/metrics`); a slot's own tok/s from its request's token times in the engine link; the expert grid from
the engine's `ExpertUsage` reports; the host, the processes and the GPUs from the system sampler that
`/metrics` reads too (webui/system.py). Frames are built at most every `FRAME_S` and shared by every viewer.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from webui.engine_link import EngineLink
from webui.metrics import ServerMetrics
from webui.system import SystemSampler

FRAME_S = 0.1  # a frame younger than this is reused
HISTORY_S = 300.0  # the tok/s chart spans this many seconds
HISTORY_STEP_S = 1.0  # one chart point per this many seconds
SLOT_RATE_S = 3.0  # a slot's tok/s counts the tokens of this many seconds


def stage_shares(
    before: list[dict[str, Any]], now: list[dict[str, Any]], seconds: float
) -> list[dict[str, Any]]:
    """The share of `seconds` each stage of a layer split spent busy and waiting, from two readings of its
    totals (`ServerMetrics.values()["stages"]`); a stage first seen counts from zero."""
    shares = []
    for stage in now:
        old = before[stage["stage"]] if stage["stage"] < len(before) else {}
        busy = stage["busy_seconds_total"] - old.get("busy_seconds_total", 0.0)
        wait = stage["wait_seconds_total"] - old.get("wait_seconds_total", 0.0)
        shares.append(
            {
                "stage": stage["stage"],
                "busy_share": min(1.0, busy / seconds) if seconds > 0 else 0.0,
                "wait_share": min(1.0, wait / seconds) if seconds > 0 else 0.0,
            }
        )
    return shares


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
        self._stage_totals: tuple[float, list[dict[str, Any]]] = (time.monotonic(), [])
        self.link = link
        self.metrics = metrics
        self.heat = metrics.heat
        self.history: deque[tuple[float, float]] = deque()
        self.system = system
        self._cache = _Cache()
        self._lock = asyncio.Lock()

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
            "stages": self._stage_shares(metrics["stages"]),
        }

    def _stage_shares(self, stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stage of a layer split: its busy and waiting shares since the frame before."""
        now = time.monotonic()
        before, self._stage_totals = self._stage_totals, (now, stages)
        return stage_shares(before[1], stages, now - before[0])
