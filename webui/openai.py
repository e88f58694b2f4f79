"""The OpenAI-compatible routes: chat and text completions (whole or streamed), models, (de)tokenize."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from litestar import Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema
from litestar.response import Stream

from app.engine.client import EngineError
from app.engine.protocol import Grammar, InvalidRequest, PositionLogprobs, RequestOutput, SamplingParams
from app.text.answer import AnswerParts, AnswerSplitter, ToolCall, opens_thinking
from app.text.chat_template import ChatTemplateError
from app.text.tokenizer import TokenizerError
from webui.auth import require_api_key
from webui.engine_link import EngineLink, context_tokens, sampling_params
from webui.errors import ApiError, ErrorDetail, ErrorResponse
from webui.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    Model,
    ModelList,
    SamplingRequest,
    TextCompletion,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from webui.structured import request_grammar, tool_choice_grammar

logger = logging.getLogger(__name__)

STARTED = int(time.time())
EVENT_STREAM = "text/event-stream"
MAX_CHOICES = 16  # `n` at most: each choice is a request of its own in the engine
MAX_PROMPTS = 64  # prompts of one batched completion request at most
STREAM_HEADERS = {
    "content-type": f"{EVENT_STREAM}; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
STREAM_DESCRIPTION = (
    "With `stream: true` the answer comes as server-sent events (text/event-stream): `data: <chunk JSON>` "
    "events, each followed by a blank line, where a chunk has the shape of the {chunk} object; the last "
    "chunk carries `finish_reason`; with `stream_options.include_usage` one more chunk has no choices and "
    'the usage; then `data: [DONE]`. An engine failure mid-stream sends `data: {{"error": {{...}}}}` and '
    "ends the stream."
)

EVENTS_SCHEMA_DESCRIPTION = "`data: <chunk JSON>` events (see the operation), then `data: [DONE]`"

_ERROR_RESPONSES = {
    status: ResponseSpec(ErrorResponse, description=description, generate_examples=False)
    for status, description in {
        400: "Invalid request: malformed JSON, a wrong type or value (`param` names the field), an "
        "unsupported option, or a prompt too long for the context",
        401: "Missing or wrong API key",
        404: "Unknown model (code `model_not_found`)",
        503: "The engine is not running",
    }.items()
}


@dataclass
class _EventStreamOperation(Operation):
    """An operation whose 200 answer is JSON, or server-sent events when the request asks for a stream."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            events = Schema(type=OpenAPIType.STRING, description=EVENTS_SCHEMA_DESCRIPTION)
            ok.content = {**(ok.content or {}), EVENT_STREAM: OpenAPIMediaType(schema=events)}


class _Reply(ABC):
    """How one request's answer is written, whole or as stream chunks; chat and text completions differ.

    `top_logprobs` is None when the request did not ask for log-probabilities.
    """

    prefix: ClassVar[str]

    def __init__(self, link: EngineLink, top_logprobs: int | None) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = link.model_name
        self.tokenizer = link.tokenizer
        self.wants_logprobs = top_logprobs is not None
        self.index = 0  # the choice this reply writes (a request with `n` > 1 has a reply a choice)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def opening(self) -> list[msgspec.Struct]:
        """Chunks sent before any text."""
        return []

    @abstractmethod
    def piece(self, text: str, positions: list[PositionLogprobs]) -> list[msgspec.Struct]:
        """The stream chunks with new text (and its tokens' log-probabilities): none while what the text
        is stays open (a tag's start)."""

    @abstractmethod
    def end(self, finish_reason: str | None) -> list[msgspec.Struct]:
        """The stream chunks that end the answer: what was held back, then why it ended."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """The stream chunk with no choices and the usage."""

    @abstractmethod
    def whole(
        self, text: str, positions: list[PositionLogprobs], finish_reason: str | None, usage: Usage
    ) -> msgspec.Struct:
        """The non-streamed answer."""


class _ChatReply(_Reply):
    """`chat.completion` answers and `chat.completion.chunk` stream chunks; the answer's reasoning and
    tool-call blocks (app/text/answer.py) go to `reasoning_content` and `tool_calls`."""

    prefix = "chatcmpl"

    def __init__(self, link: EngineLink, top_logprobs: int | None, thinking: bool, tools: bool) -> None:
        super().__init__(link, top_logprobs)
        self.splitter = AnswerSplitter(thinking, tools)

    def _logprobs(self, positions: list[PositionLogprobs]) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        content = []
        for position in positions:
            top = [self._top(entry.token_id, entry.logprob) for entry in position.top]
            chosen = self._top(position.chosen.token_id, position.chosen.logprob)
            content.append(TokenLogprob(chosen.token, chosen.logprob, chosen.bytes, top))
        return ChatLogprobs(content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(text, logprob, list(text.encode()))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | msgspec.UnsetType) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, choices, usage=usage)

    def opening(self) -> list[msgspec.Struct]:
        """The first chunk: the assistant's role and empty content."""
        return [
            self._chunk([ChatChunkChoice(self.index, ChatDelta("assistant", ""), None, None)], msgspec.UNSET)
        ]

    def piece(self, text: str, positions: list[PositionLogprobs]) -> list[msgspec.Struct]:
        """The deltas of what the text adds: content, reasoning, tool calls."""
        return self._deltas(self.splitter.feed(text), self._logprobs(positions))

    def _deltas(self, parts: AnswerParts, logprobs: ChatLogprobs | None) -> list[msgspec.Struct]:
        if not parts and logprobs is None:
            return []
        first = self.splitter.calls - len(parts.tool_calls or [])
        calls = [
            ToolCallDelta(first + i, call.id, FunctionCall(name=call.name, arguments=call.arguments))
            for i, call in enumerate(parts.tool_calls or [])
        ]
        delta = ChatDelta(
            content=parts.content or None,
            reasoning_content=parts.reasoning or None,
            tool_calls=calls or None,
        )
        return [self._chunk([ChatChunkChoice(self.index, delta, logprobs, None)], msgspec.UNSET)]

    def end(self, finish_reason: str | None) -> list[msgspec.Struct]:
        """What was held back, then an empty delta with the finish reason."""
        held = self._deltas(self.splitter.finish(), None)
        reason = _with_tools(finish_reason, self.splitter.calls)
        return [*held, self._chunk([ChatChunkChoice(self.index, ChatDelta(), None, reason)], msgspec.UNSET)]

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """No choices, and the usage."""
        return self._chunk([], usage)

    def whole(
        self, text: str, positions: list[PositionLogprobs], finish_reason: str | None, usage: Usage
    ) -> msgspec.Struct:
        """A `chat.completion`."""
        parts = self.splitter.feed(text)
        parts.add(self.splitter.finish())
        message = AssistantMessage(parts.content if parts.content or not parts.tool_calls else None)
        if parts.tool_calls:
            message.tool_calls = [_tool_call(call) for call in parts.tool_calls]
        if parts.reasoning:
            message.reasoning_content = parts.reasoning
        reason = _with_tools(finish_reason, self.splitter.calls)
        choice = ChatChoice(self.index, message, self._logprobs(positions), reason)
        return ChatCompletion(self.id, self.created, self.model, [choice], usage)


def _tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(call.id, FunctionCall(name=call.name, arguments=call.arguments))


def _with_tools(finish_reason: str | None, calls: int) -> str | None:
    """OpenAI's finish reason: `tool_calls` for an answer that stopped after making calls."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


class _CompletionReply(_Reply):
    """`text_completion` answers and stream chunks (the same object, one piece of text each)."""

    prefix = "cmpl"

    def __init__(self, link: EngineLink, top_logprobs: int | None) -> None:
        super().__init__(link, top_logprobs)
        self.text_offset = 0  # where the next token's text starts in the whole answer

    def _logprobs(self, positions: list[PositionLogprobs]) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        logprobs = CompletionLogprobs([], [], [], [])
        for position in positions:
            token = self.token_text(position.chosen.token_id)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(position.chosen.logprob)
            logprobs.top_logprobs.append({self.token_text(e.token_id): e.logprob for e in position.top})
            logprobs.text_offset.append(self.text_offset)
            self.text_offset += len(token)
        return logprobs

    def _completion(
        self, choices: list[CompletionChoice], usage: Usage | msgspec.UnsetType
    ) -> TextCompletion:
        return TextCompletion(self.id, self.created, self.model, choices, usage=usage)

    def piece(self, text: str, positions: list[PositionLogprobs]) -> list[msgspec.Struct]:
        """A piece of text."""
        choice = CompletionChoice(self.index, text, self._logprobs(positions), None)
        return [self._completion([choice], msgspec.UNSET)]

    def end(self, finish_reason: str | None) -> list[msgspec.Struct]:
        """No text, and the finish reason."""
        return [self._completion([CompletionChoice(self.index, "", None, finish_reason)], msgspec.UNSET)]

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """No choices, and the usage."""
        return self._completion([], usage)

    def whole(
        self, text: str, positions: list[PositionLogprobs], finish_reason: str | None, usage: Usage
    ) -> msgspec.Struct:
        """A `text_completion`."""
        choice = CompletionChoice(self.index, text, self._logprobs(positions), finish_reason)
        return self._completion([choice], usage)


def _check_model(link: EngineLink, model: str | None) -> None:
    """404 model_not_found unless `model` is absent or names the served model."""
    if model is not None and model != link.model_name:
        raise ApiError(
            404,
            f"the model '{model}' does not exist: this server serves '{link.model_name}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


async def _chat_prompt(
    link: EngineLink,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of `messages` (and `tools`, as HF passes them) rendered with the model's chat
    template."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    rendered = [_template_message(message) for message in messages]
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        return await link.encode_chat(rendered, add_generation_prompt, **kwargs)
    except (ChatTemplateError, TokenizerError) as exc:
        raise InvalidRequest(f"the chat template cannot render the messages: {exc}", "messages") from None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (HF's shape: a tool call's arguments as an object)."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    entry: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        entry["reasoning_content"] = message.reasoning_content
    return entry


def _arguments(text: str) -> Any:
    """A tool call's arguments as the object its JSON text holds (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template reads them; none with `tool_choice` none."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [msgspec.to_builtins(tool) for tool in request.tools]


def _features(
    params: SamplingParams, tools: bool = False, tool_grammar: Grammar | None = None, thinking: bool = False
) -> list[str]:
    """The features a request uses, as `strata:requests_by_feature` counts them."""
    features = ["tools"] if tools else []
    if tool_grammar is not None:
        features.append("tool_choice")
    elif params.grammar is not None:
        features.append(params.grammar.kind)
    return [*features, "thinking"] if thinking else features


async def _completion_prompts(link: EngineLink, prompt: str | list[str | int | list[int]]) -> list[list[int]]:
    """The token ids of each prompt of a completion request: text, token ids, or a list of either (a batch:
    up to MAX_PROMPTS prompts, each answered by its own choices)."""
    if isinstance(prompt, str):
        return [await link.encode(prompt)]
    if all(isinstance(token, int) for token in prompt):
        return [prompt]  # type: ignore[list-item]
    if any(isinstance(item, int) for item in prompt):
        raise InvalidRequest("a prompt is a string, a list of token ids, or a list of either", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts a request", "prompt")
    return [await link.encode(item) if isinstance(item, str) else item for item in prompt]  # type: ignore[misc]


def _sampling_params(
    link: EngineLink,
    request: SamplingRequest,
    prompt: list[int],
    prompt_param: str,
    max_tokens_param: str,
    logprobs: int | None,
    tool_grammar: Grammar | None = None,
) -> SamplingParams:
    """The engine's parameters for a request, checked against the model; InvalidRequest names the field.
    A grammar comes from the structured-output fields or from `tool_grammar` (not both)."""
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}]", "n")
    grammar = request_grammar(request)
    if grammar is not None and tool_grammar is not None:
        raise InvalidRequest(
            "tool_choice required or named cannot go with a structured output", "tool_choice"
        )
    grammar = grammar or tool_grammar
    max_tokens: int | None = getattr(request, max_tokens_param)
    try:
        return sampling_params(
            link,
            prompt,
            max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=0 if request.top_k == -1 else request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            spec_tokens=request.spec_tokens,
            grammar=grammar,
        )
    except InvalidRequest as exc:
        if exc.param == "prompt" or (exc.param == "max_tokens" and max_tokens is None):
            raise InvalidRequest(str(exc), prompt_param) from None
        if exc.param == "max_tokens":
            raise InvalidRequest(str(exc).replace("max_tokens", max_tokens_param), max_tokens_param) from None
        raise


def _event(body: msgspec.Struct) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@dataclass
class _Choice:
    """One choice of an answer: the engine request that makes it (its prompt and parameters) and the reply
    that writes it; `counted_n` the `n` the request is counted with in /metrics."""

    prompt: list[int]
    params: SamplingParams
    reply: _Reply
    counted_n: int = 1


async def _choice_chunks(
    link: EngineLink, choice: _Choice
) -> AsyncIterator[tuple[msgspec.Struct | None, int]]:
    """One choice's stream chunks, each with the tokens it adds (a last item of no chunk carries the tokens
    of outputs that made none); closing it early aborts the request in the engine."""
    reply = choice.reply
    for chunk in reply.opening():
        yield chunk, 0
    async with aclosing(link.stream(choice.prompt, choice.params, choice.counted_n)) as outputs:
        async for output in outputs:
            tokens = len(output.token_ids)
            chunks = reply.piece(output.text, output.logprobs) if output.text or output.logprobs else []
            if output.finished:
                chunks += reply.end(output.finish_reason)
            for chunk in chunks:
                yield chunk, tokens
                tokens = 0
            if tokens:
                yield None, tokens


_ENDED = object()  # a stream of `_merged` has no more items


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come; the first error ends all of them."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await queue.put((item, None))
        except Exception as exc:
            await queue.put((None, exc))
            return
        await queue.put((_ENDED, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _ENDED:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(
    link: EngineLink, choices: list[_Choice], prompt_tokens: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer, its choices' chunks as they come; closing it early
    aborts every unfinished choice in the engine."""
    completion_tokens = 0
    try:
        async with aclosing(_merged([_choice_chunks(link, choice) for choice in choices])) as chunks:
            async for chunk, tokens in chunks:
                completion_tokens += tokens
                if chunk is not None:
                    yield _event(chunk)
    except EngineError as exc:
        yield _event(ErrorResponse(ErrorDetail(f"the engine failed: {exc}", "service_unavailable")))
        return
    except Exception as exc:
        logger.exception("streaming %s failed", choices[0].reply.id)
        yield _event(ErrorResponse(ErrorDetail(f"internal error: {type(exc).__name__}", "internal_error")))
        return
    if include_usage:
        yield _event(choices[0].reply.usage_chunk(_usage(prompt_tokens, completion_tokens)))
    yield b"data: [DONE]\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


async def _whole(link: EngineLink, choice: _Choice) -> tuple[msgspec.Struct, int]:
    """Run one choice's request to its end: the whole answer and its tokens."""
    outputs: list[RequestOutput] = []
    async with aclosing(link.stream(choice.prompt, choice.params, choice.counted_n)) as stream:
        async for output in stream:
            outputs.append(output)
    token_count = sum(len(output.token_ids) for output in outputs)
    answer = choice.reply.whole(
        "".join(output.text for output in outputs),
        [position for output in outputs for position in output.logprobs],
        outputs[-1].finish_reason if outputs else None,
        _usage(len(choice.prompt), token_count),
    )
    return answer, token_count


async def _all_choices(link: EngineLink, choices: list[_Choice], prompt_tokens: int) -> msgspec.Struct:
    """Every choice run to its end at once: one answer holding their choices in order, and their usage (a
    choice that fails cancels the others, which aborts their requests)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_whole(link, choice)) for choice in choices]
    except ExceptionGroup as failed:  # the first failure, as one request's would be (a 503, a 400)
        raise failed.exceptions[0] from None
    answers = [task.result() for task in tasks]
    first = answers[0][0]
    first.choices = [choice for answer, _ in answers for choice in answer.choices]  # type: ignore[attr-defined]
    first.usage = _usage(prompt_tokens, sum(tokens for _, tokens in answers))  # type: ignore[attr-defined]
    return first


def _choices(
    request: SamplingRequest,
    requests: list[tuple[list[int], SamplingParams]],
    make_reply: Callable[[], _Reply],
) -> list[_Choice]:
    """The `n` choices of each prompt's request (`requests`: prompt, parameters), prompt by prompt: one
    answer id, choice k written at index k, and with a seed the i-th choice of a prompt sampling from the
    seed plus i (reproducible, and not n copies of one draw). The first choice of each prompt counts the
    request's `n` in /metrics."""
    n = request.n or 1
    choices: list[_Choice] = []
    for prompt, params in requests:
        for i in range(n):
            reply = make_reply()
            if choices:
                reply.id, reply.created = choices[0].reply.id, choices[0].reply.created
            reply.index = len(choices)
            seeded = params if params.seed is None else msgspec.structs.replace(params, seed=params.seed + i)
            choices.append(_Choice(prompt, seeded, reply, n if i == 0 else 1))
    return choices


async def _answer(
    link: EngineLink,
    request: SamplingRequest,
    requests: list[tuple[list[int], SamplingParams]],
    make_reply: Callable[[], _Reply],
) -> Response[Any]:
    """The whole answer as JSON, or a stream of server-sent events when the request asks for one: the `n`
    choices of each prompt (`requests`: prompt, parameters), each a request of its own in the engine,
    written by a reply of `make_reply`."""
    if link.dead:
        raise EngineError(link.dead)
    choices = _choices(request, requests, make_reply)
    prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    if not request.stream:
        return Response(await _all_choices(link, choices, prompt_tokens))
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    events = _events(link, choices, prompt_tokens, include_usage)
    # Closing the events after the response (sent, or cut short by the client leaving) aborts an unfinished
    # request at once instead of whenever the generator is garbage-collected.
    return Stream(events, headers=STREAM_HEADERS, background=BackgroundTask(events.aclose))


_COMPLETION_ROUTE: dict[str, Any] = {
    "guards": [require_api_key],
    "status_code": 200,
    "responses": _ERROR_RESPONSES,
    "operation_class": _EventStreamOperation,
    "tags": ["OpenAI"],
}


@post(
    "/v1/chat/completions",
    summary="Chat completion",
    description=STREAM_DESCRIPTION.format(chunk="`chat.completion.chunk`"),
    **_COMPLETION_ROUTE,
)
async def chat_completions(data: ChatCompletionRequest, link: EngineLink) -> Response[ChatCompletion]:
    """Answer a conversation rendered with the model's chat template."""
    _check_model(link, data.model)
    if data.top_logprobs is not None and not data.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    tools = _tools(data)
    prompt = await _chat_prompt(link, data.messages, True, data.chat_template_kwargs, tools)
    logprobs = (data.top_logprobs or 0) if data.logprobs else None
    max_tokens_param = "max_completion_tokens" if data.max_completion_tokens is not None else "max_tokens"
    tool_grammar = tool_choice_grammar(data)
    params = _sampling_params(link, data, prompt, "messages", max_tokens_param, logprobs, tool_grammar)
    thinking = opens_thinking(link.decode_special, prompt)
    link.observer.count_features(_features(params, tools is not None, tool_grammar, thinking))
    return await _answer(
        link, data, [(prompt, params)], lambda: _ChatReply(link, logprobs, thinking, tools is not None)
    )


@post(
    "/v1/completions",
    summary="Text completion",
    description=STREAM_DESCRIPTION.format(chunk="`text_completion`"),
    **_COMPLETION_ROUTE,
)
async def completions(data: CompletionRequest, link: EngineLink) -> Response[TextCompletion]:
    """Continue a prompt given as text or token ids."""
    _check_model(link, data.model)
    if data.echo:
        raise InvalidRequest("echo is not supported", "echo")
    prompts = await _completion_prompts(link, data.prompt)
    requests = [(p, _sampling_params(link, data, p, "prompt", "max_tokens", data.logprobs)) for p in prompts]
    link.observer.count_features(_features(requests[0][1]))
    return await _answer(link, data, requests, lambda: _CompletionReply(link, data.logprobs))


_ROUTE: dict[str, Any] = {"guards": [require_api_key], "responses": _ERROR_RESPONSES, "tags": ["OpenAI"]}


@get("/v1/models", summary="The served model", **_ROUTE)
async def list_models(link: EngineLink) -> ModelList:
    """List the one model this server serves."""
    return ModelList([Model(link.model_name, STARTED, context_tokens(link))])


@post("/tokenize", summary="Text or chat messages to token ids", status_code=200, **_ROUTE)
async def tokenize(data: TokenizeRequest, link: EngineLink) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered as the chat endpoint renders them."""
    _check_model(link, data.model)
    if (data.prompt is None) == (data.messages is None):
        raise InvalidRequest("send exactly one of prompt and messages", "prompt")
    if data.messages is not None:
        tokens = await _chat_prompt(
            link, data.messages, data.add_generation_prompt, data.chat_template_kwargs
        )
    else:
        tokens = await link.encode(data.prompt, add_special_tokens=data.add_special_tokens)
    return TokenizeResponse(len(tokens), context_tokens(link), tokens)


@post("/detokenize", summary="Token ids to text", status_code=200, **_ROUTE)
async def detokenize(data: DetokenizeRequest, link: EngineLink) -> DetokenizeResponse:
    """The text of token ids, special tokens included."""
    _check_model(link, data.model)
    vocab_size = link.ready.vocab_size
    bad = next((token for token in data.tokens if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
    return DetokenizeResponse(link.tokenizer.decode(data.tokens, skip_special_tokens=False))


ROUTES = [chat_completions, completions, list_models, tokenize, detokenize]
