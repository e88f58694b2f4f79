"""What users feel over HTTP: `strata serve` on a checkpoint on disk, driven by streaming clients.

    python benchmarks/http_burst.py --model /tmp/q30-half [--clients 32 --prompt-len 512 --output-len 128]
        [--serve-arg=--max-batched-tokens=2048 ...] [--out results.jsonl]

Starts `strata serve` on the model (its own engine process, as a user would), then runs, one after another:

- solo: one stream (a 128-token prompt, `--output-len` tokens); decode tok/s after its first token;
- read (where named): one `--prompt-len`-token prompt alone: its time to first token and prompt tok/s;
- together (where named): `--clients` streams with 128-token prompts arriving together: their aggregate
  decode tok/s while every one of them decodes (from the last first token to the first last one);
- burst: `--clients` streams arriving together with `--prompt-len`-token prompts: time to first token
  p50 / max, inter-token latency p50 / p95 over every stream's gaps, the whole burst's time, and the busiest
  card's `strata:gpu_*` figures in /metrics at the busiest of the scrapes taken every half second while the
  streams run (`burst_gpu_*`);
- observer: one stream decoding alone, then `--clients - 1` peers' prompts arrive together; its tok/s from
  their arrival until the last peer's first token, over its solo tok/s just before;
- long peers (with `--long-peers N`): one `--long-prompt-len`-token prompt read alone (its time to first
  token: one read), then the observer run with N peers of that length; their first-token times (sorted),
  their sum, and that sum over N reads (1 where they are read together at the cost of one, (N + 1) / 2
  where they are read one after another at full speed).

Every prompt is fresh random token ids, and the run fails if the server's prefix cache served any prompt token
(a cached prompt would time a read that never happened), or if the solo decode beats the card's roofline.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import measure_copy_bandwidth, roofline_tok_s

SOLO_PROMPT = 128
OBSERVER_TOKENS = 8000  # the watched stream's length: it is cancelled once its peers have been read
WARM_TOKENS = 250  # the watched stream's tokens before its solo speed is timed (an expert tier adapting)
SOLO_TOKENS = 150  # the tokens its solo speed is timed over, just before its peers arrive
NAMED_ONLY = ("read", "together")  # scenarios run only where --scenarios names them


# counters read from /metrics before and after each scenario (a name, or a name and a label its samples must
# carry): the windows that ran (their steps, seconds, host seconds, those replayed from CUDA graphs, those of
# decode rows alone and their seconds, the scheduler's predictions of windows with prompt rows paced beside
# decoding slots and what those took), the KV blocks streamed from host RAM, the expert tier's swaps and the
# windows' waits for them, and its routed entries served from VRAM, on the CPU and in all
TOTALS = {
    "steps": "strata:window_step_seconds_count",
    "step_s": "strata:window_step_seconds_sum",
    "host_s": "strata:window_host_seconds_sum",
    "replayed": "strata:windows_replayed_total",
    "decode_steps": "strata:decode_windows_total",
    "decode_step_s": "strata:decode_window_seconds_total",
    "paced_predicted_s": "strata:paced_window_predicted_seconds_total",
    "paced_s": "strata:paced_window_seconds_total",
    "kv_host_reads": "strata:kv_host_block_reads_total",
    "swaps": "strata:expert_swaps_total",
    "adapt_wait_s": "strata:expert_adapt_wait_seconds_total",
    "routed_vram": 'strata:expert_routed_total{source="vram"',
    "routed_cpu": 'strata:expert_routed_total{source="cpu"',
    "routed": "strata:expert_routed_total",
}


@dataclass
class Stream:
    """One streamed completion: when it was sent and when each token event arrived."""

    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.events[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]


class Client:
    """Streams completions from the server with fresh random prompts."""

    def __init__(self, base: str, vocab: int, seed: int) -> None:
        self.base = base
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.http = httpx.AsyncClient(base_url=base, timeout=600)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(length)]

    async def stream(self, prompt_len: int, output_len: int, out: Stream | None = None) -> Stream:
        out = out or Stream()
        body = {
            "model": "bench",
            "prompt": self.prompt(prompt_len),
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.sent = time.perf_counter()
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text"):
                    out.events.append(time.perf_counter())
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
        if out.tokens != output_len or not out.events:
            raise RuntimeError(f"a stream produced {out.tokens} tokens, not {output_len}")
        return out

    async def totals(self) -> dict[str, float]:
        """The counters of TOTALS so far (from /metrics; 0 where the server has none)."""
        text = (await self.http.get("/metrics", headers={"Accept": "text/plain"})).text
        found = dict.fromkeys(TOTALS, 0.0)
        for line in text.splitlines():
            name = line.partition("{")[0].partition(" ")[0]
            for key, metric in TOTALS.items():
                wanted, _, label = metric.partition("{")
                if name == wanted and (not label or label in line.partition(" ")[0]):
                    found[key] += float(line.rsplit(" ", 1)[-1])
        return found

    async def cards(self) -> dict[str, float]:
        """The busiest card's figures in /metrics now (`strata:gpu_*`; empty without NVIDIA cards)."""
        text = (await self.http.get("/metrics", headers={"Accept": "text/plain"})).text
        by_card: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            if line.startswith("strata:gpu_"):
                name, labels = line.split("{", 1)[0], line.split("{", 1)[1].split("}", 1)[0]
                gpu = next(part for part in labels.split(",") if part.startswith("gpu="))
                by_card.setdefault(gpu, {})[name.removeprefix("strata:gpu_")] = float(line.rsplit(" ", 1)[-1])
        return max(by_card.values(), key=lambda card: card.get("utilization_ratio", 0.0), default={})

    async def cache_hits(self) -> int:
        metrics = (await self.http.get("/metrics", headers={"Accept": "application/json"})).json()
        return int(metrics["prefix_cache_hits_total"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rate(stream: Stream, start: float, end: float) -> float:
    """Tokens per second of `stream` between two instants."""
    return sum(start <= t <= end for t in stream.events) / (end - start)


async def solo(client: Client, output_len: int) -> dict[str, float]:
    stream = await client.stream(SOLO_PROMPT, output_len)
    decode = (len(stream.events) - 1) / (stream.events[-1] - stream.events[0])
    return {"solo_ttft_s": stream.ttft, "solo_decode_tok_s": decode}


async def read(client: Client, prompt_len: int) -> dict[str, float]:
    stream = await client.stream(prompt_len, 4)
    return {"read_ttft_s": stream.ttft, "read_tok_s": prompt_len / stream.ttft}


def together_rate(streams: list[Stream]) -> float:
    """Tokens per second of all `streams` together while every one of them decodes: from the last one's
    first token to the first one's last token."""
    start, end = max(s.events[0] for s in streams), min(s.events[-1] for s in streams)
    if end <= start:
        raise RuntimeError("the streams never decoded all at once: raise --output-len")
    return sum(sum(start < t <= end for t in s.events) for s in streams) / (end - start)


async def together(client: Client, clients: int, output_len: int) -> dict[str, float]:
    streams = await asyncio.gather(*(client.stream(SOLO_PROMPT, output_len) for _ in range(clients)))
    return {"together_tok_s": together_rate(streams), "together_ttft_max_s": max(s.ttft for s in streams)}


async def burst(client: Client, clients: int, prompt_len: int, output_len: int) -> dict[str, float]:
    """`clients` streams at once; the busiest card's figures as /metrics shows them, scraped every half
    second while the streams run, at the scrape where it was busiest (the server samples the cards about once
    a second, and NVML averages utilisation over up to a second: a burst shorter than that shows little)."""
    done = asyncio.Event()

    async def scrape_while_running() -> dict[str, float]:
        busiest: dict[str, float] = {}
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)
            if not done.is_set():
                card = await client.cards()
                if card.get("utilization_ratio", 0.0) >= busiest.get("utilization_ratio", -1.0):
                    busiest = card
        return busiest

    began = time.perf_counter()
    scrape = asyncio.create_task(scrape_while_running())
    streams = await asyncio.gather(*(client.stream(prompt_len, output_len) for _ in range(clients)))
    wall = time.perf_counter() - began
    done.set()
    card = await scrape
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps()]
    return {
        "burst_s": wall,
        "burst_ttft_p50_s": statistics.median(ttfts),
        "burst_ttft_max_s": max(ttfts),
        "burst_itl_p50_ms": 1000 * statistics.median(gaps),
        "burst_itl_p95_ms": 1000 * percentile(gaps, 0.95),
        "burst_tok_s": clients * output_len / wall,
        **{f"burst_gpu_{name}": value for name, value in card.items()},
    }


async def observer(client: Client, peers: int, prompt_len: int, name: str, length: int) -> dict[str, Any]:
    """A stream of `length` tokens decoding alone, then `peers` prompts arriving together: its speed while
    they are read, against its solo speed just before (`_ratio`), and against its solo speed at the same
    context (`_ratio_same_context`): the harmonic mean of the speeds before and after the read, alone again
    (its context grows while the peers are read, and its own attention with it; on a long read that alone
    can halve a small model's speed). Its solo speed is taken over the SOLO_TOKENS after its first
    WARM_TOKENS (an expert tier adapts to its routing meanwhile: the speed it keeps alone)."""
    watched = Stream()
    task = asyncio.create_task(client.stream(SOLO_PROMPT, length, watched))
    while len(watched.events) < WARM_TOKENS + SOLO_TOKENS:
        if task.done():
            task.result()  # raises what ended it
            raise RuntimeError("the watched stream ended before its peers arrived")
        await asyncio.sleep(0.005)
    solo_start = watched.events[-SOLO_TOKENS]
    arrival = time.perf_counter()
    solo_rate = rate(watched, solo_start, arrival)
    streams = await asyncio.gather(*(client.stream(prompt_len, 4) for _ in range(peers)))
    read = max(s.events[0] for s in streams)
    during = rate(watched, arrival, read)
    if task.done():
        raise RuntimeError("the watched stream ended before its peers were read")
    alone = len(watched.events)  # the peers end four tokens after their first
    while len(watched.events) < alone + 250:
        if task.done():
            task.result()
            raise RuntimeError("the watched stream ended before it decoded alone again")
        await asyncio.sleep(0.005)
    after = rate(watched, watched.events[alone + 100], watched.events[alone + 249])
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    ttfts = sorted(s.ttft for s in streams)
    return {
        f"{name}_ttfts": ttfts,
        f"{name}_solo_tok_s": solo_rate,
        f"{name}_during_tok_s": during,
        f"{name}_ratio": during / solo_rate,
        f"{name}_solo_after_tok_s": after,
        f"{name}_ratio_same_context": during * (1 / solo_rate + 1 / after) / 2,
        f"{name}_read_s": read - arrival,
        f"{name}_peer_ttft_p50_s": statistics.median(ttfts),
        f"{name}_peer_ttft_max_s": ttfts[-1],
    }


async def long_peers(client: Client, peers: int, prompt_len: int, length: int) -> dict[str, Any]:
    """One long prompt read alone, then the observer run with `peers` of them: their first-token times
    against that one read."""
    read = (await client.stream(prompt_len, 4)).ttft
    result: dict[str, Any] = await observer(client, peers, prompt_len, "long_peers", length)
    ttfts = result.pop("long_peers_ttfts")
    result.update(
        long_solo_read_s=read,
        long_peers_ttfts_s=ttfts,
        long_peers_ttft_sum_s=sum(ttfts),
        long_peers_ttft_sum_over_reads=sum(ttfts) / (peers * read),  # over all peers' reads alone
        # in single reads: one after another at full speed sums to peers * (peers + 1) / 2
        long_peers_ttft_sum_single_reads=sum(ttfts) / read,
    )
    return result


def start_server(model: Path, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", str(port), *extra]
    command += ["--served-model-name", "bench"]
    print("$", " ".join(command), flush=True)
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen(command, cwd=root, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def wait_ready(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with status {server.returncode}")
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError("the server did not become ready in time")


async def run(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    base = f"http://127.0.0.1:{args.port}"
    client = Client(base, config["vocab_size"], args.seed)
    result: dict[str, Any] = {}
    await client.stream(SOLO_PROMPT, 8)  # the first request pays for nothing that users would not see again
    hits = await client.cache_hits()
    length = min(args.observer_tokens, config["max_position_embeddings"] - SOLO_PROMPT)
    scenarios = {
        "solo": lambda: solo(client, args.output_len * 2),
        "read": lambda: read(client, args.prompt_len),
        "together": lambda: together(client, args.clients, args.output_len),
        "burst": lambda: burst(client, args.clients, args.prompt_len, args.output_len),
        "observer": lambda: observer(client, args.clients - 1, args.prompt_len, "observer", length),
    }
    if args.long_peers:
        scenarios["long_peers"] = lambda: long_peers(client, args.long_peers, args.long_prompt_len, length)
    for name, scenario in scenarios.items():
        named = args.scenarios.split(",") if args.scenarios else [n for n in scenarios if n not in NAMED_ONLY]
        if name not in named:
            continue
        before = await client.totals()
        result.update(await scenario())
        after = await client.totals()
        ran = {key: after[key] - before[key] for key in TOTALS}
        steps = ran["steps"]
        result[f"{name}_step_ms_mean"] = 1000 * ran["step_s"] / steps if steps else None
        result[f"{name}_host_ms_mean"] = 1000 * ran["host_s"] / steps if steps else None
        result[f"{name}_replayed_share"] = ran["replayed"] / steps if steps else None
        decoding = ran["decode_steps"]
        result[f"{name}_decode_step_ms_mean"] = 1000 * ran["decode_step_s"] / decoding if decoding else None
        result[f"{name}_vram_share"] = ran["routed_vram"] / ran["routed"] if ran["routed"] else None
        result[f"{name}_cpu_share"] = ran["routed_cpu"] / ran["routed"] if ran["routed"] else None
        predicted = ran["paced_predicted_s"]
        result[f"{name}_paced_over_predicted"] = ran["paced_s"] / predicted if predicted else None
        result[f"{name}_kv_host_block_reads"] = ran["kv_host_reads"]
        result[f"{name}_expert_swaps"] = ran["swaps"]
        result[f"{name}_adapt_wait_s"] = ran["adapt_wait_s"]
    if await client.cache_hits() != hits:
        raise RuntimeError("the prefix cache served prompt tokens during the timed runs: figures are void")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an HF directory on disk")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-peers", type=int, default=0, help="peers of the long-prompt observer run")
    parser.add_argument("--long-prompt-len", type=int, default=8192)
    parser.add_argument(
        "--observer-tokens",
        type=int,
        default=OBSERVER_TOKENS,
        help="the watched stream's most tokens (raise it where its peers' prompts take long to read)",
    )
    parser.add_argument(
        "--scenarios", help="run only these, e.g. solo,observer (default: solo, burst, observer, long peers)"
    )
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to strata serve")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    bandwidth = measure_copy_bandwidth("cuda") if _has_cuda() else None
    log = Path(os.environ.get("OUT", "/tmp")) / "http_burst_server.log"
    began = time.perf_counter()
    server = start_server(args.model, args.port, args.serve_arg, log)
    try:
        asyncio.run(wait_ready(f"http://127.0.0.1:{args.port}", server, args.ready_timeout))
        line: dict[str, Any] = {
            "model": str(args.model),
            "layers": config["num_hidden_layers"],
            "date": time.strftime("%Y-%m-%d"),
            "serve_args": args.serve_arg,
            "clients": args.clients,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "ready_s": time.perf_counter() - began,
        }
        line.update(asyncio.run(run(args, config)))
    finally:
        server.terminate()
        server.wait(timeout=60)
    if bandwidth is not None:
        line["roofline_bs1_tok_s"] = roofline_tok_s(config, 1, SOLO_PROMPT + args.output_len, bandwidth)
        if line.get("solo_decode_tok_s", 0) > line["roofline_bs1_tok_s"]:
            raise SystemExit(f"solo decode above the card's roofline: {line}")
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as out:
            out.write(text + "\n")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
