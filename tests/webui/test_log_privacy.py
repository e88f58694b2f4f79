"""Prompts and answers never reach the logs: a real server (and its engine) asked through every door — the
API's completions and chat, streamed or not, the chat WebSocket, tokenize and detokenize, and requests
refused for their content — prints none of what users sent or got back."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from serving import start_server, stop_server
from websockets.sync.client import connect

MARKER = "zebra-quartz-7741"  # in every prompt; any log line holding it leaks a prompt


def test_no_prompt_or_answer_is_logged(model_dir: Path) -> None:
    server = start_server(model_dir, "--parallel", "2")
    answers: list[str] = []
    try:
        api = server.url + "/v1"
        chat = {"messages": [{"role": "user", "content": f"tell me about {MARKER}"}], "max_tokens": 12}
        with httpx.Client(timeout=60) as client:
            answers.append(client.post(f"{api}/completions", json={"prompt": MARKER, "max_tokens": 12}).text)
            answers.append(client.post(f"{api}/chat/completions", json=chat).text)
            answers.append(client.post(f"{api}/chat/completions", json={**chat, "stream": True}).text)
            ids = client.post(server.url + "/tokenize", json={"prompt": MARKER}).json()["tokens"]
            client.post(server.url + "/detokenize", json={"tokens": ids})
            # Refused for their content: too long for the context, a bad stop list, a bad role.
            client.post(f"{api}/completions", json={"prompt": MARKER * 2000, "max_tokens": 4})
            client.post(f"{api}/completions", json={"prompt": MARKER, "stop": [MARKER] * 100})
            client.post(f"{api}/chat/completions", json={"messages": [{"role": MARKER, "content": MARKER}]})
        url = server.url.replace("http://", "ws://") + "/ws/chat"
        with connect(url, origin=server.url, open_timeout=30) as socket:
            message = {"type": "chat", "id": "a", "messages": [{"role": "user", "content": MARKER}]}
            socket.send(json.dumps({**message, "params": {"max_tokens": 12}}))
            while (event := json.loads(socket.recv(timeout=60)))["type"] == "delta":
                answers.append(event["text"])
    finally:
        stop_server(server)
    logs = server.process.stdout.read()
    assert MARKER not in logs
    texts = [t for t in _texts(answers) if len(t) >= 12]
    assert texts and not any(t in logs for t in texts)


def _texts(answers: list[str]) -> list[str]:
    """The generated texts in the answers' bodies (JSON, SSE lines or WebSocket deltas)."""
    found = []
    for body in answers:
        for line in body.splitlines() or [body]:
            payload = line.removeprefix("data: ").strip()
            try:
                value = json.loads(payload)
            except json.JSONDecodeError:
                found.append(payload)
                continue
            for choice in value.get("choices", []) if isinstance(value, dict) else []:
                found.append(choice.get("text") or (choice.get("message") or {}).get("content") or "")
    return [t.strip() for t in found if t and t.strip() and t.strip() != "[DONE]"]
