"""A real `strata serve --expert-cache` on a tiny checkpoint: the same greedy answers as the server with
every expert resident, and `/metrics` counting where routed entries ran, the tier's swaps, and (with
`--metrics-per-expert`) where each expert lives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, start_server, stop_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiered_server(model_dir: Path) -> Iterator[Server]:
    """Two experts a layer on the device, the rest in host RAM, adapting every 2 windows; a series per
    expert in /metrics."""
    running = start_server(
        model_dir, "--parallel", "2", "--expert-cache", "2", "--adapt-every", "2", "--metrics-per-expert"
    )
    yield running
    stop_server(running)


def _answer(server: Server, content: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _expert_counters(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers={"Accept": "text/plain"}, timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "strata:expert_routed_total":  # summed over the layers
                found[sample.labels["source"]] = found.get(sample.labels["source"], 0) + sample.value
            elif sample.name in ("strata:expert_swaps_total", "strata:expert_pcie_bytes_total"):
                found[sample.name] = sample.value
            elif sample.name in ("strata:expert_resident", "strata:expert_on_device"):
                found[sample.name] = found.get(sample.name, 0) + sample.value
    return found


def test_a_tiered_server_answers_like_the_all_resident_one_and_counts_its_experts(
    server: Server, tiered_server: Server
) -> None:
    prompt = "Name three rivers and the seas they reach."
    assert _answer(tiered_server, prompt, 24) == _answer(server, prompt, 24)
    deadline = time.monotonic() + 30
    counters = _expert_counters(tiered_server)
    while counters.get("cpu", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.6)  # the engine reports experts at most every 0.5 s, with a window
        _answer(tiered_server, "Go on.", 2)
        counters = _expert_counters(tiered_server)
    assert counters["cpu"] > 0 and counters["vram"] > 0 and counters["pcie"] == 0  # a CPU engine
    assert counters["strata:expert_swaps_total"] > 0 and counters["strata:expert_pcie_bytes_total"] == 0
    # 2 experts a layer on the device, counted per layer and per expert alike
    assert counters["strata:expert_resident"] == counters["strata:expert_on_device"] > 0
    assert counters["strata:expert_resident"] % 2 == 0
