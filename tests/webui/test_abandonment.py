"""Streams cut at random points (while connecting, during the prompt, after some tokens; the API's SSE streams
and the chat WebSocket's answers) beside requests that run to their end: no answer gets another request's
tokens, and once the cut ones are gone every slot is idle, nothing is queued, and the engine's counters add
up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from typing import Any

import httpx
from serving import Server
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

COMPLETIONS = "/v1/completions"
CUT_STREAMS = int(os.environ.get("STRATA_CUT_STREAMS", "120"))  # 1000 for the long run (docs/RELIABILITY.md)
GREEDY = {"temperature": 0, "ignore_eos": True}


async def _cut(client: httpx.AsyncClient, server: Server, body: dict[str, Any], rng: random.Random) -> bool:
    """One stream left at a random point; True when its request reached the server (headers came back)."""
    events = rng.choice([0, 0, 1, 3, 8])  # 0: leave before any token, maybe while its prompt is read
    reached = False

    async def read() -> None:
        nonlocal reached
        async with client.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}) as response:
            reached = True
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= events > 0:
                    return

    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        await asyncio.wait_for(read(), timeout=rng.uniform(0.001, 0.05) if events == 0 else 30)
    return reached


async def _cut_chat(server: Server, prompt: str, rng: random.Random) -> bool:
    """One chat answer over /ws/chat whose socket is dropped at a random point; True when the server took
    the message (at least one answer message came back)."""
    deltas = rng.choice([0, 0, 1, 3, 8])
    reached = False

    async def read() -> None:
        nonlocal reached
        url = server.url.replace("http://", "ws://") + "/ws/chat"
        async with connect(url, origin=server.url, open_timeout=30) as socket:
            chat = {"type": "chat", "id": "cut", "messages": [{"role": "user", "content": prompt}]}
            await socket.send(json.dumps({**chat, "params": {"max_tokens": 64, "temperature": 0}}))
            seen = 0
            async for _ in socket:
                reached = True
                seen += 1
                if seen >= deltas > 0:
                    socket.transport.abort()  # gone without a closing handshake
                    return

    with contextlib.suppress(TimeoutError, OSError, WebSocketException):
        await asyncio.wait_for(read(), timeout=rng.uniform(0.001, 0.05) if deltas == 0 else 30)
    return reached


def _metrics(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/metrics?format=json", timeout=10).json()


def test_streams_cut_anywhere_leak_nothing_and_free_everything(server: Server) -> None:
    rng = random.Random(19)
    words = [
        "the",
        "river",
        "town",
        "woke",
        "slowly",
        "under",
        "a",
        "grey",
        "sky",
        "while",
        "boats",
        "drifted",
    ]
    canaries = [
        {"prompt": f"canary {i}: {' '.join(words[i:])}", "max_tokens": 24, **GREEDY} for i in range(4)
    ]
    solo = [
        httpx.post(server.url + COMPLETIONS, json=c, timeout=60).json()["choices"][0]["text"]
        for c in canaries
    ]
    before = _metrics(server)["request_success_total"]

    async def chaos() -> tuple[list[str], list[bool]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            prompts = [" ".join(rng.choices(words, k=rng.randint(4, 600))) for _ in range(CUT_STREAMS)]
            cut = [
                asyncio.create_task(
                    _cut_chat(server, prompt, rng)
                    if i % 4 == 3
                    else _cut(client, server, {"prompt": prompt, "max_tokens": 64, **GREEDY}, rng)
                )
                for i, prompt in enumerate(prompts)
            ]
            answers = await asyncio.gather(*(client.post(server.url + COMPLETIONS, json=c) for c in canaries))
            return [a.json()["choices"][0]["text"] for a in answers], list(await asyncio.gather(*cut))

    answers, reached_each = asyncio.run(chaos())
    reached = sum(reached_each)
    assert any(reached_each[3::4]) and any(r for i, r in enumerate(reached_each) if i % 4 != 3)  # both kinds
    assert answers == solo  # no token of a cut request in another's answer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = _metrics(server)
        if not metrics["num_requests_running"] and not metrics["num_requests_waiting"]:
            break
        time.sleep(0.2)
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
    assert all(slot["state"] == "idle" for slot in metrics["slots"])
    after = metrics["request_success_total"]
    ended = sum(after.values()) - sum(before.values())
    assert ended >= reached + len(canaries) and after["error"] == before["error"]
    assert after["length"] - before["length"] >= len(canaries)
    again = httpx.post(server.url + COMPLETIONS, json=canaries[0], timeout=60).json()["choices"][0]["text"]
    assert again == solo[0]
