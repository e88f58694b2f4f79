"""Running a real `strata serve` (server + engine process) for tests and tools, and keeping it busy."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.engine.client import AsyncEngineClient, EngineError
from app.engine.config import EngineConfig
from app.engine.protocol import Loading
from webui.settings import ServerSettings

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


def free_port() -> int:
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
    port = free_port()
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


GB = 10**9


def gated_start(gate: threading.Event, fail: str | None = None) -> Callable[..., object]:
    """A stand-in for `AsyncEngineClient.start` (monkeypatched in) that reports 3 of 8 GB loaded, waits for
    `gate`, then starts the real engine, or fails with `fail`: a load the test can hold and watch."""
    real = AsyncEngineClient.start

    async def start(config: EngineConfig, **kwargs: object) -> AsyncEngineClient:
        on_loading = kwargs["on_loading"]
        assert callable(on_loading)
        on_loading(Loading(3 * GB, 8 * GB))
        await asyncio.to_thread(gate.wait)
        if fail is not None:
            raise EngineError(fail)
        return await real(config, **kwargs)  # type: ignore[arg-type]

    return start


def loading_settings(model_dir: Path, port: int = 8000) -> ServerSettings:
    """Settings of an in-process server on `model_dir` (CPU, fp32, two slots)."""
    engine = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_memory=64 << 20, parallel=2)
    return ServerSettings(engine=engine, port=port)
