"""The engine process dies mid-answer: the client hears within seconds, /health says so, and the server
starts a new engine by itself, which answers and finds the conversations parked on disk."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
from serving import start_server, stop_server

GREEDY = {"temperature": 0, "max_tokens": 12}


def _engine_pid(server_pid: int) -> int:
    """The engine process: the server's child that loads the model (the only Python child that lives)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = [c for c in psutil.Process(server_pid).children() if "python" in c.name().lower()]
        if children:
            return children[-1].pid
        time.sleep(0.2)
    raise AssertionError("the server has no engine process")


def _healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def test_a_killed_engine_fails_its_streams_fast_and_is_replaced(model_dir: Path, tmp_path: Path) -> None:
    park = tmp_path / "park"
    server = start_server(model_dir, "--park-dir", str(park), "--park-memory", "0", "--park-disk", "64MiB")
    try:
        url = server.url
        first = httpx.post(f"{url}/v1/completions", json={"prompt": "one two three", **GREEDY}, timeout=60)
        assert first.status_code == 200
        old = _engine_pid(server.process.pid)
        events: list[dict] = []
        ended: list[float] = []

        def stream() -> None:
            body = {
                "prompt": "count",
                "max_tokens": 3000,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
            ended.append(time.monotonic())

        reader = threading.Thread(target=stream)
        reader.start()
        while not events:
            time.sleep(0.05)
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        reader.join(timeout=30)
        assert ended and ended[0] - killed < 5.0
        assert events[-1]["error"]["type"] == "service_unavailable"
        assert _healthy(url, 120), "no new engine within 120 s"
        assert _engine_pid(server.process.pid) != old
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "one two three", **GREEDY}, timeout=60)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # the first answer's conversation, written before the kill, is known to the new engine
        assert list(park.glob("*.park"))
        assert httpx.get(f"{url}/metrics?format=json", timeout=10).json()["parked_conversations_disk"] >= 1
    finally:
        stop_server(server)
