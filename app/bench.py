"""`strata bench`: synthetic requests through the engine process, summarised as one JSON object.

The default scenario: request 0 starts alone; once it has SOLO_TOKENS tokens (its first, then some decoded
alone), the other `concurrency - 1` arrive together.
The summary has the aggregate and per-request speed, time to first token and inter-token latency, and how
fast request 0 decoded alone and while its peers' prompts were read (the share `--decode-share` protects).

`--follow-up`: a conversation of `prompt_len` tokens, then a follow-up turn, timed to its first token when
the conversation is still in the device's prefix cache, when it comes back from a park file after an engine
restart, and when it is read again from its start (`--no-prefix-cache`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from app.engine.client import EngineClient
from app.engine.config import EngineConfig
from app.engine.protocol import EXPERT_SOURCES, Grammar, Ready, SamplingParams, WindowStats
from app.errors import StrataError

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
SOLO_TOKENS = 4  # request 0's tokens before its peers arrive: its first, then windows where it decodes alone


def host() -> dict[str, object]:
    """The machine a run's figures come from: the CPU's model, the cores this process may use, the vector
    instructions that matter to the CPU kernels (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "vector": [f for f in VECTOR_FLAGS if f in flags]}


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
    config: EngineConfig,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    grammar: Grammar | None = None,
) -> dict:
    """Start an engine, run the scenario, return the summary; with `grammar` every request follows it
    (structured output), and a request that ends before `output_len` tokens fails the run, so that every
    run generates the same tokens."""
    return next(run_benches(config, [concurrency], prompt_len, output_len, seed, grammar))


def run_benches(
    config: EngineConfig,
    concurrencies: Sequence[int],
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    grammar: Grammar | None = None,
) -> Iterator[dict]:
    """Start one engine and run the scenario at each concurrency in turn, yielding each run's summary as it
    ends. Every run's prompts are new random tokens (no prefix-cache hit between runs)."""
    rng = random.Random(seed)
    with EngineClient.start(config) as client:
        vocab = client.ready.vocab_size
        if grammar is not None:  # the engine builds its grammar tokenizer at the first grammar: not timed
            warm = [rng.randrange(3, vocab) for _ in range(8)]
            list(client.submit(warm, SamplingParams(max_tokens=2, grammar=grammar)))
        windows: list[WindowStats] = []
        client.add_stats_listener(windows.append)
        for concurrency in concurrencies:
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
            windows.clear()
            timelines, wall = _run_scenario(client, prompts, output_len, grammar)
            short = [len(t.token_times) for t in timelines if len(t.token_times) < output_len]
            if short:
                raise StrataError(
                    f"{len(short)} requests ended before {output_len} tokens (at {min(short)})"
                    + (": the grammar closed" if grammar is not None else "")
                )
            summary = _summary(
                config, client.ready, concurrency, prompt_len, output_len, timelines, list(windows), wall
            )
            yield {**summary, "grammar": grammar.kind if grammar is not None else None}


def _run_scenario(
    client: EngineClient, prompts: list[list[int]], output_len: int, grammar: Grammar | None
) -> tuple[list[Timeline], float]:
    """Request 0 alone for its first SOLO_TOKENS tokens, then the others together; each request's
    timeline and the run's wall time."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, grammar=grammar)
    timelines = [Timeline() for _ in prompts]
    threads = [
        threading.Thread(target=_consume, args=(client, prompt, params, timeline))
        for prompt, timeline in zip(prompts, timelines, strict=True)
    ]
    start = time.perf_counter()
    threads[0].start()
    while len(timelines[0].token_times) < min(SOLO_TOKENS, output_len) and threads[0].is_alive():
        time.sleep(0.001)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join()
    return timelines, time.perf_counter() - start


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
        "host": host(),
        "model": ready.model,
        "backends": ready.backends,
        "dtype": ready.dtype,
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "parallel": config.parallel,
        "max_batched_tokens": ready.window_tokens,
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
        "windows_replayed_share": _round(statistics.fmean(w.replayed for w in windows) if windows else None),
        **_host_times(windows),
        **_stages(windows, wall),
        **_expert_tier(windows),
        **_drafts(windows),
    }


def _stages(windows: list[WindowStats], wall: float) -> dict[str, list[float]]:
    """On a layer split: each stage's busy and waiting seconds over the run's wall time, in stage order (the
    share of the run each stage worked, and waited for its window or the answer); nothing without a split."""
    timed = [w.stages for w in windows if w.stages]
    if not timed or wall <= 0:
        return {}
    count = max(len(times) for times in timed)
    busy, wait = [0.0] * count, [0.0] * count
    for times in timed:
        for stage, t in enumerate(times):
            busy[stage] += t.busy_s
            wait[stage] += t.wait_s
    return {
        "stage_busy_share": [round(b / wall, 4) for b in busy],
        "stage_wait_share": [round(w / wall, 4) for w in wait],
    }


def _drafts(windows: list[WindowStats]) -> dict[str, float | int]:
    """With drafts: guesses verified and accepted, and the tokens a decoding slot gained a window (1 in a
    window without drafts for it, 1 + accepted with them); nothing where no window verified drafts."""
    verified = [d for w in windows for d in w.drafts]
    if not verified:
        return {}
    gained = []
    for w in windows:
        accepted = {slot: n for slot, _, n in w.drafts}
        gained += [1 + accepted.get(s.slot, 0) for s in w.slots if s.phase == "decode" and s.window_tokens]
    return {
        "draft_tokens": sum(k for _, k, _ in verified),
        "draft_tokens_accepted": sum(n for _, _, n in verified),
        "tokens_per_slot_window": round(statistics.fmean(gained), 3) if gained else 0.0,
    }


def _expert_tier(windows: list[WindowStats]) -> dict[str, float | int]:
    """With an expert tier: where routed entries ran (shares from VRAM / CPU / PCIe), the experts swapped
    onto the device and the bytes copied there, over the run's expert reports; nothing without a tier."""
    reports = [w.experts for w in windows if w.experts is not None and w.experts.served is not None]
    if not reports:
        return {}
    served = [sum(column) for column in zip(*(r.served_total() for r in reports), strict=True)]
    total = max(sum(served), 1)
    return {
        **{
            f"experts_{source}_share": round(count / total, 4)
            for source, count in zip(EXPERT_SOURCES, served, strict=True)
        },
        "expert_swaps": sum(r.swaps for r in reports),
        "expert_pcie_bytes": sum(r.pcie_bytes for r in reports),
    }


def _host_times(windows: list[WindowStats]) -> dict[str, float | None]:
    """Median step and host-busy milliseconds of windows with prompt rows and of decode-only windows."""
    times: dict[str, float | None] = {}
    for kind, reads in (("prompt", True), ("decode", False)):
        chosen = [w for w in windows if bool(w.prompt_tokens) == reads]
        times[f"step_ms_p50_{kind}_windows"] = _round(percentile([1000 * w.step_s for w in chosen], 0.5))
        times[f"host_ms_p50_{kind}_windows"] = _round(percentile([1000 * w.host_s for w in chosen], 0.5))
    return times


def _observer_rates(windows: list[WindowStats]) -> tuple[float | None, float | None]:
    """Request 0's decode speed in windows where it decoded alone, and while peers' prompts were being read.

    The second counts every window from the peers' arrival until their prompts are read, also the windows that
    read none of them (the scheduler may let decoding slots run ahead, then read a large chunk). The time of
    every window while request 0 decodes counts, its tokens only in the windows that fed one: with pipelined
    slot groups (a layer split) the other groups' windows come between its own.
    """
    observer = next((s.request_id for w in windows for s in w.slots), None)
    solo_time = read_time = 0.0
    solo_rows = read_rows = 0
    for w in windows:
        mine = next((s for s in w.slots if s.request_id == observer and s.phase == "decode"), None)
        if mine is None or w.decode_tokens == 0:
            continue
        fed = int(mine.window_tokens > 0)
        peers_reading = w.waiting > 0 or any(s.phase == "prompt" for s in w.slots)
        if peers_reading or w.prompt_tokens:
            read_time += w.duration_s
            read_rows += fed
        elif len(w.slots) == 1:
            solo_time += w.duration_s
            solo_rows += fed
    return (solo_rows / solo_time if solo_time else None, read_rows / read_time if read_time else None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


FOLLOW_UP_TOKENS = 32  # new tokens of the follow-up turn


def _first_token(client: EngineClient, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds from submitting `prompt` to its first token, and the tokens it generated."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    timeline = Timeline()
    tokens: list[int] = []
    timeline.submitted = time.perf_counter()
    for output in client.submit(prompt, params):
        if not timeline.token_times and output.token_ids:
            timeline.token_times.append(time.perf_counter())
        tokens += output.token_ids
    return timeline.token_times[0] - timeline.submitted, tokens


def run_follow_up(config: EngineConfig, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    """Time a follow-up turn's first token: from the device cache, from a park file, and read again."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="strata-bench-park-") as scratch:
        parking = msgspec.structs.replace(
            config,
            prefix_cache=True,
            park_memory=max(config.park_memory, 1 << 30),
            park_dir=scratch,
            park_disk=max(config.park_disk, 64 << 30),
        )
        restores: list[WindowStats] = []
        with EngineClient.start(parking) as client:
            vocab = client.ready.vocab_size
            first = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            ttft_first, answer = _first_token(client, first, output_len)
            follow_up = first + answer + [rng.randrange(3, vocab) for _ in range(FOLLOW_UP_TOKENS)]
            ttft_cached, cached_tokens = _first_token(client, follow_up, output_len)
            ready = client.ready
        with EngineClient.start(parking) as client:  # a restart: only the park files remain
            client.add_stats_listener(restores.append)
            ttft_restored, restored_tokens = _first_token(client, follow_up, output_len)
        with EngineClient.start(msgspec.structs.replace(config, prefix_cache=False)) as client:
            ttft_reread, reread_tokens = _first_token(client, follow_up, output_len)
    parked = next((w.parking for w in reversed(restores) if w.parking is not None), None)
    return {
        "device": ready.device,
        "host": host(),
        "model": ready.model,
        "backends": ready.backends,
        "dtype": ready.dtype,
        "conversation_tokens": len(first) + len(answer),
        "follow_up_tokens": len(follow_up),
        "ttft_first_turn_s": round(ttft_first, 4),
        "ttft_follow_up_cached_s": round(ttft_cached, 4),
        "ttft_follow_up_restored_from_disk_s": round(ttft_restored, 4),
        "restore_s": _round(parked.restore_seconds if parked else None),
        "ttft_follow_up_read_again_s": round(ttft_reread, 4),
        "same_tokens": cached_tokens == restored_tokens == reread_tokens,
    }
