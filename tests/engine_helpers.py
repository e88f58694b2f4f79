"""Driving an in-process EngineCore in tests: feed requests at chosen windows, collect what they produce."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.cuda_graphs import Bucket, WindowGraphs
from app.engine.protocol import AddRequest, PositionLogprobs, SamplingParams, WindowStats

_ids = itertools.count()


@dataclass
class Completion:
    """Everything one request produced."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn from the tiny models' vocabulary, the same for the same seed."""
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_core(path: Path, **overrides: object) -> EngineCore:
    """An engine core on the CPU in fp32 over a checkpoint directory."""
    settings = {"model": str(path), "dtype": "float32", "kv_memory": 64 << 20, **overrides}
    return EngineCore(EngineConfig(**settings))


def request(prompt: list[int], **params: object) -> AddRequest:
    """An AddRequest with a fresh id."""
    return AddRequest(f"r{next(_ids)}", list(prompt), SamplingParams(**params))


def run(
    core: EngineCore,
    arrivals: list[tuple[int, AddRequest]],
    aborts: dict[int, list[str]] | None = None,
    after_window: Callable[[], None] | None = None,
) -> tuple[dict[str, Completion], list[WindowStats]]:
    """Step until idle; each (window, request) is added before that window runs, each abort likewise;
    `after_window` is called after each step."""
    results = {add.request_id: Completion() for _, add in arrivals}
    stats: list[WindowStats] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    aborts = aborts or {}
    for window in itertools.count():
        outputs = []
        while pending and pending[0][0] <= window:
            outputs += core.add_request(pending.pop(0)[1])
        for request_id in aborts.get(window, []):
            outputs += core.abort_request(request_id)
        if not core.has_work() and not pending:
            _collect(results, outputs)
            break
        if core.has_work():
            step_outputs, window_stats = core.step()
            outputs += step_outputs
            if window_stats is not None:
                stats.append(window_stats)
            if after_window is not None:
                after_window()
        _collect(results, outputs)
    return results, stats


def _collect(results: dict[str, Completion], outputs: list) -> None:
    for out in outputs:
        done = results[out.request_id]
        done.token_ids += out.token_ids
        done.text += out.text
        done.logprobs += out.logprobs
        if out.finished:
            done.finish_reason = out.finish_reason
            done.error = out.error


def complete(core: EngineCore, prompt: list[int], **params: object) -> Completion:
    """Run one request alone to its end."""
    add = request(prompt, **params)
    return run(core, [(0, add)])[0][add.request_id]


def assert_parked_follow_up_continues(path: Path, block_dtype: torch.dtype, **settings: object) -> None:
    """On a core of `settings` with a pool of 80 blocks (of `block_dtype`) and a park: a 600-token turn
    answered, then evicted from the pool by a longer conversation, is restored for its follow-up, which takes
    all of it and gives the greedy tokens of reading the whole conversation afresh."""
    from app.engine.paged_state import kv_block_bytes, slot_state_bytes

    config = make_core(path).loaded.model.config
    memory = 80 * kv_block_bytes(config, 16, block_dtype) + 16 * slot_state_bytes(config, torch.float32)
    core = make_core(path, kv_memory=memory, park_memory=64 << 20, **settings)
    greedy = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    first = random_prompt(600, 1)
    answer = complete(core, first, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    follow_up = [*first, *answer, *random_prompt(20, 2)]
    complete(core, random_prompt(1200, 3), max_tokens=5, temperature=0, ignore_eos=True)  # evicts the turn
    add = request(follow_up, **greedy)
    results, windows = run(core, [(0, add)])
    assert core.park is not None and core.park.stats().restores == 1
    assert sum(w.prefix_cache_hits for w in windows) == len(first) + len(answer) - 1
    read_whole = make_core(path, prefix_cache=False, kv_dtype=core.config.kv_dtype)
    assert results[add.request_id].token_ids == complete(read_whole, follow_up, **greedy).token_ids


def with_window_graphs(core: EngineCore, draft_rows: int = 0) -> list[Bucket]:
    """Give the core's runner window graphs (not captured on the CPU: each window runs the forward over the
    graphs' padded static inputs), scoring up to `draft_rows` draft rows a window; returns the list of
    buckets its windows ran in."""
    config, state = core.config, core.runner.state
    max_blocks = -(-core.max_model_len // config.block_size)
    tokens = core.window_tokens
    model, slots = core.runner.model, config.parallel
    graphs = WindowGraphs(model, state, slots, max_blocks, tokens, draft_rows=draft_rows)
    used: list[Bucket] = []
    run_bucket = graphs.run

    def run_and_record(chunks: list, bucket: Bucket, fed: object = None) -> torch.Tensor:
        used.append(bucket)
        return run_bucket(chunks, bucket, fed)

    graphs.run = run_and_record  # type: ignore[method-assign]
    core.runner.graphs = graphs
    return used
