"""The chat page: streamed answers, stop, sampling settings, conversations kept in local storage."""

from __future__ import annotations

import json
import time

import httpx
from playwright.sync_api import Page, expect
from serving import Server

ANSWER_TIMEOUT_MS = 180_000


def _stored(page: Page) -> list[dict]:
    return page.evaluate("() => JSON.parse(localStorage.getItem('strata.conversations'))")


def _open_chat(page: Page, server: Server, temperature: str, max_tokens: str) -> None:
    page.goto(server.url + "/")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    page.get_by_label("Temperature").fill(temperature)
    page.get_by_label("Max tokens").fill(max_tokens)


def _running(server: Server) -> int:
    return httpx.get(f"{server.url}/metrics?format=json", timeout=10).json()["num_requests_running"]


def test_answer_streams_and_equals_the_api(page: Page, live_server: Server) -> None:
    _open_chat(page, live_server, temperature="0", max_tokens="12")
    prompt = page.get_by_label("Message")
    prompt.fill("Hello")
    prompt.press("Shift+Enter")
    expect(prompt).to_have_value("Hello\n")
    expect(page.locator("article.message")).to_have_count(0)
    prompt.fill("Hello")
    prompt.press("Enter")

    answer = page.locator("article.assistant").last
    expect(answer).to_have_attribute("data-status", "done", timeout=ANSWER_TIMEOUT_MS)
    expect(answer.locator(".body")).to_have_attribute("aria-live", "polite")
    stats = answer.locator(".stats")
    expect(stats).to_contain_text("first token")
    expect(stats).to_contain_text("12 tokens")
    expect(stats).to_contain_text("tok/s")

    whole = httpx.post(
        f"{live_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 12},
        timeout=ANSWER_TIMEOUT_MS / 1000,
    ).json()
    expected = whole["choices"][0]["message"]["content"]
    conversations = _stored(page)
    assert len(conversations) == 1
    assert [m["role"] for m in conversations[0]["messages"]] == ["user", "assistant"]
    assert conversations[0]["messages"][1]["content"] == expected

    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_server.url)
    answer.get_by_role("button", name="Copy answer").click()
    expect(answer.get_by_role("button", name="Copy answer")).to_have_text("Copied")
    assert page.evaluate("() => navigator.clipboard.readText()") == expected

    page.reload()
    expect(page.locator("#conversations button.conversation")).to_have_count(1)
    expect(page.locator("#conversations button.conversation")).to_have_attribute("aria-current", "true")
    expect(page.locator("article.assistant")).to_have_attribute("data-status", "done")
    expect(page.get_by_label("Temperature")).to_have_value("0")
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("article.message")).to_have_count(0)


def test_stop_aborts_the_answer(page: Page, live_server: Server) -> None:
    _open_chat(page, live_server, temperature="0", max_tokens="2000")
    page.get_by_label("Message").fill("Hello")
    page.get_by_role("button", name="Send").click()
    answer = page.locator("article.assistant").last
    body = answer.locator(".body")
    expect(body).not_to_be_empty(timeout=ANSWER_TIMEOUT_MS)
    expect(answer).to_have_attribute("data-status", "streaming")
    expect(body).to_have_attribute("aria-busy", "true")
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_enabled()
    stop.click()

    expect(answer).to_have_attribute("data-status", "stopped")
    expect(answer.locator(".stats")).to_contain_text("stopped")
    expect(body).to_have_attribute("aria-busy", "false")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(stop).to_be_disabled()
    stopped_text = body.inner_text()
    stopped_length = len(_stored(page)[0]["messages"][1]["content"])
    assert stopped_length > 0

    deadline = time.monotonic() + 30
    while _running(live_server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(live_server) == 0, "the engine still runs the stopped request"
    page.wait_for_timeout(1500)  # an answer that kept streaming would grow in this time
    assert body.inner_text() == stopped_text
    assert len(_stored(page)[0]["messages"][1]["content"]) == stopped_length


def test_model_text_is_escaped_and_code_fences_render(page: Page, live_server: Server) -> None:
    hostile = (
        'Look: <img src=x onerror="window.hacked=1"> `inline`\n\n```python\nprint("<b>hi</b>")\n```\nafter'
    )
    conversation = {
        "id": "c1",
        "title": "fences",
        "messages": [
            {"role": "user", "content": "<script>window.hacked=1</script>"},
            {"role": "assistant", "id": "a1", "content": hostile, "status": "done", "stats": {}},
        ],
    }
    page.goto(live_server.url + "/")
    page.evaluate(
        "([store, id]) => { localStorage.setItem('strata.conversations', store);"
        " localStorage.setItem('strata.currentConversation', id); }",
        [json.dumps([conversation]), "c1"],
    )
    page.reload()
    answer = page.locator("article.assistant")
    expect(answer.locator("pre code")).to_have_text('print("<b>hi</b>")')
    expect(answer.locator(".code-head")).to_contain_text("python")
    expect(answer.locator("p code")).to_have_text("inline")
    expect(answer.locator("p").first).to_contain_text('<img src=x onerror="window.hacked=1">')
    expect(answer.locator("p").last).to_have_text("after")
    assert page.locator("img, script:not([src]), b").count() == 0
    expect(page.locator("article.user")).to_contain_text("<script>")
    assert page.evaluate("() => window.hacked") is None
