"""A real `strata serve --spec ngram` on the tiny hybrid checkpoint and `--spec mtp` on the demo model: the
answers of the server that does not draft, streamed and not, the spec_decode counters in `/metrics`, and a
request's own `spec_tokens` where the server cannot roll drafts back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, start_server, stop_server

COMPLETIONS = "/v1/completions"
PROMPT = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def drafting_server(model_dir: Path) -> Iterator[Server]:
    running = start_server(model_dir, "--parallel", "4", "--spec", "ngram", "--spec-tokens", "4")
    yield running
    stop_server(running)


def _body(**extra: object) -> dict:
    return {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}


def _text(server: Server, **extra: object) -> str:
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=_body(**extra), timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _streamed(server: Server) -> str:
    pieces = []
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=_body(stream=True), timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(pieces)


def _counter(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Accept": "text/plain"}, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_drafting_server_answers_like_one_that_does_not(server: Server, drafting_server: Server) -> None:
    plain = _text(server)
    assert _text(drafting_server) == plain
    assert _streamed(drafting_server) == plain
    assert _text(drafting_server, spec_tokens=0) == plain
    assert _counter(drafting_server, "vllm:spec_decode_num_drafts_total") > 0
    drafted = _counter(drafting_server, "vllm:spec_decode_num_draft_tokens_total")
    assert drafted >= _counter(drafting_server, "vllm:spec_decode_num_accepted_tokens_total")


def test_spec_tokens_on_a_server_that_cannot_roll_back_is_an_error(server: Server) -> None:
    for spec_tokens, message in [(2, "start the engine with --spec"), (99, "must be in [0, 16]")]:
        response = httpx.post(f"{server.url}{COMPLETIONS}", json=_body(spec_tokens=spec_tokens), timeout=60)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "spec_tokens" and message in error["message"]


def test_a_server_drafting_with_the_mtp_head_answers_like_one_that_does_not() -> None:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    answers, accepted = [], 0.0
    for flags in ([], ["--spec", "mtp", "--spec-tokens", "3"]):
        running = start_server(None, "--parallel", "2", *flags)
        try:
            response = httpx.post(f"{running.url}{COMPLETIONS}", json=body, timeout=120)
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["text"])
            accepted = _counter(running, "vllm:spec_decode_num_accepted_tokens_total")
        finally:
            stop_server(running)
    assert answers[0] == answers[1] and accepted > 0
