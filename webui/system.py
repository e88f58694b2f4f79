"""Host, process and NVIDIA card figures, sampled once for the Monitor's frames and `/metrics` alike.

`SystemProbe.sample()` reads psutil (host CPU and RAM, the server's and the engine's resident memory) and
NVML (each card's utilisation, memory, power, power limit and temperature); it blocks, so `SystemSampler`
runs it in a worker thread at most every SYSTEM_S seconds (a background task keeps it fresh) and keeps the
latest sample, which the Monitor sends and the metrics collector renders: a scrape never samples.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psutil

SYSTEM_S = 1.0  # host and GPU figures are sampled at most this often
NO_GPU = "No NVIDIA GPU found"


class SystemProbe:
    """Host CPU and RAM (psutil) and every NVIDIA card's utilisation, memory and power (NVML)."""

    def __init__(self, engine_pid: int | None) -> None:
        self.engine = _process(engine_pid)
        self.server = psutil.Process()
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

    def follow(self, engine_pid: int | None) -> None:
        """Watch this engine process from now on (a new one replaced the last)."""
        self.engine = _process(engine_pid)

    def sample(self) -> dict[str, Any]:
        """The host and GPU figures now (blocking: call it in a thread)."""
        memory = psutil.virtual_memory()
        host = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "cpu_count": psutil.cpu_count() or 0,
            "ram_used": memory.total - memory.available,
            "ram_total": memory.total,
            "server_rss": self.server.memory_info().rss,
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


class SystemSampler:
    """The latest `SystemProbe` sample, taken in a worker thread at most every SYSTEM_S seconds."""

    def __init__(self, probe: SystemProbe) -> None:
        self.probe = probe
        self.latest: dict[str, Any] = {}
        self.sampled_at = -float("inf")
        self._lock = asyncio.Lock()

    async def refresh(self) -> dict[str, Any]:
        """The latest sample, taken anew when it is older than SYSTEM_S."""
        async with self._lock:
            if time.monotonic() - self.sampled_at >= SYSTEM_S:
                self.latest = await asyncio.to_thread(self.probe.sample)
                self.sampled_at = time.monotonic()
        return self.latest

    async def run(self) -> None:
        """Keep the sample fresh (a scrape of `/metrics` reads it without sampling) until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(SYSTEM_S)
