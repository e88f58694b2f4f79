"""Expert heat: where each routed expert lives and its share of its layer's recent routing, from the engine's
expert reports; read by the Monitor's residency grid and by `/metrics` alike."""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from typing import Any

from app.engine.protocol import ExpertUsage, WindowStats

HEAT_SPAN_S = 10.0  # expert heat sums the routing reports of this many seconds


class ExpertHeat:
    """Where each expert lives and its share of its layer's recent routing, from the engine's reports.

    The routed counts of the reports of the last HEAT_SPAN_S seconds are kept summed (added as reports
    arrive, taken off as they age out), and the grid is rendered once per change. A lock keeps the sums
    whole for a `/metrics` scrape rendered in a worker thread.
    """

    def __init__(self) -> None:
        self.reports: deque[tuple[float, ExpertUsage]] = deque()
        self.latest: ExpertUsage | None = None
        self.totals: list[list[int]] = []
        self.received = 0
        self._grid: tuple[tuple[int, int], dict[str, Any] | None] = ((0, 0), None)
        self._lock = threading.RLock()

    def on_window(self, stats: WindowStats) -> None:
        """Add a window's expert report (windows without one change nothing)."""
        usage = stats.experts
        if usage is None:
            return
        with self._lock:
            self._add_report(usage)

    def _add_report(self, usage: ExpertUsage) -> None:
        if self.latest is None or _shape(usage.routed) != _shape(self.latest.routed):
            self.reports.clear()
            self.totals = [[0] * len(row) for row in usage.routed]
        self.latest = usage
        now = time.monotonic()
        self.reports.append((now, usage))
        _add(self.totals, usage.routed, 1)
        self.received += 1
        self._age_out(now)  # also when nothing reads the heat: the reports stay within the span

    def _age_out(self, now: float) -> None:
        while self.reports and self.reports[0][0] < now - HEAT_SPAN_S:
            _add(self.totals, self.reports.popleft()[1].routed, -1)

    def version(self) -> tuple[int, int]:
        """Changes whenever the grid does: a report arrives or an old one leaves the span."""
        with self._lock:
            self._age_out(time.monotonic())
            return self.received, len(self.reports)

    def shares(self) -> list[list[float]]:
        """Each expert's share of its layer's routing over the span (a layer routed nothing: all 0)."""
        with self._lock:
            self.version()
            return [
                [count / total for count in row] if (total := sum(row)) else [0.0] * len(row)
                for row in self.totals
            ]

    def snapshot(self) -> tuple[ExpertUsage | None, list[list[float]]]:
        """The latest report and the shares, taken together."""
        with self._lock:
            return self.latest, self.shares()

    def grid(self) -> dict[str, Any] | None:
        """The grid as JSON, or None before the first report.

        `location` holds one base64 string per layer, one byte per expert (0 GPU, 1 RAM); `heat` the same
        with bytes 0..255, the expert's share of its layer's routing scaled so the hottest cell is 255;
        `max_share` that hottest share.
        """
        version = self.version()
        if self._grid[0] == version or self.latest is None:
            return self._grid[1]
        shares = self.shares()
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
