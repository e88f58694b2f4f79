"""The server while its engine loads: /health, the API, /metrics and the pages say so; then it serves."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient
from serving import gated_start, loading_settings

from app.engine.client import AsyncEngineClient
from webui.app import create_app


def _wait_healthy(client: TestClient, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = client.get("/health")
        if answer.status_code == 200:
            return answer
        time.sleep(0.1)
    raise AssertionError("the engine did not come up")


def test_while_the_engine_loads_every_route_says_how_far_then_it_serves(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    monkeypatch.setattr(AsyncEngineClient, "start", gated_start(gate))
    with TestClient(create_app(loading_settings(model_dir))) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        assert health.json()["status"] == "loading" and health.json()["share"] == 0.375
        chat = client.post(
            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        assert chat.status_code == 503
        error = chat.json()["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"] == "the model is not ready: loading 38% (3.0 of 8.0 GB)"
        assert client.get("/v1/models").status_code == 503 and client.get("/metrics").status_code == 503
        for path, wanted in (("/", "chat"), ("/monitor", "monitor")):
            page = client.get(path)
            assert page.status_code == 200 and "/static/loading.js" in page.text
            assert f"becomes the {wanted}" in page.text and 'aria-valuenow="38"' in page.text
        with pytest.raises(Exception) as refused, client.websocket_connect("/ws/monitor") as socket:
            socket.receive_text()
        assert getattr(refused.value, "code", None) == 1013
        gate.set()
        assert _wait_healthy(client).json()["status"] == "ok"
        assert "/static/chat.js" in client.get("/").text
        assert client.get("/v1/models").status_code == 200


def test_an_engine_that_cannot_start_is_reported_and_stops_the_server(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    gate.set()
    monkeypatch.setattr(AsyncEngineClient, "start", gated_start(gate, fail="out of memory"))
    failures: list[str] = []
    with TestClient(create_app(loading_settings(model_dir), on_failed=failures.append)) as client:
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures == ["out of memory"]
        health = client.get("/health").json()
        assert health["status"] == "failed" and health["message"] == "the engine did not start: out of memory"
        assert "did not start: out of memory" in client.get("/v1/models").json()["error"]["message"]
