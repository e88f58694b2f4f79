"""Tool calls, structured output and reasoning through the official `openai` client against a real
`strata serve` (a tiny checkpoint whose chat template renders tools and opens think blocks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from checkpoints import PERSON_SCHEMA as PERSON
from checkpoints import use_tools_template, write_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, start_server, stop_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = use_tools_template(
        write_checkpoint(tmp_path_factory.mktemp("tools"), "qwen3_moe", max_position_embeddings=4096)
    )
    running = start_server(path, "--parallel", "8")
    yield running
    stop_server(running)


class Client:
    """The official client bound to the served model."""

    def __init__(self, server: Server) -> None:
        self.api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.api.models.list().data[0].id

    def chat(self, **fields: object) -> object:
        return self.api.chat.completions.create(model=self.model, **fields)  # type: ignore[call-overload]

    def complete(self, **fields: object) -> object:
        return self.api.completions.create(model=self.model, **fields)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def client(tools_server: Server) -> Client:
    return Client(tools_server)


def _arguments_valid(call: object, tools: list[dict]) -> None:
    function = call.function  # type: ignore[attr-defined]
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == function.name)
    jsonschema.validate(json.loads(function.arguments), schema)


def test_required_tool_choice_always_answers_with_valid_calls(client: Client) -> None:
    """Sampled at temperature 1: each answer that ends is calls to the tools with arguments that follow
    their schemas (one call where parallel calls are off)."""
    tools = [WEATHER, TIME]

    def ask(seed: int) -> tuple[bool, object]:
        parallel = seed % 2 == 0
        answer = client.chat(
            messages=ASK, tools=tools, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200,
            parallel_tool_calls=parallel,
        )  # fmt: skip
        return parallel, answer

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(12)))
    finished = [(p, a) for p, a in answers if a.choices[0].finish_reason == "tool_calls"]
    assert len(finished) >= 4 and any(not p for p, _ in finished)
    for parallel, answer in finished:
        message = answer.choices[0].message
        assert message.tool_calls and message.content is None
        assert parallel or len(message.tool_calls) == 1
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _arguments_valid(call, tools)


def _streamed(client: Client, **fields: object) -> tuple[str, list[tuple[int, str, str]], str | None]:
    """A streamed answer's content, its tool calls as (index, name, arguments), its finish reason."""
    deltas = [chunk.choices[0] for chunk in client.chat(stream=True, **fields) if chunk.choices]
    calls = [
        (c.index, c.function.name, c.function.arguments) for d in deltas for c in d.delta.tool_calls or []
    ]
    return "".join(d.delta.content or "" for d in deltas), calls, deltas[-1].finish_reason


def test_required_calls_streamed_are_the_calls_of_the_whole_answer(client: Client) -> None:
    fields = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 1.0}
    for seed in range(6):
        whole = client.chat(seed=seed, max_tokens=200, parallel_tool_calls=False, **fields)
        if whole.choices[0].finish_reason != "tool_calls":
            continue
        calls = whole.choices[0].message.tool_calls
        content, streamed, reason = _streamed(
            client, seed=seed, max_tokens=200, parallel_tool_calls=False, **fields
        )
        assert (content, reason) == ("", "tool_calls")
        assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments) for c in calls]
        return
    raise AssertionError("no answer of six ended with its calls")


def test_a_named_function_is_the_one_call_made_streamed_or_not(client: Client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat(messages=ASK, tools=[TIME, WEATHER], tool_choice=named, temperature=0, max_tokens=120)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    _arguments_valid(calls[0], [WEATHER])
    stream = client.chat(
        messages=ASK, tools=[TIME, WEATHER], tool_choice=named, temperature=0, max_tokens=120,
        stream=True,
    )  # fmt: skip
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    streamed = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
        (0, "get_weather", calls[0].function.arguments)
    ]
    assert deltas[-1].finish_reason == "tool_calls"


def test_auto_turns_the_answers_tool_call_blocks_into_calls_and_keeps_the_rest_as_content(
    client: Client,
) -> None:
    """The tiny model calls no tool by itself: a regular expression makes it write a block."""
    block = (
        r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
        r"\n</tool_call>"
    )
    answer = client.chat(
        messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
        extra_body={"guided_regex": block},
    )  # fmt: skip
    message = answer.choices[0].message
    assert message.content == "Checking.\n" and answer.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and json.loads(message.tool_calls[0].function.arguments)["city"]
    streamed = _streamed(client, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
                         extra_body={"guided_regex": block})  # fmt: skip
    assert streamed == (
        message.content,
        [(0, "get_weather", message.tool_calls[0].function.arguments)],
        "tool_calls",
    )
    plain = client.chat(
        messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=80,
        extra_body={"guided_regex": block},
    )  # fmt: skip
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content


def test_tool_calls_and_tool_answers_round_trip_through_the_template(
    client: Client, tools_server: Server
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 degrees"}]  # fmt: skip
    answer = client.chat(messages=messages, tools=[WEATHER], temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(
        f"{tools_server.url}/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=30
    ).json()["tokens"]
    text = httpx.post(f"{tools_server.url}/detokenize", json={"tokens": rendered}, timeout=30).json()[
        "prompt"
    ]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nrain, 4 degrees\n</tool_response>" in text


def test_json_schema_outputs_always_validate(client: Client) -> None:
    """100 requests sampled at temperature 1: every one that finishes is JSON that follows the schema."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }

    def ask(seed: int) -> tuple[str | None, str]:
        answer = client.chat(
            messages=[{"role": "user", "content": f"Person {seed}?"}], temperature=1.0,
            seed=seed, max_tokens=48, response_format=response_format,
        )  # fmt: skip
        return answer.choices[0].finish_reason, answer.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(100)))
    finished = [text for reason, text in answers if reason == "stop"]
    assert len(finished) >= 50
    for text in finished:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(reason in ("stop", "length") for reason, _ in answers)


def test_json_object_and_choices_and_a_schema_that_cannot_compile(client: Client) -> None:
    answer = client.chat(
        messages=ASK, temperature=1.0, seed=3, max_tokens=64, response_format={"type": "json_object"}
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    choice = client.complete(
        prompt="Pick:", temperature=1.0, seed=1, max_tokens=8, extra_body={"guided_choice": ["red", "blue"]}
    )
    assert choice.choices[0].text in ("red", "blue")
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as refused:
        unknown = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
        client.chat(messages=ASK, response_format=unknown)
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat(
            messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
        )


def test_a_thinking_templates_reasoning_comes_apart_from_the_answer(client: Client) -> None:
    """`enable_thinking` opens a think block in the prompt; what comes before `</think>` is reasoning."""
    shape = {
        "guided_regex": "[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n(yes|no)",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    answer = client.chat(messages=ASK, temperature=1.0, seed=5, max_tokens=60, extra_body=shape)
    message = answer.choices[0].message
    assert message.content in ("yes", "no")
    reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
    assert reasoning and "</think>" not in reasoning
    stream = client.chat(messages=ASK, temperature=1.0, seed=5, max_tokens=60, extra_body=shape, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == message.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    without = client.chat(messages=ASK, temperature=0, max_tokens=6)
    assert "reasoning_content" not in (without.choices[0].message.model_extra or {})


def test_requests_are_counted_by_the_features_they_use(client: Client, tools_server: Server) -> None:
    client.chat(messages=ASK, temperature=0, max_tokens=4, extra_body={"guided_regex": "[a-c]+"})
    client.chat(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=4)
    client.chat(
        messages=ASK, temperature=0, max_tokens=4, response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    text = httpx.get(f"{tools_server.url}/metrics", headers={"Accept": "text/plain"}, timeout=30).text
    counts = {
        s.labels["feature"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "strata:requests_by_feature_total"
    }
    assert counts["regex"] >= 1 and counts["tools"] >= 1 and counts["tool_choice"] >= 1
    assert counts["json_object"] >= 1 and counts["thinking"] >= 1


def test_the_demo_model_answers_in_the_schema_and_with_tool_calls() -> None:
    """The trained demo model (its ChatML template renders no tools: `required` alone makes the calls)."""
    demo = start_server(None, "--parallel", "8")
    try:
        client = Client(demo)
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

        def ask(seed: int) -> object:
            messages = [{"role": "user", "content": "Describe a person as JSON."}]
            return client.chat(
                messages=messages, temperature=1.0, seed=seed, max_tokens=64, response_format=response_format
            )

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(16)))
        finished = [a.choices[0].message.content for a in answers if a.choices[0].finish_reason == "stop"]
        assert finished
        for text in finished:
            jsonschema.validate(json.loads(text), PERSON)
        called = client.chat(
            messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80
        )
        if called.choices[0].finish_reason == "tool_calls":
            _arguments_valid(called.choices[0].message.tool_calls[0], [WEATHER])
        else:
            assert called.choices[0].finish_reason == "length"
    finally:
        stop_server(demo)
