"""The real engine in its own process on a tiny model: concurrent streams, a crash, `strata bench`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

from app.cli import main
from app.engine.client import EngineClient, EngineError
from app.engine.config import EngineConfig
from app.engine.protocol import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("next"), "qwen3_next", max_position_embeddings=4096)


def _config(path: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", kv_memory=64 << 20, **overrides)


def test_concurrent_streams_through_the_process_equal_their_solo_runs(checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 40 + i, 7] * (i + 2) for i in range(6)]
    with EngineClient.start(_config(checkpoint, parallel=4)) as client:
        solo = [client.generate(p, params).token_ids for p in prompts]
        together: dict[int, list[int]] = {}

        def consume(i: int) -> None:
            together[i] = client.generate(prompts[i], params).token_ids

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert client.last_stats is not None and client.last_stats.kv_blocks_used == 0
    assert [together[i] for i in range(6)] == solo


def test_an_engine_crash_reaches_a_waiting_client_within_5_seconds(checkpoint: Path) -> None:
    client = EngineClient.start(_config(checkpoint))
    try:
        stream = client.submit([5, 6, 7], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        next(iter(stream))
        os.kill(client.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineError, match="engine process exited"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 5
        with pytest.raises(EngineError):
            client.submit([5], SamplingParams(max_tokens=2))
    finally:
        client.shutdown()


def test_bench_reports_throughput_latency_decode_during_peer_reads_and_expert_sources(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--model", str(checkpoint), "--dtype", "float32", "--kv-memory", "64MiB"]
    args += ["--concurrency", "4", "--prompt-len", "600", "--output-len", "24", "--max-batched-tokens", "128"]
    args += ["--expert-cache", "2"]  # where the routed entries ran is in the summary too
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["host"]["cores"] >= 1 and summary["host"]["cpu"]  # the machine the figures come from
    shares = [summary[f"experts_{source}_share"] for source in ("vram", "cpu", "pcie")]
    assert shares[0] > 0 and shares[1] > 0 and shares[2] == 0 and sum(shares) == pytest.approx(1, abs=1e-3)
    assert len(summary["ttft_s"]) == 4 and all(t > 0 for t in summary["ttft_s"])
    assert summary["aggregate_tok_s"] > 0 and summary["itl_p95_s"] >= summary["itl_p50_s"] > 0
    assert summary["decode_solo_tok_s"] > 0 and summary["decode_during_peer_reads_tok_s"] > 0
    # On the CPU the host does all the work: a window's host time is its whole step.
    assert 0 < summary["host_ms_p50_prompt_windows"] <= summary["step_ms_p50_prompt_windows"]
    assert 0 < summary["host_ms_p50_decode_windows"] <= summary["step_ms_p50_decode_windows"]


def test_bench_on_a_layer_split_reports_each_stages_busy_and_waiting_share_for_each_concurrency(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--model", str(checkpoint), "--dtype", "float32", "--kv-memory", "64MiB"]
    args += ["--concurrency", "1", "2", "--prompt-len", "64", "--output-len", "12", "--layer-split", "2"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    summaries = [json.loads(line) for line in lines]  # one engine, a run and a JSON line a concurrency
    assert [s["concurrency"] for s in summaries] == [1, 2]
    assert [len(s["ttft_s"]) for s in summaries] == [1, 2]
    # each run counts its own windows: at most one a token a request (both runs' together would be more)
    assert all(s["windows"] <= 12 * s["concurrency"] for s in summaries)
    for summary in summaries:
        busy, wait = summary["stage_busy_share"], summary["stage_wait_share"]
        assert len(busy) == len(wait) == 2
        assert all(0 < b <= 1 for b in busy) and all(w >= 0 for w in wait)
        assert summary["windows_replayed_share"] == 0  # a CPU replays no graphs
