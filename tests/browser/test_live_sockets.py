"""The WebSockets: same origin only, the API key when the server has one, chat replies and aborts."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
from serving import Server
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

PATHS = ["/ws/chat", "/ws/monitor"]


def _ws(server: Server, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def _refused(server: Server, path: str, **options: object) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws(server, path), open_timeout=30, **options)
    assert refused.value.response.status_code == 403


def _first_frame(socket: ClientConnection) -> dict:
    frame = json.loads(socket.recv(timeout=30))
    assert frame["type"] == "frame"
    return frame


@pytest.mark.parametrize("path", PATHS)
def test_cross_origin_is_refused(live_server: Server, path: str) -> None:
    _refused(live_server, path, origin="http://evil.example")
    _refused(live_server, path, origin=live_server.url.replace("127.0.0.1", "localhost"))


def test_same_origin_is_accepted(live_server: Server) -> None:
    with connect(_ws(live_server, "/ws/monitor"), origin=live_server.url, open_timeout=30) as socket:
        frame = _first_frame(socket)
    assert frame["metrics"]["parallel"] == 4
    assert len(frame["metrics"]["slots"]) == 4
    assert {"cpu_percent", "ram_used", "ram_total"} <= frame["host"].keys()
    assert "history" in frame


def test_chat_socket_streams_and_reports_errors(live_server: Server) -> None:
    with connect(_ws(live_server, "/ws/chat"), origin=live_server.url, open_timeout=30) as socket:
        socket.send(json.dumps({"type": "chat", "id": "bad", "messages": [], "params": {}}))
        assert json.loads(socket.recv(timeout=30)) == {
            "type": "error",
            "id": "bad",
            "message": "messages must not be empty",
        }
        messages = [{"role": "user", "content": "Hi"}]
        chat = {
            "type": "chat",
            "id": "a",
            "messages": messages,
            "params": {"temperature": 0, "max_tokens": 3},
        }
        socket.send(json.dumps(chat))
        replies = []
        while not replies or replies[-1]["type"] == "delta":
            replies.append(json.loads(socket.recv(timeout=120)))
    done = replies[-1]
    assert done["type"] == "done" and done["id"] == "a"
    assert done["usage"]["completion_tokens"] == 3 or done["finish_reason"] == "stop"
    assert done["ttft_s"] > 0
    assert "".join(reply["text"] for reply in replies[:-1])


def test_leaving_the_chat_socket_aborts_its_answer(live_server: Server) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    chat = {"type": "chat", "id": "long", "messages": messages, "params": {"max_tokens": 2000}}
    with connect(_ws(live_server, "/ws/chat"), origin=live_server.url, open_timeout=30) as socket:
        socket.send(json.dumps(chat))
        assert json.loads(socket.recv(timeout=120))["type"] == "delta"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{live_server.url}/metrics?format=json", timeout=10).json()
        if metrics["num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert metrics["num_requests_running"] == 0
    assert metrics["request_success_total"]["abort"] >= 1


@pytest.mark.parametrize("path", PATHS)
def test_keyed_server_refuses_a_connection_without_the_key(keyed_live_server: Server, path: str) -> None:
    _refused(keyed_live_server, path)
    _refused(keyed_live_server, path, additional_headers={"Authorization": "Bearer wrong"})
    _refused(keyed_live_server, path, subprotocols=["strata", "bearer.d3Jvbmc"])


def test_keyed_server_takes_the_key_as_header_or_subprotocol(keyed_live_server: Server) -> None:
    url = _ws(keyed_live_server, "/ws/monitor")
    key = keyed_live_server.api_key
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30) as socket:
        _first_frame(socket)
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    with connect(url, subprotocols=["strata", f"bearer.{encoded}"], open_timeout=30) as socket:
        assert socket.subprotocol == "strata"
        _first_frame(socket)


def test_the_monitor_and_metrics_show_one_sample_of_the_host_and_processes(live_server: Server) -> None:
    """Both read the system sampler's latest sample: a frame and a scrape taken between two equal frames
    agree exactly; without NVIDIA cards no card series appear."""
    from prometheus_client.parser import text_string_to_metric_families

    with connect(_ws(live_server, "/ws/monitor"), origin=live_server.url, open_timeout=30) as socket:
        for _ in range(5):
            before = _first_frame(socket)["host"]
            text = httpx.get(f"{live_server.url}/metrics", headers={"Accept": "text/plain"}, timeout=30).text
            if _first_frame(socket)["host"] == before:
                break
        else:
            pytest.fail("the sample changed under every scrape")
    found = {
        (sample.name, sample.labels.get("process")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found["strata:host_cpu_ratio", None] == pytest.approx(before["cpu_percent"] / 100)
    assert found["strata:host_memory_used_bytes", None] == before["ram_used"]
    assert found["strata:host_memory_total_bytes", None] == before["ram_total"]
    assert found["process_resident_memory_bytes", "server"] == before["server_rss"] > 0
    assert found["process_resident_memory_bytes", "engine"] == before["engine_rss"] > 0
    assert not any(name.startswith("strata:gpu_") for name, _ in found)
