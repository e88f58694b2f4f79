"""The server's link to the engine process: streams requests, and records every request's life for metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.engine.client import AsyncEngineClient, EngineError
from app.engine.protocol import (
    InvalidRequest,
    Ready,
    RequestOutput,
    SamplingParams,
    WindowStats,
    check_request,
)
from app.text.tokenizer import Tokenizer

log = logging.getLogger("strata.server")
RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # seconds before each further try to start a new engine


@dataclass
class RequestRecord:
    """One request's timeline and sizes, as the server saw it (times are `time.time()` seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    scheduled: float | None = None  # start of the first window that ran it
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    finished: float | None = None

    @property
    def generation_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_times)

    @property
    def first_token(self) -> float | None:
        """When its first token arrived."""
        return self.token_times[0] if self.token_times else None


class RequestObserver(Protocol):
    """What watches the engine through the link: every window's stats and every request that ends."""

    def on_window(self, stats: WindowStats) -> None:
        """A window ran."""

    def on_request_finished(self, record: RequestRecord) -> None:
        """A request ended (finished, aborted, failed, or its client went away)."""

    def count_features(self, features: list[str]) -> None:
        """A request asked for these features (tools, structured output, thinking)."""


class EngineLink:
    """Owns the engine client and the tokenizer; every request goes through `stream`, so each is counted.

    With `supervise` running, an engine process that dies is replaced by a new one (the requests it held end
    with an error; parked conversations on disk come back with the new engine).
    """

    def __init__(self, client: AsyncEngineClient, model_name: str, observer: RequestObserver) -> None:
        self.client = client
        self.ready: Ready = client.ready
        self.model_name = model_name
        self.tokenizer = Tokenizer.load(client.ready.model_path)
        self.observer = observer
        self.running: dict[str, RequestRecord] = {}
        self.restarts = 0  # engines started after the first one died
        self._stopping = False
        client.add_stats_listener(self._on_window)

    async def supervise(
        self,
        start: Callable[[], Awaitable[AsyncEngineClient]],
        started: Callable[[AsyncEngineClient], None] | None = None,
        poll: float = 0.25,
    ) -> None:
        """Watch the engine; when its process dies, start a new one with `start` (then call `started` with
        it), retrying after each of RESTART_DELAYS (the last repeated) while starting fails. Runs until
        cancelled or `shutdown`."""
        while not self._stopping:
            await asyncio.sleep(poll)
            reason = self.client.dead
            if reason is None or self._stopping:
                continue
            log.warning("the engine stopped (%s); starting a new one", reason)
            await self.client.shutdown()  # reap the old process
            client = await self._start_again(start)
            if self._stopping:
                await client.shutdown()
                return
            client.add_stats_listener(self._on_window)
            self.client, self.ready = client, client.ready
            self.restarts += 1
            if started is not None:
                started(client)
            log.warning("a new engine serves (restart %d)", self.restarts)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, on a worker thread: a long prompt never holds up the other streams."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of `messages` rendered with the chat template, on a worker thread as `encode`."""
        return await asyncio.to_thread(
            self.tokenizer.encode_chat, messages, add_generation_prompt, **template_kwargs
        )

    def decode_special(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    @property
    def dead(self) -> str | None:
        """Why the engine can take no more requests, or None while it runs."""
        return self.client.dead

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; leaving early (a client gone) aborts it in the engine.

        Raises InvalidRequest for values the engine would refuse and EngineError when the engine fails.
        """
        stream = self.client.submit(prompt_token_ids, params)
        record = RequestRecord(stream.request_id, time.time(), len(prompt_token_ids), params.max_tokens, n)
        self.running[record.request_id] = record
        try:
            async for output in stream:
                now = time.time()
                record.token_times.extend([now] * len(output.token_ids))
                if output.finished:
                    record.finish_reason = output.finish_reason
                yield output
        except EngineError:
            record.finish_reason = "error"
            raise
        finally:
            if record.finish_reason is None:
                stream.abort()
                record.finish_reason = "abort"
            record.finished = time.time()
            if record.scheduled is None:  # it ended within its first window
                record.scheduled = record.first_token or record.finished
            del self.running[record.request_id]
            self.observer.on_request_finished(record)

    @staticmethod
    async def _start_again(start: Callable[[], Awaitable[AsyncEngineClient]]) -> AsyncEngineClient:
        """A new engine from `start`, trying again after each of RESTART_DELAYS (the last repeated)."""
        attempt = 0
        while True:
            try:
                return await start()
            except Exception as e:
                delay = RESTART_DELAYS[min(attempt, len(RESTART_DELAYS) - 1)]
                log.warning("a new engine did not start (%s); trying again in %.0f s", e, delay)
                await asyncio.sleep(delay)
                attempt += 1

    def _on_window(self, stats: WindowStats) -> None:
        for slot in stats.slots:
            record = self.running.get(slot.request_id)
            if record is not None and record.scheduled is None:
                record.scheduled = stats.started
        self.observer.on_window(stats)

    async def shutdown(self) -> None:
        """Stop the engine process (and no longer replace it)."""
        self._stopping = True
        await self.client.shutdown()


def context_tokens(link: EngineLink) -> int:
    """The most tokens one request may hold: the model's context, or less when the KV pool is smaller."""
    ready = link.ready
    return min(ready.max_model_len, ready.kv_blocks_total * ready.block_size)


def sampling_params(
    link: EngineLink, prompt: list[int], max_tokens: int | None, **fields: Any
) -> SamplingParams:
    """The engine's parameters for `prompt`, checked against the model (an InvalidRequest names the field).

    Every route builds them here; `max_tokens` None means as many as the context leaves (at least one).
    """
    context = context_tokens(link)
    limit = max_tokens if max_tokens is not None else max(1, context - len(prompt))
    params = SamplingParams(max_tokens=limit, **fields)
    check_request(prompt, params, link.ready.vocab_size, context)
    if params.spec_tokens and link.ready.drafts is not None:
        raise InvalidRequest(f"spec_tokens: {link.ready.drafts}", "spec_tokens")
    return params
