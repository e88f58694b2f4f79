"""The Monitor's feed: one JSON frame built from the metrics snapshot, expert usage, host and GPU figures.

Slot states, queue, KV usage and the aggregate tok/s come from `ServerMetrics.snapshot()` (the same values
as `/metrics`); a slot's own tok/s from its request's token times in the engine link; the expert grid from
the engine's `ExpertUsage` reports; the host from psutil and the GPUs from NVML. Frames are built at most
every `FRAME_S` and shared by every viewer.
"""

from __future__ import annotations

import asyncio
import base64
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil

from app.engine.protocol import ExpertUsage, WindowStats
from webui.engine_link import EngineLink
from webui.metrics import ServerMetrics

FRAME_S = 0.1  # a frame younger than this is reused
SYSTEM_S = 1.0  # host and GPU figures are sampled at most this often
HISTORY_S = 300.0  # the tok/s chart spans this many seconds
HISTORY_STEP_S = 1.0  # one chart point per this many seconds
HEAT_SPAN_S = 10.0  # expert heat sums the routing reports of this many seconds
SLOT_RATE_S = 3.0  # a slot's tok/s counts the tokens of this many seconds
NO_GPU = "No NVIDIA GPU found"


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


class SystemProbe:
    """Host CPU and RAM (psutil) and every NVIDIA card's utilisation, memory and power (NVML)."""

    def __init__(self, engine_pid: int | None) -> None:
        self.engine = _process(engine_pid)
        self.nvml: Any = None
        self.gpu_detail = ""
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                self.nvml = pynvml
        except Exception as exc:  # no driver, no device, no permission: all mean no GPU figures
            self.gpu_detail = str(exc)

    def sample(self) -> dict[str, Any]:
        """The host and GPU figures now (blocking: call it in a thread)."""
        memory = psutil.virtual_memory()
        host = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "cpu_count": psutil.cpu_count() or 0,
            "ram_used": memory.total - memory.available,
            "ram_total": memory.total,
            "engine_rss": None,
        }
        if self.engine is not None:
            try:
                host["engine_rss"] = self.engine.memory_info().rss
            except psutil.Error:
                self.engine = None
        if self.nvml is None:
            return {"host": host, "gpus": {"message": NO_GPU, "detail": self.gpu_detail, "cards": []}}
        return {"host": host, "gpus": {"message": "", "detail": "", "cards": self._cards()}}

    def _cards(self) -> list[dict[str, Any]]:
        nvml = self.nvml
        cards = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = _nvml(nvml.nvmlDeviceGetMemoryInfo, handle)
            utilization = _nvml(nvml.nvmlDeviceGetUtilizationRates, handle)
            power = _nvml(nvml.nvmlDeviceGetPowerUsage, handle)
            limit = _nvml(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            name = _nvml(nvml.nvmlDeviceGetName, handle)
            cards.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "utilization": utilization.gpu if utilization is not None else None,
                    "memory_used": memory.used if memory is not None else None,
                    "memory_total": memory.total if memory is not None else None,
                    "power_w": power / 1000 if power is not None else None,
                    "power_limit_w": limit / 1000 if limit is not None else None,
                    "temperature_c": _nvml(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                }
            )
        return cards


def _process(pid: int | None) -> psutil.Process | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _nvml(query: Any, *args: Any) -> Any:
    """One NVML query, or None where the card does not support it."""
    try:
        return query(*args)
    except Exception:
        return None


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
    system: dict[str, Any] = field(default_factory=dict)
    system_at: float = -1.0


class MonitorFeed:
    """Builds the Monitor's frames for every viewer of one server."""

    def __init__(self, link: EngineLink, metrics: ServerMetrics) -> None:
        self.link = link
        self.metrics = metrics
        self.heat = ExpertHeat()
        self.history: deque[tuple[float, float]] = deque()
        self.probe = SystemProbe(getattr(link.client, "pid", None))
        self._cache = _Cache()
        self._lock = asyncio.Lock()
        link.client.add_stats_listener(self.heat.on_window)

    async def frame_for(self, viewer: Viewer) -> dict[str, Any]:
        """The current frame, with what this viewer has not seen yet (history, a changed expert grid)."""
        async with self._lock:
            now = time.monotonic()
            if now - self._cache.system_at >= SYSTEM_S:
                self._cache.system = await asyncio.to_thread(self.probe.sample)
                self._cache.system_at = now
            if now - self._cache.built >= FRAME_S:
                self._cache.frame = self._build()
                self._cache.built = now
        frame = dict(self._cache.frame, **self._cache.system)
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
