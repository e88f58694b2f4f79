"""The OpenAI-compatible API over HTTP against a real `strata serve`: shapes, streams, errors, auth, abort."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest
from serving import API_KEY, Server

from app.cli import main
from app.engine.client import EngineError
from app.engine.protocol import RequestOutput, SamplingParams
from webui.openai import _all_choices, _Choice, _CompletionReply, _events

TIMEOUT = 60.0
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello! How can I help you today?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as JSON with the server's credentials."""
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=TIMEOUT)


def ok(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST and return the JSON of a 200 answer."""
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def parse_events(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of a complete event stream, after checking its framing and the final [DONE]."""
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    assert all(event.startswith("data: ") and "\n" not in event for event in events[:-1])
    return [json.loads(event.removeprefix("data: ")) for event in events[:-2]]


def stream(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer."""
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, headers=server.headers(), timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_events(response.read().decode())


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chat or completion chunk adds."""
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content", "")


def whole_text(answer: dict[str, Any]) -> str:
    """The text of a non-streamed chat or completion answer."""
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def assert_error(response: httpx.Response, status: int, type_: str, param: str | None) -> dict[str, Any]:
    """Check an OpenAI error answer and return its error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (type_, param), error
    assert error["message"] and "\n" not in error["message"]
    return error


def model_name(server: Server) -> str:
    """The id the server answers to."""
    return ok_get(server, "/v1/models")["data"][0]["id"]


def ok_get(server: Server, path: str) -> dict[str, Any]:
    """GET and return the JSON of a 200 answer."""
    response = httpx.get(server.url + path, headers=server.headers(), timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_models(server: Server) -> None:
    listing = ok_get(server, "/v1/models")
    assert listing["object"] == "list" and len(listing["data"]) == 1
    model = listing["data"][0]
    assert model["id"] == server.model_dir.name
    assert (model["object"], model["owned_by"]) == ("model", "strata")
    assert model["max_model_len"] == 4096 and isinstance(model["created"], int)


def test_chat_completion(server: Server) -> None:
    answer = ok(server, CHAT, {"model": model_name(server), "messages": HELLO, "max_tokens": 5, **GREEDY})
    assert answer["id"].startswith("chatcmpl-") and answer["object"] == "chat.completion"
    assert answer["model"] == server.model_dir.name and abs(answer["created"] - time.time()) < 60
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert (choice["finish_reason"], choice["logprobs"]) == ("length", None)
    usage = answer["usage"]
    prompt_tokens = ok(server, "/tokenize", {"messages": HELLO})["count"]
    assert usage == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
    }


def test_text_completion(server: Server) -> None:
    answer = ok(server, COMPLETIONS, {"prompt": "The river town", "max_tokens": 7, **GREEDY})
    assert answer["id"].startswith("cmpl-") and answer["object"] == "text_completion"
    (choice,) = answer["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    usage = answer["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "A good assistant"})],
    ids=["chat", "completions"],
)
def test_stream_equals_whole_answer(server: Server, path: str, body: dict[str, Any]) -> None:
    body = {**body, "max_tokens": 12, **GREEDY}
    whole = ok(server, path, body)
    again = ok(server, path, body)
    assert whole_text(again) == whole_text(whole)  # greedy is deterministic
    chunks = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    *pieces, usage_chunk = chunks
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert all(chunk["model"] == whole["model"] and "created" in chunk for chunk in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all("usage" not in chunk for chunk in pieces)
    assert "".join(chunk_text(chunk) for chunk in pieces) == whole_text(whole)
    finish_reasons = [chunk["choices"][0]["finish_reason"] for chunk in pieces]
    assert finish_reasons == [None] * (len(pieces) - 1) + ["length"]
    if path == CHAT:
        assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
        assert pieces[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert pieces[-1]["choices"][0]["delta"] == {}
    else:
        assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    plain = stream(server, path, body)
    assert all("usage" not in chunk and chunk["choices"] for chunk in plain)
    assert "".join(chunk_text(chunk) for chunk in plain) == whole_text(whole)


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "A good assistant"})],
    ids=["chat", "completions"],
)
def test_n_choices_are_requests_seeded_one_apart(server: Server, path: str, body: dict[str, Any]) -> None:
    """`n` choices: indices 0..n-1 under one id, choice i the answer of one request with seed + i, the
    usage their tokens together; streamed, each choice's chunks carry its index and add up to it."""
    body = {**body, "max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    before = ok_get(server, "/metrics?format=json")["request_params_n"]
    answer = ok(server, path, {**body, "n": 3, "seed": 40})
    after = ok_get(server, "/metrics?format=json")["request_params_n"]
    # each choice counts as a request, the first with the request's n
    assert (after["count"] - before["count"], after["sum"] - before["sum"]) == (3, 5)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    alone = [ok(server, path, {**body, "seed": 40 + i}) for i in range(3)]
    for choice, single in zip(answer["choices"], alone, strict=True):
        assert whole_text({"choices": [choice]}) == whole_text(single)
    texts = {whole_text({"choices": [choice]}) for choice in answer["choices"]}
    assert len(texts) > 1  # three draws, not one copied
    usage = answer["usage"]
    assert usage["completion_tokens"] == 30 and usage["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    chunks = stream(server, path, {**body, "n": 3, "seed": 40, "stream_options": {"include_usage": True}})
    *pieces, usage_chunk = chunks
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]} and usage_chunk["usage"] == usage
    for i, single in enumerate(alone):
        mine = [chunk for chunk in pieces if chunk["choices"][0]["index"] == i]
        assert "".join(chunk_text(chunk) for chunk in mine) == whole_text(single)
        assert mine[-1]["choices"][0]["finish_reason"] == "length"


def test_a_batch_of_prompts_gets_each_prompts_choices_in_order(server: Server) -> None:
    prompts = ["Once upon a time", [9, 8, 7, 6]]
    body = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 7}
    answer = ok(server, COMPLETIONS, {**body, "prompt": prompts, "n": 2})
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    alone = [ok(server, COMPLETIONS, {**body, "prompt": p, "seed": 7 + i}) for p in prompts for i in range(2)]
    assert [c["text"] for c in answer["choices"]] == [whole_text(single) for single in alone]
    prompt_tokens = alone[0]["usage"]["prompt_tokens"] + alone[2]["usage"]["prompt_tokens"]
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 24,
        "total_tokens": prompt_tokens + 24,
    }
    chunks = stream(server, COMPLETIONS, {**body, "prompt": prompts, "n": 2})
    for index, single in enumerate(alone):
        mine = [chunk for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(chunk_text(chunk) for chunk in mine) == whole_text(single)


def test_token_id_prompts_equal_text_prompt(server: Server) -> None:
    text = "Questions are cheap"
    ids = ok(server, "/tokenize", {"prompt": text})["tokens"]
    answers = [
        ok(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 6, **GREEDY})
        for prompt in (text, [text], ids, [ids])
    ]
    assert len({whole_text(answer) for answer in answers}) == 1
    assert {answer["usage"]["prompt_tokens"] for answer in answers} == {len(ids)}


def test_greedy_equals_strata_generate(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [5, 17, 42, 99, 7]
    args = ["--model", str(server.model_dir), "--dtype", "float32", "--kv-memory", "64MiB", "--ignore-eos"]
    args += ["--prompt-token-ids", ",".join(map(str, ids)), "--max-tokens", "10", "--temperature", "0"]
    assert main(["generate", "--json", *args]) == 0
    generated = json.loads(capsys.readouterr().out)
    answer = ok(server, COMPLETIONS, {"prompt": ids, "max_tokens": 10, **GREEDY})
    assert whole_text(answer) == generated["text"]
    assert answer["usage"]["completion_tokens"] == len(generated["token_ids"]) == 10


def test_stop_string(server: Server) -> None:
    body = {"prompt": "Numbers appear everywhere", "max_tokens": 12, "logprobs": 0, **GREEDY}
    whole = ok(server, COMPLETIONS, body)
    text = whole_text(whole)
    tokens = whole["choices"][0]["logprobs"]["tokens"]
    stop = next(token for token in tokens[2:] if token.strip() and "\ufffd" not in token)
    expected = text[: text.index(stop)]
    stopped = ok(server, COMPLETIONS, {**body, "stop": [stop]})
    assert (whole_text(stopped), stopped["choices"][0]["finish_reason"]) == (expected, "stop")
    chunks = stream(server, COMPLETIONS, {**body, "stop": stop})
    assert "".join(chunk_text(chunk) for chunk in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs(server: Server) -> None:
    body = {"messages": HELLO, "max_tokens": 5, "logprobs": True, "top_logprobs": 3, **GREEDY}
    answer = ok(server, CHAT, body)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        assert all(set(top) == {"token", "logprob", "bytes"} for top in entry["top_logprobs"])
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])  # greedy takes the best
    chunks = stream(server, CHAT, body)
    streamed = [e for chunk in chunks if (lp := chunk["choices"][0]["logprobs"]) for e in lp["content"]]
    assert streamed == content


def test_completion_logprobs(server: Server) -> None:
    answer = ok(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 6, "logprobs": 2, **GREEDY})
    logprobs = answer["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(logprobs[key]) == 6 for key in logprobs)
    assert all(isinstance(top, dict) and 1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    assert (
        ok(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 6, **GREEDY})["choices"][0]["logprobs"]
        is None
    )


TOO_LONG = "hello " * 5000
ERRORS = {  # every one is an invalid_request_error: (path, body, status, param)
    "invalid JSON": (CHAT, b'{"messages": [', 400, None),
    "body not an object": (CHAT, b"[1, 2]", 400, None),
    "empty body": (COMPLETIONS, b"", 400, None),
    "wrong type": (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    "wrong content": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "top_p range": (CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "top_p"),
    "n=17": (CHAT, {"messages": HELLO, "n": 17}, 400, "n"),
    "n=0": (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    "unknown model": (CHAT, {"model": "gpt-4o", "messages": HELLO}, 404, "model"),
    "missing messages": (CHAT, {"max_tokens": 3}, 400, "messages"),
    "empty messages": (CHAT, {"messages": []}, 400, "messages"),
    "prompt too long": (COMPLETIONS, {"prompt": TOO_LONG}, 400, "prompt"),
    "chat too long": (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    "max_tokens too many": (COMPLETIONS, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    "max_completion_tokens 0": (
        CHAT,
        {"messages": HELLO, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    "65 prompts": (COMPLETIONS, {"prompt": ["a"] * 65}, 400, "prompt"),
    "ids beside prompts": (COMPLETIONS, {"prompt": ["a", 5]}, 400, "prompt"),
    "a batched prompt too long": (COMPLETIONS, {"prompt": ["hi", TOO_LONG]}, 400, "prompt"),
    "echo": (COMPLETIONS, {"prompt": "a", "echo": True}, 400, "echo"),
    "outside vocabulary": (COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt"),
    "logprobs range": (COMPLETIONS, {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    "top_logprobs alone": (CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    "a 10 MB body": (COMPLETIONS, {"prompt": "a" * 10_000_000, "max_tokens": 2}, 413, None),
    "nested too deeply": (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    "nested in a field": (CHAT, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None),
    "invalid UTF-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    "NaN temperature": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        None,
    ),
    "seed beyond 64 bits": (COMPLETIONS, {"prompt": "hi", "seed": 10**30}, 400, "seed"),
    "10,000 stop strings": (CHAT, {"messages": HELLO, "stop": [f"s{i}" for i in range(10_000)]}, 400, "stop"),
    "a stop string of 1 MB": (CHAT, {"messages": HELLO, "stop": "x" * 1_000_000}, 400, "stop"),
    "stop token outside vocabulary": (
        COMPLETIONS,
        {"prompt": "hi", "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
    ),
}


@pytest.mark.parametrize(("path", "body", "status", "param"), ERRORS.values(), ids=ERRORS.keys())
def test_errors(
    server: Server, path: str, body: dict[str, Any] | bytes, status: int, param: str | None
) -> None:
    headers = {**server.headers(), "content-type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers=headers, timeout=TIMEOUT)
    error = assert_error(response, status, "invalid_request_error", param)
    assert error["code"] == ("model_not_found" if status == 404 else None)


def test_route_errors(server: Server) -> None:
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, "not_found_error", None)
    assert_error(httpx.get(server.url + CHAT), 405, "invalid_request_error", None)
    malformed = httpx.post(server.url + CHAT, content=b"{oops", headers={"content-type": "application/json"})
    assert "JSON" in assert_error(malformed, 400, "invalid_request_error", None)["message"]


def test_auth(keyed_server: Server) -> None:
    url = keyed_server.url
    body = {"messages": HELLO, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401, "authentication_error", None)
        assert_error(httpx.post(url + CHAT, json=body, headers=headers), 401, "authentication_error", None)
        tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "a"}, headers=headers)
        assert_error(tokenize, 401, "authentication_error", None)
        detokenize = httpx.post(f"{url}/detokenize", json={"tokens": [1]}, headers=headers)
        assert_error(detokenize, 401, "authentication_error", None)
    assert httpx.get(f"{url}/health").status_code == 200
    assert ok_get(keyed_server, "/v1/models")["data"][0]["id"] == keyed_server.model_dir.name
    assert ok(keyed_server, CHAT, body)["usage"]["completion_tokens"] <= 2


def test_tokenize_round_trip(server: Server) -> None:
    text = "A tokenizer splits text into small pieces called tokens."
    tokenized = ok(server, "/tokenize", {"prompt": text, "model": server.model_dir.name})
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] == 4096
    assert ok(server, "/detokenize", {"tokens": tokenized["tokens"]}) == {"prompt": text}
    chat = ok(server, "/tokenize", {"messages": HELLO})
    assert "<|im_start|>assistant" in ok(server, "/detokenize", {"tokens": chat["tokens"]})["prompt"]
    without = ok(server, "/tokenize", {"messages": HELLO, "add_generation_prompt": False})
    assert without["count"] < chat["count"]
    assert_error(post(server, "/tokenize", {}), 400, "invalid_request_error", "prompt")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, "invalid_request_error", "tokens")


def test_openapi_schema(server: Server) -> None:
    schema = ok_get(server, "/schema/openapi.json")
    for path in (CHAT, COMPLETIONS, "/v1/models", "/tokenize", "/detokenize"):
        assert path in schema["paths"]
    chat = schema["paths"][CHAT]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert "messages" in request["properties"] and "messages" in request["required"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")


def _prompts(count: int) -> list[list[int]]:
    return [[3 + i, 50 + 7 * i, 200 + i, 11] for i in range(count)]


async def _stream_text(client: httpx.AsyncClient, server: Server, body: dict[str, Any]) -> str:
    async with client.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        raw = (await response.aread()).decode()
    return "".join(chunk_text(chunk) for chunk in parse_events(raw))


def test_sixteen_concurrent_streams(server: Server) -> None:
    bodies = [{"prompt": prompt, "max_tokens": 8, **GREEDY} for prompt in _prompts(16)]
    solo = [whole_text(ok(server, COMPLETIONS, body)) for body in bodies]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(_stream_text(client, server, body) for body in bodies))

    assert asyncio.run(run_all()) == solo


async def _first_chunk_seconds(client: httpx.AsyncClient, server: Server, body: dict[str, Any]) -> float:
    """Seconds until the first event of a stream, which is then closed (aborting its request)."""
    start = time.monotonic()
    async with client.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return time.monotonic() - start
    raise AssertionError("the stream ended without an event")


def test_disconnects_abort_requests(server: Server) -> None:
    probe = {"prompt": [9, 8, 7, 6], "max_tokens": 8, **GREEDY}
    expected = whole_text(ok(server, COMPLETIONS, probe))
    long = {"prompt": "The river town woke slowly.", "max_tokens": 3500, **GREEDY}
    rng = random.Random(0)
    for i in range(20):
        wanted = rng.randint(0, 6)
        body = {**long, "stream": True, "n": 1 + i % 2}  # every choice of a request aborted with it
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            read = 0
            for line in r.iter_lines():
                if read >= wanted:
                    break
                read += line.startswith("data: ")
    running = ok_get(server, "/metrics?format=json")["num_requests_running"]
    for _ in range(30):  # aborted at once, not when their 3500 tokens are done
        if running == 0:
            break
        time.sleep(0.1)
        running = ok_get(server, "/metrics?format=json")["num_requests_running"]
    assert running == 0
    assert whole_text(ok(server, COMPLETIONS, probe)) == expected

    async def four_long() -> list[float]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(_first_chunk_seconds(client, server, long) for _ in range(4)))

    # 30 abandoned requests of 3500 tokens would hold the 4 slots for minutes if they were not aborted.
    assert max(asyncio.run(four_long())) < 5.0


class _FailingLink:
    """A link whose engine sends one output, then dies."""

    model_name = "m"
    tokenizer = None

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams, n: int = 1) -> Any:
        yield RequestOutput("r", token_ids=[1], text="a")
        raise EngineError("engine process exited with status -9")


def test_engine_death_mid_stream_sends_error_event() -> None:
    link: Any = _FailingLink()

    async def collect() -> list[bytes]:
        return [
            event
            async for event in _events(
                link, [_Choice([1], SamplingParams(), _CompletionReply(link, None))], 1, True
            )
        ]

    events = asyncio.run(collect())
    # not streamed, two choices: the engine's failure itself (the route answers it with a 503)
    two = [_Choice([1], SamplingParams(), _CompletionReply(link, None)) for _ in range(2)]
    with pytest.raises(EngineError, match="status -9"):
        asyncio.run(_all_choices(link, two, 1))
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events]
    assert chunk_text(chunks[0]) == "a"
    assert chunks[-1]["error"]["type"] == "service_unavailable"
    assert "status -9" in chunks[-1]["error"]["message"]
    assert all(event.startswith(b"data: {") and event.endswith(b"\n\n") for event in events)
