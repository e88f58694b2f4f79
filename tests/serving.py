"""Running a real `strata serve` (server + engine process) for tests and tools, and keeping it busy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key-123"


@dataclass
class Server:
    """A running server: where it listens, its key, the model directory, its process."""

    url: str
    api_key: str | None
    model_dir: Path | None
    process: subprocess.Popen

    def headers(self) -> dict[str, str]:
        """Headers that pass the API-key check."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: Path | None,
    *extra: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Server:
    """Start `strata serve` (None: the default model; `env` and `cwd` for its process where given) and wait
    until /health answers 200 (or fail)."""
    port = _free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    command += ["--dtype", "float32", "--kv-memory", "64MiB", *extra]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
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


@contextmanager
def streaming_requests(url: str, count: int, headers: dict[str, str] | None = None) -> Iterator[None]:
    """`count` long streamed chat requests running; leaving the block closes them (which aborts them)."""
    release = threading.Event()
    failures: list[BaseException] = []

    def run(index: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Tell story number {index}"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300
            ) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    if release.is_set():
                        return
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=120)
    if failures:
        raise RuntimeError(f"busy requests failed: {failures}")


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")  # requests to the local server never go via a proxy
