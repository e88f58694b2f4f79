"""The engine process: builds a Core, then serves one client over a Unix socket until it leaves or says stop.

An input thread decodes client messages into a queue; the main thread applies them and runs windows,
blocking on the queue only while there is no work, and sends each window's outputs and stats in order.
"""

from __future__ import annotations

import contextlib
import importlib
import queue
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn, Protocol

import msgspec

from app.engine.config import EngineConfig
from app.engine.pinned import pin_by_registering
from app.engine.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    EngineFailed,
    Loading,
    Ready,
    RequestOutput,
    Shutdown,
    WindowStats,
)
from app.engine.transport import Connection
from app.errors import StrataError
from app.loading import progress

DEFAULT_CORE = "app.engine.core:EngineCore"


class Core(Protocol):
    """What the engine process drives: the scheduler, model runner and sampler behind five calls."""

    def ready(self) -> Ready:
        """The handshake sent once the model is loaded."""

    def add_request(self, request: AddRequest, /) -> list[RequestOutput]:
        """Queue a request; returns outputs due at once (a rejection: finished with finish_reason error)."""

    def abort_request(self, request_id: str, /) -> list[RequestOutput]:
        """Stop a request; returns its final output with finish_reason abort, or nothing if it is unknown."""

    def has_work(self) -> bool:
        """Whether any request is running or waiting."""

    def step(self) -> tuple[list[RequestOutput], WindowStats | None]:
        """Run one window; the stats of the window whose tokens it handed out, if any."""


def run_engine(core_factory: str, config_bytes: bytes, address: str) -> None:
    """Process entry point: connect to the client at `address`, build the core, send Ready, then serve.

    `core_factory` is "module:callable", called with the decoded EngineConfig; while it loads, the loader's
    progress goes to the client as Loading messages. When the core cannot be built
    or fails later, the client gets EngineFailed and the process exits with status 1; it exits with status 0
    after Shutdown or when the client's connection closes. SIGINT is left to the client, which owns the
    engine's lifetime.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_by_registering()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    conn = Connection(sock, ClientMessage)
    progress.listen(lambda done, total, label: conn.send(Loading(done, total, label)))
    try:
        core = _load_factory(core_factory)(msgspec.msgpack.decode(config_bytes, type=EngineConfig))
        conn.send(core.ready())
    except Exception as exc:
        _fail(conn, exc)
    serve(core, conn)
    close = getattr(core, "close", None)  # optional: work to finish before exit (EngineCore: park files)
    if callable(close):
        close()
    conn.close()


def serve(core: Core, conn: Connection) -> None:
    """Apply client messages and run windows until Shutdown or the client leaves; fail fast on any error."""
    inbox: queue.SimpleQueue[ClientMessage | None] = queue.SimpleQueue()
    threading.Thread(target=_pump, args=(conn, inbox), name="strata-engine-input", daemon=True).start()
    stopping = False
    try:
        while not stopping:
            messages = _take(inbox, block=not core.has_work())
            if None in messages:
                return
            stopping = any(isinstance(message, Shutdown) for message in messages)
            if not _send(conn, [output for message in messages for output in _apply(core, message)]):
                return
            if core.has_work():
                outputs, stats = core.step()
                if not _send(conn, [*outputs, stats] if stats is not None else outputs):
                    return
    except Exception as exc:
        _fail(conn, exc)


def _load_factory(spec: str) -> Callable[[EngineConfig], Core]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _pump(conn: Connection, inbox: queue.SimpleQueue[ClientMessage | None]) -> None:
    """Input thread: queue every client message, then None once the connection ends."""
    try:
        for message in conn:
            inbox.put(message)
    finally:
        inbox.put(None)


def _take(inbox: queue.SimpleQueue[ClientMessage | None], block: bool) -> list[ClientMessage | None]:
    """Every queued message; with `block`, waits for the first one."""
    messages = [inbox.get()] if block else []
    with contextlib.suppress(queue.Empty):
        while True:
            messages.append(inbox.get_nowait())
    return messages


def _apply(core: Core, message: ClientMessage | None) -> list[RequestOutput]:
    if isinstance(message, AddRequest):
        return core.add_request(message)
    if isinstance(message, AbortRequest):
        return core.abort_request(message.request_id)
    return []


def _send(conn: Connection, messages: list[RequestOutput | WindowStats]) -> bool:
    """Send messages if there are any; False when the client has gone."""
    try:
        if messages:
            conn.send(*messages)
    except OSError:
        return False
    return True


def _fail(conn: Connection, exc: Exception) -> NoReturn:
    """Tell the client why the engine cannot go on (one line), then exit with status 1."""
    if not isinstance(exc, StrataError):
        traceback.print_exception(exc)
    text = str(exc) if isinstance(exc, StrataError) else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(OSError):
        conn.send(EngineFailed(" ".join(text.split())))
    conn.close()
    sys.exit(1)
