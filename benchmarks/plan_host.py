"""Host time of planning a window while long prompts wait for the decode share to let them in (no model runs).

    python benchmarks/plan_host.py [--waiting 4] [--prompt 98304] [--out results.jsonl]

A scheduler of 8 slots, a KV pool of 54,000 blocks of 16 (a 40 GiB pool of q30-half's bf16 keys and values)
and a token budget of 8,192, its window cost taught as an eager window of 0.3 s plus 25 us a row: one slot
decodes (its windows replayed in 1.6 ms), then `--waiting` prompts of `--prompt` tokens arrive together. The
share holds them back in most windows, which then decode only; the figure is `Scheduler.schedule`'s median
and 90th percentile over 300 windows, in milliseconds, with the windows that took a prompt chunk counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.protocol import SamplingParams
from app.engine.scheduler import Request, Scheduler, SchedulerConfig
from benchmarks.results import emit

REPLAYED_S, EAGER_S, PER_ROW_S = 0.0016, 0.3, 25e-6


def plan_times(waiting: int, prompt: int, windows: int = 300) -> tuple[list[float], int]:
    """Seconds of each `schedule()` call after the prompts arrive, and how many windows took prompt rows."""
    settings = {"parallel": 8, "max_batched_tokens": 8192, "block_size": 16, "kv_blocks": 54_000}
    scheduler = Scheduler(SchedulerConfig(**settings, decode_share=0.5, prefix_cache=True))
    for rows, sequences in [(1, 1), (512, 2), (2048, 2), (8192, 2), (4096, 3)]:
        scheduler.cost.observe(rows, sequences, EAGER_S + PER_ROW_S * rows)

    def run(count: int) -> tuple[list[float], int]:
        times, with_prompt = [], 0
        for _ in range(count):
            began = time.perf_counter()
            window = scheduler.schedule()
            times.append(time.perf_counter() - began)
            scheduler.advance(window)
            rows = sum(len(c.tokens) for c in window.chunks)
            replayed = window.prompt_tokens == 0
            with_prompt += not replayed
            seconds = REPLAYED_S if replayed else EAGER_S + PER_ROW_S * rows
            scheduler.observe(window, seconds, replayed=replayed)
            for chunk in window.chunks:
                if chunk.samples:
                    chunk.request.output.append(7)
        return times, with_prompt

    scheduler.add(Request("decoding", [1, 2, 3, 4], SamplingParams(max_tokens=1 << 20), 0.0))
    run(20)
    for i in range(waiting):
        tokens = [(i * 7919 + t) % 50_000 for t in range(prompt)]  # no two share a block
        scheduler.add(Request(f"long{i}", tokens, SamplingParams(max_tokens=4), 0.0))
    return run(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiting", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=98304)
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    times, with_prompt = plan_times(args.waiting, args.prompt)
    ordered = sorted(times)
    line = {
        "waiting": args.waiting,
        "prompt": args.prompt,
        "windows": len(times),
        "windows_with_prompt_rows": with_prompt,
        "plan_ms_median": 1000 * statistics.median(times),
        "plan_ms_p90": 1000 * ordered[int(0.9 * len(ordered))],
    }
    emit(line, args.out)


if __name__ == "__main__":
    main()
