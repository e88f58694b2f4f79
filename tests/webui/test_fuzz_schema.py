"""Schemathesis over the served OpenAPI schema (`/schema/openapi.json`): bodies the schema allows and bodies
that break it, generated for every operation against a real server and engine. None gets a 5xx; every refusal
is an OpenAI-style error; afterwards the engine still answers as before.

`STRATA_FUZZ_EXAMPLES` (default 15 an operation and mode) sets how many; the long run uses 1,000."""

from __future__ import annotations

import os
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from serving import Server

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "15"))


GREEDY = {"prompt": "after the storm", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def answer_before(server: Server) -> str:
    """A greedy answer taken before any generated request."""
    return httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def served_schema(server: Server, answer_before: str) -> Any:
    return schemathesis.openapi.from_url(server.url + "/schema/openapi.json")


def openai_error(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """A refused request (4xx) says why as OpenAI does: {"error": {"message", "type", ...}}."""
    if 400 <= response.status_code < 500:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and error.get("message") and error.get("type"), body
    return None


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_no_generated_request_gets_a_server_error(
    served_schema: Any, mode: schemathesis.GenerationMode
) -> None:
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= {op.path for op in operations}
    for operation in operations:
        inputs = list(operation.iter_parameters()) or operation.get_request_payload_content_types()
        if mode is schemathesis.GenerationMode.NEGATIVE and not inputs:
            continue  # nothing to break (GET /v1/models, /health)

        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        def call(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 16)  # bounded work, not bounded bodies
            response = case.call(timeout=120)
            case.validate_response(response, checks=[not_a_server_error, openai_error])

        call()


def test_the_engine_answers_as_before_after_the_fuzzing(server: Server, answer_before: str) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    after = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == answer_before
