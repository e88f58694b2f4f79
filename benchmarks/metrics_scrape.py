"""The time of one `/metrics` scrape with a Qwen3-Next-sized expert grid (48 MoE layers of 512 experts).

    python benchmarks/metrics_scrape.py

A `ServerMetrics` fed 20 windows, each with an expert report of random routing over the grid (half of every
layer's experts on the device) and a system sample with 8 cards, then the Prometheus text rendered 20 times:
milliseconds per scrape, without and with `--metrics-per-expert`, and how many samples each has. A scrape
runs on the server's event loop, so this is how long it holds it. Prints one JSON line.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.protocol import ExpertUsage, Ready, SlotStats, WindowStats
from webui.metrics import ServerMetrics

LAYERS, EXPERTS, SCRAPES = 48, 512, 20
READY = Ready(
    model="qnext",
    model_path="/models/qnext",
    max_model_len=262144,
    vocab_size=151936,
    parallel=16,
    kv_blocks_total=4096,
    block_size=16,
    eos_token_ids=[],
    backends="triton",
    device="cuda",
)


class Sampled:
    """A system sample as the sampler keeps it."""

    def __init__(self) -> None:
        card = {
            "name": "NVIDIA H200", "utilization": 95, "memory_used": 100 << 30, "memory_total": 141 << 30,
            "power_w": 650.0, "power_limit_w": 700.0, "temperature_c": 60,
        }  # fmt: skip
        host = {"cpu_percent": 40.0, "cpu_count": 16, "ram_used": 60 << 30, "ram_total": 125 << 30}
        self.latest = {
            "host": {**host, "server_rss": 1 << 30, "engine_rss": 40 << 30},
            "gpus": {"cards": [{**card, "index": i} for i in range(8)]},
        }


def fed(per_expert: bool) -> ServerMetrics:
    generator = random.Random(0)
    metrics = ServerMetrics("qnext", READY, per_expert=per_expert)
    metrics.system = Sampled()  # type: ignore[assignment]
    location = [[0] * (EXPERTS // 2) + [1] * (EXPERTS // 2) for _ in range(LAYERS)]
    for window in range(20):
        usage = ExpertUsage(
            layers=list(range(LAYERS)),
            routed=[[generator.randrange(8) for _ in range(EXPERTS)] for _ in range(LAYERS)],
            location=location,
            seconds=0.5,
            served=[[100, 20, 30] for _ in range(LAYERS)],
        )
        slots = [SlotStats(i, f"r{i}", "decode", 10, 10, 5, 15, 1) for i in range(16)]
        metrics.on_window(
            WindowStats(window, time.time(), 0.01, 16, 0, 16, slots, 0, 100, 4096, experts=usage)
        )
    return metrics


def main() -> None:
    line: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "experts": EXPERTS}
    for per_expert in (False, True):
        metrics = fed(per_expert)
        text = generate_latest(metrics.registry)
        began = time.perf_counter()
        for _ in range(SCRAPES):
            generate_latest(metrics.registry)
        key = "per_expert" if per_expert else "default"
        line[f"{key}_ms"] = round((time.perf_counter() - began) / SCRAPES * 1000, 2)
        line[f"{key}_samples"] = sum(
            1 for row in text.decode().splitlines() if row and not row.startswith("#")
        )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
