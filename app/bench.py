"""`strata bench`: synthetic concurrent requests through the engine process, summarised as one JSON object.

Request 0 starts alone; once it decodes, the other `concurrency - 1` arrive together. The summary has the
aggregate and per-request speed, time to first token and inter-token latency, and how fast request 0 decoded
alone and while its peers' prompts were read (the share `--decode-share` protects).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field

from app.engine.client import EngineClient
from app.engine.config import EngineConfig
from app.engine.protocol import Ready, SamplingParams, WindowStats


@dataclass
class Timeline:
    """Client-side timestamps of one request."""

    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _consume(client: EngineClient, prompt: list[int], params: SamplingParams, timeline: Timeline) -> None:
    timeline.submitted = time.perf_counter()
    for output in client.submit(prompt, params):
        now = time.perf_counter()
        timeline.token_times.extend([now] * len(output.token_ids))


def run_bench(
    config: EngineConfig, concurrency: int, prompt_len: int, output_len: int, seed: int = 0
) -> dict:
    """Start an engine, run the scenario, return the summary."""
    rng = random.Random(seed)
    windows: list[WindowStats] = []
    with EngineClient.start(config) as client:
        vocab = client.ready.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        client.add_stats_listener(windows.append)
        timelines = [Timeline() for _ in range(concurrency)]
        threads = [
            threading.Thread(target=_consume, args=(client, prompts[i], params, timelines[i]))
            for i in range(concurrency)
        ]
        start = time.perf_counter()
        threads[0].start()
        while not timelines[0].token_times and threads[0].is_alive():
            time.sleep(0.001)
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        ready = client.ready
    return _summary(config, ready, concurrency, prompt_len, output_len, timelines, windows, wall)


def _summary(
    config: EngineConfig,
    ready: Ready,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    timelines: list[Timeline],
    windows: list[WindowStats],
    wall: float,
) -> dict:
    ttft = [t.token_times[0] - t.submitted for t in timelines if t.token_times]
    gaps = [b - a for t in timelines for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    per_request = [
        (len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
        for t in timelines
        if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]
    ]
    solo, during_reads = _observer_rates(windows)
    generated = sum(len(t.token_times) for t in timelines)
    return {
        "device": ready.device,
        "model": ready.model,
        "backends": ready.backends,
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "parallel": config.parallel,
        "max_batched_tokens": config.max_batched_tokens,
        "decode_share": config.decode_share,
        "wall_s": round(wall, 4),
        "aggregate_tok_s": round(generated / wall, 2),
        "per_request_tok_s_mean": _round(statistics.fmean(per_request) if per_request else None),
        "per_request_tok_s_min": _round(min(per_request) if per_request else None),
        "ttft_s": [round(x, 4) for x in ttft],
        "ttft_p50_s": _round(percentile(ttft, 0.5)),
        "itl_p50_s": _round(percentile(gaps, 0.5)),
        "itl_p95_s": _round(percentile(gaps, 0.95)),
        "decode_solo_tok_s": _round(solo),
        "decode_during_peer_reads_tok_s": _round(during_reads),
        "windows": len(windows),
    }


def _observer_rates(windows: list[WindowStats]) -> tuple[float | None, float | None]:
    """Request 0's decode speed in windows where it decoded alone, and while peers' prompts were being read.

    The second counts every window from the peers' arrival until their prompts are read, also the windows that
    read none of them (the scheduler may let decoding slots run ahead, then read a large chunk).
    """
    observer = next((s.request_id for w in windows for s in w.slots), None)
    solo_time = read_time = 0.0
    solo_rows = read_rows = 0
    for w in windows:
        decoding = any(s.request_id == observer and s.phase == "decode" for s in w.slots)
        if not decoding or w.decode_tokens == 0:
            continue
        peers_reading = w.waiting > 0 or any(s.phase == "prompt" for s in w.slots)
        if peers_reading or w.prompt_tokens:
            read_time += w.duration_s
            read_rows += 1
        elif len(w.slots) == 1:
            solo_time += w.duration_s
            solo_rows += 1
    return (solo_rows / solo_time if solo_time else None, read_rows / read_time if read_time else None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
