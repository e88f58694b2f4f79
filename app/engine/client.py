"""Clients of the engine process: start it, submit requests, stream their outputs, and notice its death.

Both clients share one machinery: the engine is a spawned process connected over a Unix socket; a reader
thread routes its messages (outputs to per-request streams, window stats to listeners) and a watcher thread
waits for the process to exit, then fails every open stream with its exit status, so no caller hangs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from app.engine.config import EngineConfig
from app.engine.process import DEFAULT_CORE, run_engine
from app.engine.protocol import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineMessage,
    InvalidRequest,
    Loading,
    PositionLogprobs,
    Ready,
    RequestOutput,
    SamplingParams,
    Shutdown,
    WindowStats,
    check_request,
)
from app.engine.transport import Connection
from app.errors import StrataError

logger = logging.getLogger(__name__)
CANCEL_POLL_S = 0.25  # how often a start that waits for the engine looks whether it was cancelled

EOF_GRACE_S = 1.0  # after the process exits, how long its last messages may take to arrive
EXIT_GRACE_S = 3.0  # after the connection ends, how long the process may take to exit before it is killed
KILL_GRACE_S = 2.0  # after SIGTERM, how long before SIGKILL


class EngineError(StrataError):
    """The engine failed to start, died, or failed a request; the message is one line."""


Item = RequestOutput | EngineError


@dataclass
class Completion:
    """A whole request's result, collected from its stream."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        """Append one output of the request."""
        self.token_ids += output.token_ids
        self.text += output.text
        self.logprobs += output.logprobs
        self.finish_reason = output.finish_reason or self.finish_reason
        self.prompt_tokens = output.prompt_tokens or self.prompt_tokens


class _Stream:
    """What both kinds of request stream share: the id, abort, and turning items into outputs or errors."""

    def __init__(self, client: _BaseClient, request_id: str) -> None:
        self.request_id = request_id
        self._client = client
        self._done = False

    def abort(self) -> None:
        """Ask the engine to stop this request; the stream then ends with finish_reason "abort"."""
        self._client.abort(self.request_id)

    def _output(self, item: Item) -> RequestOutput:
        if isinstance(item, EngineError):
            self._done = True
            raise item
        self._done = item.finished
        if item.finish_reason == "error":
            raise EngineError(item.error or "the engine failed the request")
        return item


class RequestStream(_Stream):
    """The outputs of one request, in order; ends after the finished one, raises EngineError on failure."""

    def __init__(self, client: _BaseClient, request_id: str) -> None:
        super().__init__(client, request_id)
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def _put(self, item: Item) -> None:
        self._queue.put(item)

    def __iter__(self) -> RequestStream:
        """The stream itself."""
        return self

    def __next__(self) -> RequestOutput:
        """The next output; blocks until the engine sends it."""
        if self._done:
            raise StopIteration
        return self._output(self._queue.get())


class AsyncRequestStream(_Stream):
    """RequestStream for asyncio: `async for` over the outputs of one request, with the same error rules."""

    def __init__(self, client: _BaseClient, request_id: str) -> None:
        super().__init__(client, request_id)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def _put(self, item: Item) -> None:
        _call_soon(self._loop, self._queue.put_nowait, item)

    def __aiter__(self) -> AsyncRequestStream:
        """The stream itself."""
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output; waits until the engine sends it."""
        if self._done:
            raise StopAsyncIteration
        return self._output(await self._queue.get())


StreamT = TypeVar("StreamT", RequestStream, AsyncRequestStream)


class _BaseClient:
    """Starts the engine process and routes its messages; the process and socket machinery of both clients."""

    def __init__(
        self,
        config: EngineConfig,
        core_factory: str,
        startup_timeout: float,
        on_loading: Callable[[Loading], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.last_stats: WindowStats | None = None
        self._on_loading = on_loading
        self._cancel = cancel or threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, Callable[[Item], None]] = {}
        self._listeners: list[Callable[[WindowStats], None]] = []
        self._failure: str | None = None  # the message of the engine's EngineFailed
        self._dead: str | None = None  # why no request can be submitted any more
        self._closing = False
        self._exited = threading.Event()
        self._drained = threading.Event()
        self._conn: Connection | None = None
        socket_dir = tempfile.mkdtemp(prefix="strata-engine-")
        try:
            self.ready: Ready = self._launch(config, core_factory, startup_timeout, socket_dir)
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
        atexit.register(self._close_connection)  # so that the engine exits before multiprocessing joins it
        self._reader = threading.Thread(target=self._read, name="strata-engine-reader", daemon=True)
        self._reader.start()

    def _launch(self, config: EngineConfig, core_factory: str, timeout: float, socket_dir: str) -> Ready:
        """Spawn the engine, accept its connection and return its Ready; clean up and raise if it fails."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            address = os.path.join(socket_dir, "engine.sock")
            listener.bind(address)
            listener.listen(1)
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_engine,
                args=(core_factory, msgspec.msgpack.encode(config), address),
                name="strata-engine",
                daemon=False,
            )
            self._process.start()
            self._watcher = threading.Thread(target=self._watch, name="strata-engine-exit", daemon=True)
            self._watcher.start()
            try:
                return self._handshake(listener, timeout)
            except BaseException:
                self._stop(KILL_GRACE_S)
                self._close_connection()
                self._drained.set()
                raise

    @property
    def dead(self) -> str | None:
        """Why no request can be submitted any more (the engine exited, failed, was shut down), or None."""
        return self._dead

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit status; None while it runs."""
        return self._process.exitcode if self._exited.is_set() else None

    def add_stats_listener(self, listener: Callable[[WindowStats], None]) -> None:
        """Call `listener` with every window's stats (in the reader thread; keep it quick)."""
        self._listeners.append(listener)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; its stream ends with finish_reason "abort" (no-op once dead)."""
        with contextlib.suppress(OSError):
            self._conn.send(AbortRequest(request_id))

    def _handshake(self, listener: socket.socket, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        self._await(listener, deadline, timeout)
        self._conn = Connection(listener.accept()[0], EngineMessage)
        self._await(self._conn.sock, deadline, timeout)
        message = self._conn.receive()
        while isinstance(message, Loading):
            if self._on_loading is not None:
                self._on_loading(message)
            if not self._conn.buffered:
                self._await(self._conn.sock, deadline, timeout)
            message = self._conn.receive()
        if isinstance(message, Ready):
            return message
        if isinstance(message, EngineFailed):
            raise EngineError(message.message)
        self._exited.wait(EXIT_GRACE_S)
        raise EngineError(self._exit_message())

    def _await(self, source: socket.socket, deadline: float, timeout: float) -> None:
        """Wait until `source` is readable; raise EngineError if the engine exits first, time runs out or
        the start is cancelled."""
        while True:
            left = deadline - time.monotonic()
            waited = max(0.0, min(left, CANCEL_POLL_S))
            ready = multiprocessing.connection.wait([source, self._process.sentinel], waited)
            if source in ready:
                return
            if ready:
                break
            if self._cancel.is_set():
                raise EngineError("the engine's start was cancelled")
            if left <= 0:
                raise EngineError(f"the engine did not start within {timeout:g} s")
        self._exited.wait()
        raise EngineError(self._exit_message())

    def _read(self) -> None:
        """Reader thread: route messages until the connection ends; kill an engine that outlives it."""
        try:
            for message in self._conn:
                self._dispatch(message)
        finally:
            self._drained.set()
            if not self._closing and not self._exited.wait(EXIT_GRACE_S):
                self._process.kill()

    def _dispatch(self, message: EngineMessage) -> None:
        if isinstance(message, RequestOutput):
            with self._lock:
                if message.finished:
                    put = self._streams.pop(message.request_id, None)
                else:
                    put = self._streams.get(message.request_id)
            if put is not None:
                put(message)
        elif isinstance(message, WindowStats):
            self.last_stats = message
            for listener in list(self._listeners):
                try:
                    listener(message)
                except Exception:
                    logger.exception("engine stats listener failed")
        elif isinstance(message, EngineFailed):
            with self._lock:
                self._failure = self._dead = message.message

    def _watch(self) -> None:
        """Watcher thread: wait for the process to exit, let its last messages arrive, fail open streams."""
        self._process.join()
        self._exited.set()
        if not self._drained.wait(EOF_GRACE_S):
            self._close_connection()
            self._drained.wait()
        message = self._exit_message()
        with self._lock:
            self._dead = message
            puts = list(self._streams.values())
            self._streams.clear()
        for put in puts:
            put(EngineError(message))

    def _exit_message(self) -> str:
        if self._closing:
            return "the engine was shut down"
        message = f"engine process exited with status {self._process.exitcode}"
        return f"{message}: {self._failure}" if self._failure else message

    def _open(self, stream: StreamT, prompt_token_ids: list[int], params: SamplingParams) -> StreamT:
        """Check a request, register its stream and send it to the engine."""
        prompt = self._checked_prompt(prompt_token_ids, params)
        with self._lock:
            if self._dead:
                raise EngineError(self._dead)
            if stream.request_id in self._streams:
                raise InvalidRequest(f"request_id {stream.request_id!r} is already running", "request_id")
            self._streams[stream.request_id] = stream._put
        try:
            self._conn.send(AddRequest(stream.request_id, prompt, params, arrival_time=time.time()))
        except OSError as exc:
            with self._lock:
                self._streams.pop(stream.request_id, None)
            raise EngineError(self._dead or "lost the connection to the engine") from exc
        return stream

    def _checked_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as plain ints; raises InvalidRequest for what the engine would refuse."""
        return check_request(prompt_token_ids, params, self.ready.vocab_size, self.ready.max_model_len)

    def _shutdown(self, timeout: float) -> None:
        """Send Shutdown, wait for the process (then terminate, then kill) and the threads; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._dead = self._dead or "the engine was shut down"
        with contextlib.suppress(OSError):
            self._conn.send(Shutdown())
        self._stop(timeout)
        self._close_connection()
        atexit.unregister(self._close_connection)
        self._watcher.join()
        self._reader.join()

    def _stop(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to exit, then terminate it, then kill it."""
        if not self._exited.wait(timeout):
            self._process.terminate()
            if not self._exited.wait(KILL_GRACE_S):
                self._process.kill()
                self._exited.wait()

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()


class EngineClient(_BaseClient):
    """Blocking client of the engine process, for the CLI, bench and tests; use `start`, then `shutdown`."""

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        core_factory: str = DEFAULT_CORE,
        startup_timeout: float = 600.0,
        on_loading: Callable[[Loading], None] | None = None,
    ) -> EngineClient:
        """Spawn the engine, wait for Ready (`client.ready`; `on_loading` is called with each Loading
        message before it); raises EngineError if it fails to start."""
        return cls(config, core_factory, startup_timeout, on_loading)

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Start a request; raises InvalidRequest for bad values, EngineError once the engine is gone."""
        return self._open(RequestStream(self, request_id or uuid.uuid4().hex), prompt_token_ids, params)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> Completion:
        """Run a request to its end and return everything it produced."""
        stream = self.submit(prompt_token_ids, params)
        completion = Completion(stream.request_id)
        for output in stream:
            completion.add(output)
        return completion

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine after its current window (terminate, then kill, after `timeout`); idempotent."""
        self._shutdown(timeout)

    def __enter__(self) -> EngineClient:
        """The client itself."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Shut the engine down."""
        self.shutdown()


class AsyncEngineClient(_BaseClient):
    """Asyncio client of the engine process, for the web server; use `await start(...)`, then `shutdown`."""

    _loop: asyncio.AbstractEventLoop

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        core_factory: str = DEFAULT_CORE,
        startup_timeout: float = 600.0,
        on_loading: Callable[[Loading], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> AsyncEngineClient:
        """Spawn the engine in a worker thread and wait for Ready (`on_loading` is called in that thread
        with each Loading message before it); raises EngineError if it fails to start or `cancel` is set
        first (the engine is then stopped)."""
        client = await asyncio.to_thread(cls, config, core_factory, startup_timeout, on_loading, cancel)
        client._loop = asyncio.get_running_loop()
        return client

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncRequestStream:
        """Start a request (call from the event loop); same checks and errors as EngineClient.submit."""
        return self._open(AsyncRequestStream(self, request_id or uuid.uuid4().hex), prompt_token_ids, params)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> Completion:
        """Run a request to its end and return everything it produced."""
        stream = self.submit(prompt_token_ids, params)
        completion = Completion(stream.request_id)
        async for output in stream:
            completion.add(output)
        return completion

    def add_stats_listener(self, listener: Callable[[WindowStats], None]) -> None:
        """Call `listener` on the event loop with every window's stats."""
        loop = self._loop
        super().add_stats_listener(lambda stats: _call_soon(loop, listener, stats))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine after its current window (terminate, then kill, after `timeout`); idempotent."""
        await asyncio.to_thread(self._shutdown, timeout)

    async def __aenter__(self) -> AsyncEngineClient:
        """The client itself."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Shut the engine down."""
        await self.shutdown()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """Schedule `callback` on `loop` from another thread; nothing happens once the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
