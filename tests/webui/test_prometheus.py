"""The monitoring kit against a real Prometheus: docs/monitoring/prometheus.yml scrapes a running
`strata serve` (an API key, a two-stage split, an expert tier, drafts) with the key as a bearer token, and
every PromQL expression of docs/monitoring/grafana-dashboard.json is answered with data through Prometheus'
HTTP API."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from checkpoints import write_checkpoint
from serving import API_KEY, start_server, stop_server

KIT = Path(__file__).resolve().parents[2] / "docs" / "monitoring"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Prometheus (.ci/run installs it)"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expressions() -> list[str]:
    dashboard = json.loads((KIT / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _answered(prometheus: str, expr: str) -> bool:
    """Whether `expr` gives at least one series with a finite value now."""
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", (expr, answer)
    return any(math.isfinite(float(r["value"][1])) for r in answer["data"]["result"])


def test_prometheus_scrapes_the_server_and_answers_every_dashboard_query(tmp_path: Path) -> None:
    dashboard = json.loads((KIT / "grafana-dashboard.json").read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    first = dashboard["panels"][
        1 : 1 + next(i for i, p in enumerate(dashboard["panels"][1:]) if p["type"] == "row")
    ]
    assert len(rows) == 2 and all("strata:" not in t["expr"] for p in first for t in p["targets"])
    model = write_checkpoint(tmp_path / "model", "qwen3_moe")
    options = ("--layer-split", "2", "--expert-cache", "2", "--adapt-every", "2", "--spec", "ngram")
    options += ("--kv-resident", "48")
    server = start_server(model, *options, api_key=API_KEY)
    prometheus_process = None
    stop = threading.Event()
    workers: list[threading.Thread] = []
    try:
        (tmp_path / "key").write_text(API_KEY + "\n")
        config = yaml.safe_load((KIT / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        job = config["scrape_configs"][0]
        job["authorization"]["credentials_file"] = str(tmp_path / "key")
        job["static_configs"] = [{"targets": [server.url.removeprefix("http://")]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _port()
        prometheus_process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        prometheus = f"http://127.0.0.1:{port}"
        name = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"][0]["id"]

        def traffic() -> None:  # requests going on all along, so that every rate has something to count
            body = {"model": name, "messages": [{"role": "user", "content": "count: 1 2 3 1 2 3 1 2"}]}
            while not stop.is_set():
                try:
                    httpx.post(
                        f"{server.url}/v1/chat/completions",
                        headers=server.headers(),
                        json={**body, "max_tokens": 12},
                        timeout=60,
                    )
                except httpx.HTTPError:
                    return  # the server is going away at the end of the test

        workers += [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
        for worker in workers:
            worker.start()
        missing = _expressions()
        deadline = time.monotonic() + 60
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            try:
                missing = [e for e in missing if not _answered(prometheus, e)]
            except httpx.HTTPError:
                continue  # Prometheus still starting
        assert not missing, f"no data for: {missing}"
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"]
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
        if prometheus_process is not None:
            prometheus_process.terminate()
            prometheus_process.wait(timeout=30)
        stop_server(server)
