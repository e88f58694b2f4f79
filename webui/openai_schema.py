"""Request and response bodies of the OpenAI-compatible API: msgspec structs, which make the OpenAPI schema.

Nullable fields with a non-null default take that default when a client sends null, as OpenAI's do.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Body(msgspec.Struct, kw_only=True):
    """A request body whose explicit nulls mean "the default"."""

    def __post_init__(self) -> None:
        for field in msgspec.structs.fields(self):
            if getattr(self, field.name) is None and field.default not in (None, msgspec.NODEFAULT):
                setattr(self, field.name, field.default)


class TextPart(msgspec.Struct):
    """One part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, kw_only=True):
    """A function a tool call names, and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A tool call an assistant message made (sent back in the conversation, or answered)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of a conversation: a string, or a list of text parts (joined by newlines).

    An assistant message may carry the `tool_calls` it made and its `reasoning_content`; a `tool` message
    answers the call `tool_call_id`.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A function the model may call: its name, what it does, its parameters' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """A tool of a chat request (only functions)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    """The function a named tool choice forces."""

    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice` naming one function: the answer is one call to it."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """The schema of a `json_schema` response format (outputs always follow it: `strict` or not)."""

    name: str = "response"
    schema_: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`text` (free), `json_object` (any JSON object) or `json_schema` (JSON following `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: one of a JSON schema, a regular expression, choices, a Lark grammar."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """Options of a streamed answer."""

    include_usage: bool = False


class SamplingRequest(_Body, kw_only=True):
    """The fields chat and text completions share: the model, how to sample, when to stop, how to answer.

    `max_tokens` defaults to what is left of the context after the prompt. top_k, min_p,
    repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens and include_stop_str_in_output
    are vLLM's extensions; top_k -1 or 0 turns it off. `spec_tokens` is Strata's: the most draft tokens
    a window verifies for this request (0: none; absent: the server's `--spec`). `n` (1 to 16) choices
    are as many requests in the engine, choice i seeded with `seed` + i where a seed is given (in
    /metrics each choice counts as a request, the first observed in `vllm:request_params_n` with n).

    Structured output (one of them): OpenAI's `response_format`, or vLLM's `guided_json` (a JSON schema),
    `guided_regex`, `guided_choice`, `guided_grammar` (Lark) and `structured_outputs`; every token keeps
    the output inside it.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spec_tokens: int | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions: `messages` rendered with the model's chat template.

    `max_completion_tokens` wins over `max_tokens`; `logprobs` asks for the chosen tokens' log-probabilities
    and `top_logprobs` (0-20) for that many alternatives each. `chat_template_kwargs` reach the template
    (e.g. `enable_thinking`). `tools` reach the template too; the answer's tool-call blocks come back as
    `tool_calls`; `tool_choice` `none` leaves the tools out, `auto` (the default with tools) lets the model
    choose, `required` or a named function makes the answer calls (`parallel_tool_calls` false: one).
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class CompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of either (a batch of up to
    64 prompts: `n` choices each, prompt by prompt, in one answer).

    `logprobs` (0-20) asks for the chosen tokens' log-probabilities and that many alternatives each; `echo`
    is not supported.
    """

    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class Usage(msgspec.Struct):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(msgspec.Struct):
    """An alternative token at one position: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    """The chosen token at one position and the most likely alternatives there."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    """Log-probabilities of a chat answer's tokens."""

    content: list[TokenLogprob]


class ToolCallOut(msgspec.Struct):
    """A tool call the answer makes."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct):
    """The generated message: its content (null where it is only tool calls), its tool calls and its
    reasoning (a thinking model's, apart from the answer) where it has them."""

    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    """The answer: its message, log-probabilities when asked for, and why it ended (stop, length, or
    tool_calls)."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    """A whole chat answer."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed tool call: the call's index in the answer, its id, name and arguments (whole, in one
    chunk once its block has closed)."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chat chunk adds to the message (the first carries the role; the last is empty):
    content, reasoning or tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    """A piece of the streamed answer; `finish_reason` is set on the last one."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One server-sent event of a streamed chat answer; the usage chunk (the last) has no choices."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | msgspec.UnsetType = msgspec.UNSET


class CompletionLogprobs(msgspec.Struct):
    """Log-probabilities of a completion's tokens, position by position (the legacy OpenAI shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """The generated text (whole, or a streamed piece), its log-probabilities, and why it ended."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct):
    """A whole completion, or one server-sent event of a streamed one.

    The whole one has the usage; of the events, only the last one, asked for with `include_usage`.
    """

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | msgspec.UnsetType = msgspec.UNSET


class Model(msgspec.Struct):
    """The served model."""

    id: str
    created: int
    max_model_len: int
    object: Literal["model"] = "model"
    owned_by: str = "strata"


class ModelList(msgspec.Struct):
    """GET /v1/models: the one served model."""

    data: list[Model]
    object: Literal["list"] = "list"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: either `prompt` text, or chat `messages` rendered as the chat endpoint renders them.

    `add_special_tokens` applies to `prompt` only (with messages the template places the special tokens);
    `tools` are rendered with the messages as the chat endpoint renders them.
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class TokenizeResponse(msgspec.Struct):
    """The token ids, how many, and the context limit."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize: token ids to turn back into text (special tokens kept)."""

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    """The text of the token ids."""

    prompt: str
