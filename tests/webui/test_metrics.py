"""`/metrics`: vLLM's names, labels and buckets, the JSON snapshot, request timing, a live server's counts."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest
from litestar import Litestar, get
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.testing import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from serving import Server

from app.engine.protocol import ExpertUsage, ParkingStats, Ready, SlotStats, StageTimes, WindowStats
from webui.engine_link import RequestRecord
from webui.metrics import ServerMetrics, buckets_1_2_5, http_metrics_middleware, metrics_route
from webui.settings import ServerSettings

READY = Ready(
    model="tiny",
    model_path="/nowhere",
    max_model_len=4096,
    vocab_size=512,
    parallel=4,
    kv_blocks_total=100,
    block_size=16,
    eos_token_ids=[0],
)
LABELS = {"model_name": "tiny", "engine": "0"}

LAT = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160]
TTFT += [640, 2560]
LENGTHS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # 1-2-5 up to max_model_len 4096
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
WINDOW = [0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1]

VLLM_SCALARS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
]
COUNTERS = [name for name in VLLM_SCALARS if name.endswith("_total")] + ["vllm:request_success_total"]
HISTOGRAMS = {
    "vllm:request_prompt_tokens": LENGTHS,
    "vllm:request_generation_tokens": LENGTHS,
    "vllm:iteration_tokens_total": ITERATION,
    "vllm:request_max_num_generation_tokens": LENGTHS,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_params_max_tokens": LENGTHS,
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    "vllm:e2e_request_latency_seconds": LAT,
    "vllm:request_queue_time_seconds": LAT,
    "vllm:request_inference_time_seconds": LAT,
    "vllm:request_prefill_time_seconds": LAT,
    "vllm:request_decode_time_seconds": LAT,
    "strata:window_step_seconds": WINDOW,
    "strata:window_host_seconds": WINDOW,
}
STRATA_SCALARS = [
    "live_tok_s",
    "live_slots",
    "parallel",
    "window_seconds",
    "kv_blocks_used",
    "kv_blocks_total",
    "windows_total",
]


def samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(metrics: ServerMetrics) -> list[Sample]:
    """The samples `/metrics` would serve a scraper."""
    return samples(generate_latest(metrics.registry).decode())


def value(found: list[Sample], name: str, **labels: str) -> float:
    """The one sample with this name whose labels include these."""
    matches = [s.value for s in found if s.name == name and labels.items() <= s.labels.items()]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def total(found: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples with this name whose labels include these (0 when there are none)."""
    return sum(s.value for s in found if s.name == name and labels.items() <= s.labels.items())


def window(number: int, started: float, slots: list[SlotStats], **fields: Any) -> WindowStats:
    """A window's stats, with zeros where a test does not care."""
    base: dict[str, Any] = dict(duration_s=0.5, rows=0, prompt_tokens=0, decode_tokens=0, waiting=0)
    base |= dict(kv_blocks_used=10, kv_blocks_total=100)
    return WindowStats(window=number, started=started, slots=slots, **(base | fields))


def decoding(slot: int, request_id: str, output_tokens: int = 3) -> SlotStats:
    """A slot that fed one decode row this window."""
    return SlotStats(slot, request_id, "decode", 8, 8, output_tokens, 8 + output_tokens, 1)


def reading(slot: int, request_id: str) -> SlotStats:
    """A slot halfway through its prompt."""
    return SlotStats(slot, request_id, "prompt", 4, 8, 0, 4, 4)


def finished(request_id: str, reason: str = "length", tokens: list[float] | None = None) -> RequestRecord:
    """A closed record: arrived at 100, scheduled at 100.5, its tokens at `tokens`, ended after the last."""
    tokens = [101.0, 101.25, 101.5, 102.0] if tokens is None else tokens
    end = (tokens[-1] if tokens else 100.5) + 0.25
    return RequestRecord(request_id, 100.0, 8, 16, 1, 100.5, list(tokens), reason, end)


def histogram(found: list[Sample], name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return value(found, f"{name}_count", **LABELS), value(found, f"{name}_sum", **LABELS)


def test_every_reference_name_is_exported_with_model_name_and_engine() -> None:
    found = scrape(ServerMetrics("tiny", READY))
    names = {s.name for s in found if LABELS.items() <= s.labels.items()}
    for name in [
        *VLLM_SCALARS,
        "vllm:request_success_total",
        "vllm:cache_config_info",
        *(f"{h}_count" for h in HISTOGRAMS),
        *(f"{h}_bucket" for h in HISTOGRAMS),
    ]:
        assert name in names, name
    for reason in ("stop", "length", "abort", "error"):
        assert value(found, "vllm:request_success_total", finished_reason=reason) == 0
    info = [s.labels for s in found if s.name == "vllm:cache_config_info"]
    assert info == [
        LABELS
        | {
            "block_size": "16",
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",
            "num_gpu_blocks": "100",
        }
    ]
    assert value(found, "vllm:cache_config_info") == 1


def test_counters_end_in_total_and_each_family_has_one_type_line() -> None:
    text = generate_latest(ServerMetrics("tiny", READY).registry).decode()
    types = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE")]
    names = [name for name, _ in types]
    assert len(names) == len(set(names))
    counters = {name for name, kind in types if kind == "counter"}
    assert {*COUNTERS, "http_requests_total", "strata:windows_total"} <= counters
    assert all(name.endswith("_total") for name in counters)


def test_histogram_buckets_are_the_reference_lists() -> None:
    found = scrape(ServerMetrics("tiny", READY))
    for name, expected in HISTOGRAMS.items():
        bounds = [float(s.labels["le"]) for s in found if s.name == f"{name}_bucket"]
        assert bounds == [*map(float, expected), float("inf")], name
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(4096) == LENGTHS


def test_request_timing_is_split_into_queue_prefill_decode() -> None:
    metrics = ServerMetrics("tiny", READY)
    metrics.on_request_finished(finished("a"))  # arrival 100, scheduled 100.5, tokens 101 .. 102, end 102.25
    found = scrape(metrics)
    assert histogram(found, "vllm:request_queue_time_seconds") == (1, 0.5)
    assert histogram(found, "vllm:request_prefill_time_seconds") == (1, 0.5)
    assert histogram(found, "vllm:request_decode_time_seconds") == (1, 1.0)
    assert histogram(found, "vllm:request_inference_time_seconds") == (1, 1.5)
    assert histogram(found, "vllm:e2e_request_latency_seconds") == (1, 2.25)
    assert histogram(found, "vllm:time_to_first_token_seconds") == (1, 1.0)
    assert histogram(found, "vllm:inter_token_latency_seconds") == (3, 1.0)  # gaps 0.25, 0.25, 0.5
    assert value(found, "vllm:inter_token_latency_seconds_bucket", le="0.3") == 2
    count, mean = histogram(found, "vllm:request_time_per_output_token_seconds")
    assert (count, mean) == (1, pytest.approx(1 / 3))
    assert histogram(found, "vllm:request_generation_tokens") == (1, 4)
    assert histogram(found, "vllm:request_prompt_tokens") == (1, 8)
    assert histogram(found, "vllm:request_params_max_tokens") == (1, 16)
    assert histogram(found, "vllm:request_params_n") == (1, 1)
    assert value(found, "vllm:request_success_total", finished_reason="length") == 1
    assert value(found, "vllm:generation_tokens_total") == 4
    assert value(found, "vllm:prompt_tokens_total") == 8


def test_a_request_aborted_before_its_first_token_counts_without_token_times() -> None:
    metrics = ServerMetrics("tiny", READY)
    metrics.on_window(window(1, 10.0, [decoding(0, "running")], waiting=1))
    metrics.on_request_finished(finished("queued", "abort", tokens=[]))
    found = scrape(metrics)
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 1
    assert histogram(found, "vllm:e2e_request_latency_seconds") == (1, 0.75)
    assert histogram(found, "vllm:request_generation_tokens") == (1, 0)
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
    ):
        assert histogram(found, name) == (0, 0), name
    assert value(found, "vllm:prompt_tokens_total") == 0
    assert value(found, "vllm:num_requests_waiting") == 0
    assert value(found, "vllm:num_requests_running") == 1


def test_each_request_is_counted_once_under_its_reason() -> None:
    metrics = ServerMetrics("tiny", READY)
    reasons = ["stop", "length", "length", "abort", "error", "stop", "abort"]
    for index, reason in enumerate(reasons):
        metrics.on_request_finished(finished(f"r{index}", reason, tokens=[] if reason == "error" else None))
    found = scrape(metrics)
    for reason in ("stop", "length", "abort", "error"):
        assert value(found, "vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert histogram(found, "vllm:e2e_request_latency_seconds")[0] == len(reasons)
    assert value(found, "vllm:generation_tokens_total") == 4 * (len(reasons) - 1)
    assert metrics.snapshot()["request_success_total"] == {
        r: reasons.count(r) for r in ("stop", "length", "abort", "error")
    }


def test_windows_set_slots_queue_kv_and_live_rate() -> None:
    metrics = ServerMetrics("tiny", READY)
    slots = [decoding(0, "a"), reading(2, "b")]
    metrics.on_window(
        window(1, 10.0, slots, rows=5, decode_tokens=1, prompt_tokens=4, finished=1, waiting=3, step_s=0.004)
    )
    metrics.on_window(
        window(2, 10.5, slots, rows=5, kv_blocks_used=25, waiting=2, preempted=1, step_s=0.006, host_s=0.001)
    )
    snap = metrics.snapshot()
    assert snap["num_requests_running"] == snap["live_slots"] == 2
    assert snap["num_requests_waiting"] == 2
    assert snap["kv_cache_usage_perc"] == 0.25
    assert snap["kv_blocks_used"] == 25
    assert snap["windows_total"] == 2
    assert snap["num_preemptions_total"] == 1
    assert snap["window_seconds"] == 0.5
    assert snap["live_tok_s"] == 3 / 1.0  # windows 10.0 .. 11.0 sampled 2 tokens, then 1
    assert snap["iteration_tokens_total"] == {"count": 2, "sum": 10}
    assert snap["window_step_seconds"] == {"count": 2, "sum": pytest.approx(0.010)}
    assert snap["window_host_seconds"] == {"count": 2, "sum": 0.001}
    assert [slot["state"] for slot in snap["slots"]] == ["decode", "idle", "prompt", "idle"]
    assert snap["slots"][2] == {
        "slot": 2,
        "state": "prompt",
        "request_id": "b",
        "context_tokens": 4,
        "output_tokens": 0,
        "prompt_tokens": 4,
        "prompt_total": 8,
        "tokens_per_window": 0.0,
        "grammar": False,
    }
    assert snap["slots"][0]["tokens_per_window"] == 1.0  # decoding, one token a window
    metrics.on_window(window(3, 20.0, slots))  # the windows before 15.5 drop out of the rate
    assert metrics.snapshot()["live_tok_s"] == 1 / 0.5


def test_prefix_cache_and_park_figures_come_from_the_windows() -> None:
    metrics = ServerMetrics("tiny", READY)
    parking = ParkingStats(3, 5, 1000, 9000, 2, 0.25, 4096)
    metrics.on_window(window(1, 1.0, [], prefix_cache_queries=1020, prefix_cache_hits=992, parking=parking))
    metrics.on_window(window(2, 2.0, [], prefix_cache_queries=1020, prefix_cache_hits=768))
    snap = metrics.snapshot()
    assert snap["prefix_cache_queries_total"] == 2040 and snap["prefix_cache_hits_total"] == 1760
    assert snap["parked_conversations_ram"] == 3 and snap["parked_conversations_disk"] == 5
    assert snap["parked_bytes_ram"] == 1000 and snap["parked_bytes_disk"] == 9000
    assert snap["park_restores_total"] == 2 and snap["park_restore_seconds_total"] == 0.25
    assert snap["park_copied_bytes_total"] == 4096
    text = generate_latest(metrics.registry).decode()
    assert 'strata:park_restores_total{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1760.0' in text


def test_finished_requests_free_their_slots_even_when_a_late_window_lists_them() -> None:
    metrics = ServerMetrics("tiny", READY)
    slots = [decoding(0, "a"), decoding(1, "b")]
    metrics.on_window(window(1, 10.0, slots))
    metrics.on_request_finished(finished("a", "abort"))
    metrics.on_window(window(2, 10.5, slots))  # ran before the engine read the abort
    snap = metrics.snapshot()
    assert snap["num_requests_running"] == 1
    assert [slot["state"] for slot in snap["slots"]] == ["idle", "decode", "idle", "idle"]
    metrics.on_request_finished(finished("b", "abort"))
    snap = metrics.snapshot()
    assert snap["num_requests_running"] == 0
    assert {slot["state"] for slot in snap["slots"]} == {"idle"}
    assert snap["kv_blocks_used"] == 0
    assert snap["live_tok_s"] == 0


def test_json_snapshot_equals_the_prometheus_values() -> None:
    metrics = ServerMetrics("tiny", READY)
    slots = [decoding(0, "a", output_tokens=5), reading(3, "b")]
    metrics.on_window(window(7, 10.0, slots, rows=9, finished=1, waiting=2, kv_blocks_used=30, preempted=2))
    metrics.on_request_finished(finished("c", "stop"))
    metrics.on_request_finished(finished("d", "abort", tokens=[101.0]))
    snap = metrics.snapshot()
    found = scrape(metrics)
    for name in VLLM_SCALARS:
        assert value(found, name, **LABELS) == snap[name.removeprefix("vllm:")], name
    for key in STRATA_SCALARS:
        assert value(found, f"strata:{key}", **LABELS) == snap[key], key
    for reason, count in snap["request_success_total"].items():
        assert value(found, "vllm:request_success_total", finished_reason=reason) == count
    states = {"idle": 0, "prompt": 1, "decode": 2}
    for slot in snap["slots"]:
        index = str(slot["slot"])
        assert value(found, "strata:slot_state", slot=index) == states[slot["state"]]
        assert value(found, "strata:slot_context_tokens", slot=index) == slot["context_tokens"]
        assert value(found, "strata:slot_output_tokens", slot=index) == slot["output_tokens"]
    for name in HISTOGRAMS:
        count, total = histogram(found, name)
        assert snap[name.partition(":")[2]] == {"count": count, "sum": total}, name
    assert snap["parallel"] == 4 and snap["kv_blocks_total"] == 100 and snap["windows_total"] == 7


def test_http_requests_are_counted_by_route_template_and_status_class() -> None:
    metrics = ServerMetrics("tiny", READY)
    metrics.record_http("/v1/chat/completions", "POST", 200, 0.3)
    metrics.record_http("/v1/chat/completions", "POST", 400, 0.01)
    found = scrape(metrics)
    route = {"handler": "/v1/chat/completions", "method": "POST"}
    assert value(found, "http_requests_total", **route, status="2xx") == 1
    assert value(found, "http_requests_total", **route, status="4xx") == 1
    assert value(found, "http_request_duration_seconds_count", **route) == 2
    assert [s.labels["le"] for s in found if s.name == "http_request_duration_seconds_bucket"] == [
        "0.1",
        "0.5",
        "1.0",
        "+Inf",
    ]


@get("/items/{item:int}", sync_to_thread=False)
def _item(item: FromPath[int]) -> dict[str, int]:
    return {"item": item}


def _app(api_key: str | None = None, with_metrics: bool = True) -> Litestar:
    app = Litestar(
        [_item, metrics_route],
        middleware=[http_metrics_middleware],
        state=State({"settings": ServerSettings(api_key=api_key)}),
    )
    if with_metrics:
        app.state.metrics = ServerMetrics("tiny", READY)
    return app


def test_metrics_route_answers_prometheus_text_or_json() -> None:
    with TestClient(_app()) as client:
        text = [({"Accept": "text/plain"}, ""), ({}, "?format=prometheus"), ({"Accept": "*/*"}, "")]
        text += [({"Accept": "text/html,*/*"}, ""), ({"Accept": "application/json"}, "?format=prometheus")]
        for headers, query in text:
            answer = client.get(f"/metrics{query}", headers=headers)
            assert answer.status_code == 200
            assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert value(samples(answer.text), "vllm:num_requests_running") == 0
        scraper = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        assert client.get("/metrics", headers={"Accept": scraper}).text.startswith("# HELP")
        for headers, query in [
            ({"Accept": "application/json"}, ""),
            ({"Accept": "application/json, */*;q=0.5"}, ""),
            ({"Accept": "text/plain"}, "?format=json"),
        ]:
            answer = client.get(f"/metrics{query}", headers=headers)
            assert answer.headers["content-type"] == "application/json"
            assert answer.json()["num_requests_running"] == 0
        assert client.get("/metrics?format=xml").status_code == 400
        assert (
            client.get("/schema/openapi.json")
            .json()["paths"]["/metrics"]["get"]["summary"]
            .startswith("Server metrics")
        )


def test_metrics_route_needs_the_key_when_one_is_set() -> None:
    with TestClient(_app(api_key="k")) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_middleware_counts_routed_requests_and_tolerates_missing_metrics() -> None:
    app = _app()
    with TestClient(app) as client:
        client.get("/items/3")
        client.get("/items/4")
        found = scrape(app.state.metrics)
        assert value(found, "http_requests_total", handler="/items/{item}", method="GET", status="2xx") == 2
    with TestClient(_app(with_metrics=False)) as client:
        assert client.get("/items/3").json() == {"item": 3}


# HTTP tests against a real `strata serve` (conftest's `server` has 4 slots).


def _json(server: Server) -> dict[str, Any]:
    answer = httpx.get(f"{server.url}/metrics?format=json", headers=server.headers(), timeout=10)
    answer.raise_for_status()
    return answer.json()


def _prometheus(server: Server) -> list[Sample]:
    answer = httpx.get(
        f"{server.url}/metrics", headers={"Accept": "text/plain", **server.headers()}, timeout=10
    )
    answer.raise_for_status()
    return samples(answer.text)


def _chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def _complete(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers(), timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_served_metrics_agree_in_both_formats(server: Server) -> None:
    found = _prometheus(server)
    snap = _json(server)
    for key in ("num_requests_running", "num_requests_waiting"):
        assert value(found, f"vllm:{key}") == snap[key]
    query = httpx.get(f"{server.url}/metrics?format=prometheus", timeout=10)
    assert query.headers["content-type"].startswith("text/plain")
    assert value(samples(query.text), "strata:parallel") == 4


def test_completed_requests_are_counted(server: Server) -> None:
    before = _prometheus(server)
    count, max_tokens = 3, 6
    for index in range(count):
        _complete(server, _chat(f"count me {index}", max_tokens))
    after = _prometheus(server)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == count
    assert grew("vllm:generation_tokens_total") == count * max_tokens
    assert grew("vllm:request_generation_tokens_sum") == count * max_tokens
    assert grew("vllm:time_to_first_token_seconds_count") == count
    assert grew("vllm:prompt_tokens_total") > 0
    chat = {"handler": "/v1/chat/completions", "method": "POST", "status": "2xx"}
    assert grew("http_requests_total", **chat) == count


def test_concurrent_requests_are_all_counted(server: Server) -> None:
    before = _json(server)

    async def three() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            bodies = [_chat(f"together {index}", 8) for index in range(3)]
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            assert [a.status_code for a in answers] == [200] * 3

    asyncio.run(three())
    after = _json(server)
    assert after["request_success_total"]["length"] - before["request_success_total"]["length"] == 3
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 24
    assert after["e2e_request_latency_seconds"]["count"] - before["e2e_request_latency_seconds"]["count"] == 3


def test_metrics_need_the_key_on_a_keyed_server(keyed_server: Server) -> None:
    assert httpx.get(f"{keyed_server.url}/metrics", timeout=10).status_code == 401
    answer = httpx.get(f"{keyed_server.url}/metrics", headers=keyed_server.headers(), timeout=10)
    assert answer.status_code == 200
    assert value(samples(answer.text), "vllm:num_requests_running") == 0


def test_streams_closed_mid_answer_free_every_slot(server: Server) -> None:
    probe = _chat("The same question, asked twice.", 24)
    solo = _complete(server, probe)["choices"][0]["message"]["content"]
    before = _json(server)
    picks = random.Random(7)

    async def hang_up(client: httpx.AsyncClient, index: int, lines: int) -> None:
        body = _chat(f"stream {index} " * (index % 5 + 1), 400, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            assert answer.status_code == 200
            read = 0
            async for line in answer.aiter_lines():
                read += line.startswith("data:")
                if read >= lines:
                    break

    async def twenty() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(hang_up(client, index, picks.randint(1, 12)) for index in range(20)))

    asyncio.run(twenty())
    deadline = time.monotonic() + 5
    snap = _json(server)
    while (snap["num_requests_running"] or snap["num_requests_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        snap = _json(server)
    assert snap["num_requests_running"] == 0
    assert {slot["state"] for slot in snap["slots"]} == {"idle"}
    assert snap["kv_blocks_used"] == 0
    assert snap["request_success_total"]["abort"] - before["request_success_total"]["abort"] == 20
    assert _complete(server, probe)["choices"][0]["message"]["content"] == solo


def test_routed_expert_entries_are_counted_by_where_they_ran() -> None:
    """`strata:expert_routed_total{source}` adds up the engine's expert reports: vram for experts in device
    memory, cpu for those in host RAM (an expert tier's misses, or a CPU engine); the tier's swaps too."""
    metrics = ServerMetrics("tiny", READY)
    usage = ExpertUsage(
        layers=[1, 3], routed=[[4, 0, 2], [1, 5, 0]], location=[[0, 1, 1], [0, 1, 1]], seconds=1.0, swaps=3
    )
    metrics.on_window(window(1, time.time(), [decoding(0, "a")], experts=usage))
    metrics.on_window(window(2, time.time(), [decoding(0, "a")], experts=usage))
    found = scrape(metrics)
    assert total(found, "strata:expert_routed_total", source="vram") == 10
    assert total(found, "strata:expert_routed_total", source="cpu") == 14
    assert total(found, "strata:expert_routed_total", source="pcie") == 0
    assert value(found, "strata:expert_routed_total", layer="3", source="cpu") == 10  # 5 a report
    assert metrics.values()["expert_routed_total"] == {"vram": 10, "cpu": 14, "pcie": 0}
    assert value(found, "strata:expert_swaps_total") == 6  # 3 reported with each window


def test_kv_block_reads_are_counted_by_where_the_blocks_live() -> None:
    """With `--kv-resident` each window reports the KV blocks it read from VRAM and from host RAM, and those
    it moved between them; /metrics adds them up (the reads' ratio is the hit rate)."""
    metrics = ServerMetrics("tiny", READY)
    metrics.on_window(window(1, time.time(), [decoding(0, "a")], kv_vram_reads=30, kv_host_reads=10))
    moved = {"kv_moved_to_device": 7, "kv_moved_to_host": 3}
    metrics.on_window(
        window(2, time.time(), [decoding(0, "a")], kv_vram_reads=31, kv_host_reads=10, replayed=True, **moved)
    )
    paced = {"prompt_tokens": 4, "decode_tokens": 1, "step_s": 0.5, "charged_s": 0.2, "cost_s": 0.3}
    metrics.on_window(window(3, time.time(), [reading(1, "b")], **paced))
    metrics.on_window(window(4, time.time(), [decoding(0, "a")], decode_tokens=1, step_s=0.05, cost_s=0.02))
    found = scrape(metrics)
    assert value(found, "strata:windows_replayed_total") == 1  # of 4
    assert value(found, "strata:decode_windows_total") == 1  # the last alone held decode rows only
    assert value(found, "strata:decode_window_seconds_total") == pytest.approx(0.02)
    assert value(found, "strata:paced_windows_total") == 1  # the prompt window charged to the decoding slot
    assert value(found, "strata:paced_window_predicted_seconds_total") == pytest.approx(0.2)
    assert value(found, "strata:paced_window_seconds_total") == pytest.approx(0.3)
    assert value(found, "strata:kv_vram_block_reads_total") == 61
    assert value(found, "strata:kv_host_block_reads_total") == 20
    assert value(found, "strata:kv_blocks_moved_to_device_total") == 7
    assert value(found, "strata:kv_blocks_moved_to_host_total") == 3
    assert metrics.values()["kv_host_block_reads_total"] == 20


def test_a_tiers_own_counts_of_where_entries_ran_and_its_pcie_bytes_are_added_up() -> None:
    """A tier counts each window's entries where they ran (a missed expert may go over PCIe one window and
    to the CPU the next), the bytes it copied to the device, and how long windows waited for its swaps."""
    metrics = ServerMetrics("tiny", READY)
    usage = ExpertUsage(
        layers=[1],
        routed=[[4, 4]],
        location=[[0, 1]],
        seconds=1.0,
        served=[[4, 1, 3]],
        pcie_bytes=300,
        adapt_wait_s=0.25,
    )
    metrics.on_window(window(1, time.time(), [decoding(0, "a")], experts=usage))
    metrics.on_window(window(2, time.time(), [decoding(0, "a")], experts=usage))
    found = scrape(metrics)
    assert metrics.values()["expert_routed_total"] == {"vram": 8, "cpu": 2, "pcie": 6}
    assert value(found, "strata:expert_routed_total", layer="1", source="pcie") == 6
    assert value(found, "strata:expert_pcie_bytes_total") == 600
    assert value(found, "strata:expert_adapt_wait_seconds_total") == 0.5


def test_each_stage_of_a_split_reports_its_busy_and_waiting_seconds() -> None:
    metrics = ServerMetrics("tiny", READY)
    metrics.on_window(window(1, time.time(), [decoding(0, "a")]))
    assert not [s for s in scrape(metrics) if s.name.startswith("strata:stage_")]  # no split
    two = [StageTimes(busy_s=0.25, wait_s=0.5), StageTimes(busy_s=0.75, wait_s=0.0)]
    metrics.on_window(window(2, time.time(), [decoding(0, "a")], stages=two))
    metrics.on_window(window(3, time.time(), [decoding(0, "a")], stages=two))
    found = scrape(metrics)
    assert value(found, "strata:stage_busy_seconds_total", stage="0") == 0.5
    assert value(found, "strata:stage_busy_seconds_total", stage="1") == 1.5
    assert value(found, "strata:stage_wait_seconds_total", stage="0") == 1.0
    assert metrics.values()["stages"][1] == {"stage": 1, "busy_seconds_total": 1.5, "wait_seconds_total": 0.0}


class _Sampled:
    """A system sampler stand-in holding one sample."""

    def __init__(self, latest: dict[str, Any]) -> None:
        self.latest = latest


def test_cards_host_and_processes_come_from_the_systems_latest_sample() -> None:
    """One series per card and figure (a figure the card does not report is left out), the host's CPU and
    RAM, the server's and the engine's resident memory; no card series without cards."""
    host = {
        "cpu_percent": 50.0,
        "ram_used": 7,
        "ram_total": 9,
        "server_rss": 3,
        "engine_rss": 5,
        "cpu_count": 2,
    }
    card = {
        "index": 0,
        "name": "NVIDIA H200",
        "utilization": 93,
        "memory_used": 100,
        "memory_total": 141,
        "power_w": 650.5,
        "power_limit_w": 700.0,
        "temperature_c": None,
    }
    metrics = ServerMetrics("tiny", READY)
    assert not any(s.name.startswith("strata:host_") for s in scrape(metrics))  # nothing before a sample
    metrics.system = _Sampled(
        {"host": host, "gpus": {"cards": [card, {**card, "index": 1, "utilization": 0}]}}
    )
    found = scrape(metrics)
    assert value(found, "strata:host_cpu_ratio") == 0.5 and value(found, "strata:host_memory_used_bytes") == 7
    assert value(found, "process_resident_memory_bytes", process="engine") == 5
    card0 = [s for s in found if s.name == "strata:gpu_utilization_ratio" and s.labels["gpu"] == "0"]
    assert card0[0].labels["name"] == "NVIDIA H200" and card0[0].value == pytest.approx(0.93)
    assert value(found, "strata:gpu_utilization_ratio", gpu="1") == 0
    assert value(found, "strata:gpu_power_limit_watts", gpu="1") == 700.0
    assert not [s for s in found if s.name == "strata:gpu_temperature_celsius"]
    metrics.system = _Sampled({"host": host, "gpus": {"message": "No NVIDIA GPU found", "cards": []}})
    assert not any(s.name.startswith("strata:gpu_") for s in scrape(metrics))


def test_each_moe_layer_reports_its_resident_experts_and_busiest_share_and_per_expert_on_request() -> None:
    """Per layer: experts on the device and the busiest expert's share of the recent routing, as the
    Monitor's grid has them; per (layer, expert) only with per_expert."""
    usage = ExpertUsage(
        layers=[0, 2], routed=[[6, 2, 0, 0], [1, 1, 1, 1]], location=[[0, 1, 1, 1], [0, 0, 1, 1]], seconds=1.0
    )
    plain, detailed = ServerMetrics("tiny", READY), ServerMetrics("tiny", READY, per_expert=True)
    for metrics in (plain, detailed):
        metrics.on_window(window(1, time.time(), [decoding(0, "a")], experts=usage))
    found = scrape(plain)
    assert (
        value(found, "strata:expert_resident", layer="0") == 1
        and value(found, "strata:expert_resident", layer="2") == 2
    )
    assert value(found, "strata:expert_heat_max_share", layer="0") == 0.75
    assert value(found, "strata:expert_heat_max_share", layer="2") == 0.25
    assert plain.heat.grid()["max_share"] == 0.75  # what the Monitor's grid shows
    assert not [s for s in found if s.name in ("strata:expert_on_device", "strata:expert_heat_share")]
    found = scrape(detailed)
    assert value(found, "strata:expert_on_device", layer="2", expert="1") == 1
    assert value(found, "strata:expert_on_device", layer="2", expert="2") == 0
    assert value(found, "strata:expert_heat_share", layer="0", expert="1") == 0.25
    assert len([s for s in found if s.name == "strata:expert_heat_share"]) == 8


def test_drafts_count_by_window_and_position_and_their_tokens_in_the_live_speed() -> None:
    metrics = ServerMetrics("tiny", READY)
    now = time.time()
    metrics.on_window(window(1, now, [decoding(0, "a"), decoding(1, "b")], drafts=[(0, 3, 2), (1, 4, 0)]))
    metrics.on_window(window(2, now + 0.5, [decoding(0, "a"), decoding(1, "b")], drafts=[(0, 2, 1)]))
    found = scrape(metrics)
    assert value(found, "vllm:spec_decode_num_drafts_total") == 3
    assert value(found, "vllm:spec_decode_num_draft_tokens_total") == 9
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total") == 3
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(found, per_position, position=str(p)) for p in range(4)] == [2, 1, 0, 0]
    assert metrics.live_tok_s == (2 + 2 + 2 + 1) / 1.0  # a token a decoding slot and each accepted draft
    slots = metrics.values()["slots"]
    assert [slots[i]["tokens_per_window"] for i in range(3)] == [2.5, 1.0, 0.0]  # (3 + 2) / 2, 1, none
