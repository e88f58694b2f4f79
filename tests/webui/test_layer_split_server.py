"""A real `strata serve --layer-split 2` on a tiny checkpoint: the answers of the server that runs the model
whole, each stage's times in `/metrics`, and the Monitor's frame carrying them; the stages end with it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, start_server, stop_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def split_server(model_dir: Path) -> Iterator[Server]:
    running = start_server(model_dir, "--parallel", "4", "--layer-split", "2")
    yield running
    stop_server(running)


def _answer(server: Server, content: str) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _stage_busy(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers={"Accept": "text/plain"}, timeout=30).text
    return {
        sample.labels["stage"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "strata:stage_busy_seconds_total"
    }


async def _frame(server: Server) -> dict:
    origin = server.url
    async with websockets.connect(f"{origin.replace('http', 'ws')}/ws/monitor", origin=origin) as socket:
        return json.loads(await socket.recv())


def test_a_split_server_answers_like_the_whole_model_and_shows_its_stages(
    server: Server, split_server: Server
) -> None:
    prompts = ["Name three rivers.", "Count to five.", "What is a prime?"]
    assert [_answer(split_server, p) for p in prompts] == [_answer(server, p) for p in prompts]
    busy = _stage_busy(split_server)
    assert set(busy) == {"0", "1"} and all(seconds > 0 for seconds in busy.values())
    frame = asyncio.run(_frame(split_server))
    assert [stage["stage"] for stage in frame["stages"]] == [0, 1]


def test_the_stage_workers_end_with_the_server(split_server: Server) -> None:
    workers = psutil.Process(split_server.process.pid).children(recursive=True)
    assert len(workers) >= 2  # the engine process and its stage worker
    stop_server(split_server)
    deadline = time.monotonic() + 15
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers):
        assert time.monotonic() < deadline, "a process of the split outlived the server"
        time.sleep(0.2)
