"""The browser's WebSockets: `/ws/chat` streams answers, `/ws/monitor` pushes the Monitor's frames.

Both refuse a connection before accepting it (close code 1008, which the handshake answers with HTTP 403)
when its Origin header names another host than its Host header (a page of another site), or when the
server has an API key and the connection does not carry it: as `Authorization: Bearer KEY`, or, from a
browser, which cannot set headers on a WebSocket, as the subprotocol `bearer.<KEY as unpadded base64url>`
offered beside `strata` (the server answers with `strata`, so the key is never echoed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from litestar.status_codes import WS_1008_POLICY_VIOLATION

from app.engine.client import EngineError
from app.engine.protocol import InvalidRequest, SamplingParams
from app.text.answer import AnswerParts, AnswerSplitter, opens_thinking
from app.text.chat_template import ChatTemplateError
from app.text.tokenizer import TokenizerError
from webui.auth import key_accepted
from webui.engine_link import EngineLink, RequestRecord, sampling_params
from webui.monitor import MonitorFeed, Viewer

logger = logging.getLogger(__name__)

SUBPROTOCOL = "strata"
BEARER_PREFIX = "bearer."
MONITOR_PUSH_S = 0.33  # about three frames a second
TRY_AGAIN_LATER = 1013  # the close code of a socket opened before the engine serves


def same_origin(socket: WebSocket) -> bool:
    """True when the Origin header is absent (not a browser) or names the host the request was sent to."""
    origin = socket.headers.get("origin")
    if origin is None:
        return True
    parts = urlsplit(origin)
    host = socket.headers.get("host", "")
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower() != ""


def offered_key(socket: WebSocket) -> str | None:
    """The API key a connection carries: the bearer token of its Authorization header or subprotocol."""
    scheme, _, token = socket.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for protocol in socket.scope.get("subprotocols", []):
        if protocol.startswith(BEARER_PREFIX):
            encoded = protocol.removeprefix(BEARER_PREFIX)
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, UnicodeDecodeError):
                return None
    return None


def authorized(socket: WebSocket) -> bool:
    """True when the server has no API key or the connection carries it."""
    return key_accepted(socket.app.state.settings.api_key, offered_key(socket))


async def admit(socket: WebSocket) -> bool:
    """Accept a same-origin, authorized connection; refuse any other with 1008 before accepting it."""
    if not same_origin(socket):
        reason = "cross-origin WebSocket connections are refused"
    elif not authorized(socket):
        reason = "invalid or missing API key"
    else:
        offered = socket.scope.get("subprotocols", [])
        await socket.accept(subprotocols=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        return True
    await socket.receive()  # the handshake's connect event
    await socket.close(code=WS_1008_POLICY_VIOLATION, reason=reason)
    return False


class ChatSettings(msgspec.Struct, forbid_unknown_fields=True):
    """Sampling settings a chat message may carry (the names of the OpenAI API)."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []


class ChatTurn(msgspec.Struct):
    """One message of a conversation."""

    role: Literal["system", "user", "assistant"]
    content: str


class ChatStart(msgspec.Struct, tag="chat", tag_field="type"):
    """Answer a conversation; the client picks the id that every reply about it carries."""

    id: str
    messages: list[ChatTurn]
    params: ChatSettings = msgspec.field(default_factory=ChatSettings)


class ChatStop(msgspec.Struct, tag="stop", tag_field="type"):
    """Stop an answer: the engine request is aborted and a `done` with finish_reason "abort" follows."""

    id: str


ChatCommand = ChatStart | ChatStop
_decoder = msgspec.json.Decoder(ChatCommand)


@dataclass
class _Answer:
    """One answer being streamed: its task, its request's record in the link, tokens so far."""

    task: asyncio.Task[None] | None = None
    record: RequestRecord | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    ended: bool = False
    splitter: AnswerSplitter | None = None  # its reasoning, content and tool calls, apart


def _done(answer_id: str, answer: _Answer, finish_reason: str | None) -> dict[str, Any]:
    """The `done` message: why the answer ended, its token counts, time to first token and decode speed."""
    ttft_s = tok_s = None
    record = answer.record
    if record is not None and record.token_times:
        first, last = record.token_times[0], record.token_times[-1]
        ttft_s = first - record.arrival
        if len(record.token_times) > 1 and last > first:
            tok_s = (len(record.token_times) - 1) / (last - first)
    usage = {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.tokens,
        "total_tokens": answer.prompt_tokens + answer.tokens,
    }
    return {
        "type": "done",
        "id": answer_id,
        "finish_reason": finish_reason,
        "usage": usage,
        "ttft_s": ttft_s,
        "tok_s": tok_s,
    }


class ChatSession:
    """One `/ws/chat` connection: answers stream concurrently, every message leaves through one queue."""

    def __init__(self, socket: WebSocket, link: EngineLink) -> None:
        self.socket = socket
        self.link = link
        self.answers: dict[str, _Answer] = {}
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message for the client."""
        self.outbox.put_nowait(message)

    async def write(self) -> None:
        """Send queued messages in order until the connection closes."""
        while True:
            message = await self.outbox.get()
            await self.socket.send_data(msgspec.json.encode(message).decode())

    async def handle(self, raw: str) -> None:
        """Act on one client message."""
        try:
            command = _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            self.send({"type": "error", "id": _loose_id(raw), "message": f"invalid message: {exc}"})
            return
        if isinstance(command, ChatStop):
            await self.stop(command.id)
        elif command.id in self.answers:
            self.send({"type": "error", "id": command.id, "message": "an answer with this id is running"})
        else:
            answer = _Answer()
            self.answers[command.id] = answer
            answer.task = asyncio.create_task(self._answer(command, answer))

    async def stop(self, answer_id: str) -> None:
        """Abort an answer (closing its engine stream) and report it done with finish_reason "abort"."""
        answer = self.answers.get(answer_id)
        if answer is None or answer.ended or answer.task is None:
            return
        answer.ended = True
        answer.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer.task
        self.answers.pop(answer_id, None)
        self.send(_done(answer_id, answer, "abort"))

    async def _answer(self, start: ChatStart, answer: _Answer) -> None:
        try:
            prompt, params = await self._request(start)
            answer.prompt_tokens = len(prompt)
            answer.splitter = AnswerSplitter(opens_thinking(self.link.decode_special, prompt))
            async with aclosing(self.link.stream(prompt, params)) as outputs:
                async for output in outputs:
                    if answer.record is None:
                        answer.record = self.link.running.get(output.request_id)
                    answer.tokens += len(output.token_ids)
                    if output.text:
                        self._parts(start.id, answer.splitter.feed(output.text))
                    if output.finished:
                        self._parts(start.id, answer.splitter.finish())
                        answer.ended = True
                        if output.finish_reason == "error":
                            self.send({"type": "error", "id": start.id, "message": output.error or "failed"})
                        else:
                            self.send(_done(start.id, answer, output.finish_reason))
        except (InvalidRequest, ChatTemplateError, TokenizerError) as exc:
            self.send({"type": "error", "id": start.id, "message": str(exc)})
        except EngineError as exc:
            self.send({"type": "error", "id": start.id, "message": f"the engine failed: {exc}"})
        except Exception as exc:
            logger.exception("chat answer %s failed", start.id)
            self.send({"type": "error", "id": start.id, "message": f"internal error: {type(exc).__name__}"})
        finally:
            answer.ended = True
            if self.answers.get(start.id) is answer:
                del self.answers[start.id]

    def _parts(self, answer_id: str, parts: AnswerParts) -> None:
        """Send what a piece of the answer adds: `reasoning` and `delta` (content) text, `tool_call`s."""
        if parts.reasoning:
            self.send({"type": "reasoning", "id": answer_id, "text": parts.reasoning})
        if parts.content:
            self.send({"type": "delta", "id": answer_id, "text": parts.content})
        for call in parts.tool_calls or []:
            call_view = {"id": call.id, "name": call.name, "arguments": call.arguments}
            self.send({"type": "tool_call", "id": answer_id, "call": call_view})

    async def _request(self, start: ChatStart) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the engine's parameters, checked against the model."""
        if self.link.dead:
            raise EngineError(self.link.dead)
        if not start.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        turns = [{"role": turn.role, "content": turn.content} for turn in start.messages]
        prompt = await self.link.encode_chat(turns, True)
        settings = start.params
        params = sampling_params(
            self.link,
            prompt,
            settings.max_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            min_p=settings.min_p,
            seed=settings.seed,
            presence_penalty=settings.presence_penalty,
            frequency_penalty=settings.frequency_penalty,
            repetition_penalty=settings.repetition_penalty,
            stop=settings.stop,
        )
        return prompt, params

    async def close(self) -> None:
        """The client left: abort every answer still running."""
        tasks = [answer.task for answer in self.answers.values() if answer.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _loose_id(raw: str) -> str | None:
    """The `id` of a message that did not decode, when it has one."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    answer_id = value.get("id") if isinstance(value, dict) else None
    return answer_id if isinstance(answer_id, str) else None


async def _loaded(socket: WebSocket) -> bool:
    """Whether the engine serves; if not (it still loads), the socket is closed with 1013 (try again
    later), as the pages' sockets do by themselves."""
    if getattr(socket.app.state, "link", None) is not None:
        return True
    await socket.close(code=TRY_AGAIN_LATER, reason=socket.app.state.loading.describe()[:120])
    return False


@websocket("/ws/chat")
async def chat_socket(socket: WebSocket) -> None:
    """Chat: `{type: chat, id, messages, params}` and `{type: stop, id}` in; `delta` (content), `reasoning`,
    `tool_call`, `done`, `error` out."""
    if not await admit(socket) or not await _loaded(socket):
        return
    session = ChatSession(socket, socket.app.state.link)
    writer = asyncio.create_task(session.write())
    try:
        while True:
            await session.handle(await socket.receive_text())
    except WebSocketDisconnect:
        pass
    finally:
        await session.close()
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)  # a send to a client gone may have failed


@websocket("/ws/monitor")
async def monitor_socket(socket: WebSocket) -> None:
    """Monitor: a JSON frame about three times a second until the client leaves (its messages are ignored)."""
    if not await admit(socket) or not await _loaded(socket):
        return
    feed: MonitorFeed = socket.app.state.monitor
    viewer = Viewer()
    gone = asyncio.Event()

    async def watch() -> None:
        try:
            while True:
                await socket.receive_data("text")
        except WebSocketDisconnect:
            gone.set()

    watcher = asyncio.create_task(watch())
    try:
        while not gone.is_set():
            started = time.monotonic()
            frame = await feed.frame_for(viewer)
            await socket.send_data(msgspec.json.encode(frame).decode())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), max(0.0, MONITOR_PUSH_S - (time.monotonic() - started)))
    except (WebSocketDisconnect, OSError):
        pass
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


LIVE_ROUTES = [chat_socket, monitor_socket]
