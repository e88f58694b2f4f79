"""Many streaming clients for a long while against `strata serve`: every answer complete, no error, the
processes' memory flat once warm.

    python benchmarks/soak.py [--model app/strata-demo] [--clients 64] [--seconds 600] [--out soak.jsonl]

Starts `strata serve` on the model (its own engine process), then `--clients` clients each stream chat
answers one after another (a random question of 8-64 words, 16-96 tokens out) until `--seconds` have passed.
An answer counts as complete when its stream ends with a finish reason and `data: [DONE]`. Every 5 s it
samples the resident memory of the server and of the engine process (psutil), the engine's less the host RAM
its parked conversations hold by design (`parked_bytes_ram` in /metrics, up to `--park-memory`); park files go
to a temporary directory, removed at the end. Ends with one JSON line: answers, errors, tokens and tok/s, and
RSS of both processes after the first minute (warm) and at the end; fails when any answer errored or was
incomplete, or when a process grew by more than `--rss-growth` (default 10%) after warming up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_burst import start_server, wait_ready
from benchmarks.results import emit

WORDS = ["the", "a", "river", "town", "woke", "slowly", "under", "grey", "sky", "while", "boats", "drifted"]
WARM_S = 60.0  # memory before this is the process settling, not a leak


class Tally:
    """What the clients saw."""

    def __init__(self) -> None:
        self.answers = 0
        self.tokens = 0
        self.errors: list[str] = []


async def client_loop(base: str, deadline: float, seed: int, tally: Tally) -> None:
    """Stream answers one after another until the deadline; count each complete one, record each failure."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        while time.monotonic() < deadline:
            question = " ".join(rng.choices(WORDS, k=rng.randint(8, 64)))
            body = {
                "messages": [{"role": "user", "content": question}],
                "max_tokens": rng.randint(16, 96),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            finished, done, tokens = False, False, 0
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        tally.errors.append(
                            f"status {response.status_code}: {(await response.aread())[:200]!r}"
                        )
                        continue
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            chunk = json.loads(line.removeprefix("data: "))
                            if "error" in chunk:
                                tally.errors.append(str(chunk["error"])[:200])
                            for choice in chunk.get("choices", []):
                                finished = finished or choice.get("finish_reason") is not None
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                tally.errors.append(f"{type(e).__name__}: {e}")
                continue
            if finished and done:
                tally.answers += 1
                tally.tokens += tokens
            else:
                tally.errors.append(f"incomplete answer (finish reason: {finished}, [DONE]: {done})")


async def sample_memory(
    base: str, server: psutil.Process, deadline: float, samples: list[tuple[float, int, int]]
) -> None:
    """(seconds since start, server RSS, engine RSS less its parked conversations) every 5 s until the
    deadline."""
    began = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while time.monotonic() < deadline:
            children = [c for c in server.children(recursive=True) if "python" in c.name().lower()]
            engine = max((c.memory_info().rss for c in children), default=0)
            parked = (await http.get("/metrics?format=json")).json()["parked_bytes_ram"]
            samples.append((time.monotonic() - began, server.memory_info().rss, engine - parked))
            await asyncio.sleep(5)


async def soak(base: str, server: psutil.Process, clients: int, seconds: float) -> dict[str, Any]:
    tally, samples = Tally(), []
    began = time.monotonic()
    deadline = began + seconds
    await asyncio.gather(
        sample_memory(base, server, deadline, samples),
        *(client_loop(base, deadline, seed, tally) for seed in range(clients)),
    )
    elapsed = time.monotonic() - began
    warm = next((s for s in samples if s[0] >= WARM_S), samples[0])
    last = samples[-1]
    # The engine's lowest sample of each fifth of the run after warming up: growth that levels off shows here.
    after = [s for s in samples if s[0] >= WARM_S] or samples
    fifths = [after[i * len(after) // 5 : (i + 1) * len(after) // 5] or after for i in range(5)]
    return {
        "answers": tally.answers,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "tokens": tally.tokens,
        "tok_s": round(tally.tokens / elapsed, 1),
        "seconds": round(elapsed, 1),
        "server_rss_warm_mb": round(warm[1] / 2**20, 1),
        "server_rss_end_mb": round(last[1] / 2**20, 1),
        "engine_rss_warm_mb": round(warm[2] / 2**20, 1),  # less the RAM of parked conversations
        "engine_rss_end_mb": round(last[2] / 2**20, 1),
        "engine_rss_fifths_min_mb": [round(min(s[2] for s in part) / 2**20, 1) for part in fifths],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=Path(__file__).resolve().parents[1] / "app" / "strata-demo"
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rss-growth", type=float, default=0.10)
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to strata serve")
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    log = Path(os.environ.get("OUT", "/tmp")) / "soak_server.log"
    park = tempfile.TemporaryDirectory(prefix="strata-soak-park-")
    process = start_server(
        args.model, args.port, ["--parallel", "16", "--park-dir", park.name, *args.serve_arg], log
    )
    try:
        base = f"http://127.0.0.1:{args.port}"
        asyncio.run(wait_ready(base, process, 600))
        line = {
            "model": str(args.model),
            "date": time.strftime("%Y-%m-%d"),
            "clients": args.clients,
            "serve_args": ["--parallel", "16", *args.serve_arg],
            **asyncio.run(soak(base, psutil.Process(process.pid), args.clients, args.seconds)),
        }
    finally:
        process.terminate()
        process.wait(timeout=30)
        park.cleanup()
    emit(line, args.out)
    grew = [
        name
        for name in ("server", "engine")
        if line[f"{name}_rss_end_mb"] > (1 + args.rss_growth) * line[f"{name}_rss_warm_mb"]
    ]
    if line["errors"] or grew:
        sys.exit(f"soak failed: {line['errors']} errors; grew after warming up: {', '.join(grew) or 'none'}")


if __name__ == "__main__":
    main()
