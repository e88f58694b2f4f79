"""The chat page shows a thinking model's reasoning collapsed above the answer, and tool calls as cards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from checkpoints import write_checkpoint
from playwright.sync_api import Page, expect
from serving import Server, start_server, stop_server

from app.text.tiny import CHATML_TEMPLATE

THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A tiny model whose template opens a think block for every answer (as thinking models' do)."""
    path = write_checkpoint(tmp_path_factory.mktemp("thinking"), "qwen3_moe", max_position_embeddings=4096)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert THINKING_TEMPLATE != CHATML_TEMPLATE
    config_file.write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    running = start_server(path, "--parallel", "2")
    yield running
    stop_server(running)


def test_a_thinking_answers_reasoning_streams_into_a_collapsed_part(
    page: Page, thinking_server: Server
) -> None:
    page.goto(thinking_server.url + "/")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("12")
    page.get_by_label("Message").fill("Hello")
    page.get_by_label("Message").press("Enter")
    answer = page.locator("article.assistant").last
    expect(answer).to_have_attribute("data-status", "done", timeout=180_000)
    reasoning = answer.locator("details.reasoning")
    expect(reasoning).to_have_count(1)
    expect(reasoning).not_to_have_attribute("open", "")
    expected = httpx.post(
        f"{thinking_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 12},
        timeout=120,
    ).json()["choices"][0]["message"]
    assert expected["reasoning_content"]  # the tiny model never closes its think block: all reasoning
    reasoning.locator("summary").click()
    expect(answer.locator(".reasoning-text")).to_have_text(expected["reasoning_content"])


def test_tool_calls_are_shown_as_cards_with_their_arguments(page: Page, thinking_server: Server) -> None:
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    stored = [
        {
            "id": "c1",
            "title": "Weather",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "id": "a1", "content": "", "status": "done", "tool_calls": [call]},
            ],
        }
    ]
    page.goto(thinking_server.url + "/")
    page.evaluate(
        "([list]) => { localStorage.setItem('strata.conversations', list);"
        " localStorage.setItem('strata.currentConversation', 'c1'); }",
        [json.dumps(stored)],
    )
    page.reload()
    card = page.get_by_role("region", name="Tool call get_weather")
    expect(card).to_be_visible()
    expect(card.locator("pre")).to_have_text(json.dumps({"city": "Paris", "days": 2}, indent=2))
