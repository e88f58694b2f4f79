"""A real `strata serve` process (server + engine) on a tiny checkpoint, for HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from checkpoints import write_checkpoint

API_KEY = "test-key-123"


@dataclass
class Server:
    """A running server: where it listens, its key, the model directory, its process."""

    url: str
    api_key: str | None
    model_dir: Path
    process: subprocess.Popen

    def headers(self) -> dict[str, str]:
        """Headers that pass the API-key check."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, *extra: str, api_key: str | None = None) -> Server:
    """Start `strata serve` and wait until /health answers 200 (or fail with its output)."""
    port = _free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--dtype", "float32", "--kv-memory", "64MiB", *extra]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"strata serve exited: {process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(url, api_key, model_dir, process)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("strata serve did not become healthy in 180 s")


def stop_server(server: Server) -> None:
    """Ctrl+C the server and wait for it (and its engine) to exit."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next checkpoint with a tokenizer and chat template."""
    return write_checkpoint(tmp_path_factory.mktemp("served"), "qwen3_next", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[Server]:
    """An open server (no API key), 4 slots."""
    running = start_server(model_dir, "--parallel", "4")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def keyed_server(model_dir: Path) -> Iterator[Server]:
    """A server that requires API_KEY."""
    running = start_server(model_dir, api_key=API_KEY)
    yield running
    stop_server(running)


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
