"""The engine link tokenizes prompts on worker threads, never on the server's event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from webui.engine_link import EngineLink


class RecordingTokenizer:
    """Answers like a tokenizer and notes the thread each call ran on."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return [len(text)]

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        self.threads.append(threading.current_thread())
        return [len(messages)]


def test_prompts_are_tokenized_off_the_event_loop() -> None:
    link = EngineLink.__new__(EngineLink)  # only the tokenizer is used: no engine is started
    tokenizer = RecordingTokenizer()
    link.tokenizer = tokenizer  # type: ignore[assignment]

    async def tokenize() -> tuple[threading.Thread, list[int]]:
        text = await link.encode("hello")
        chat = await link.encode_chat([{"role": "user", "content": "hi"}], True)
        return threading.current_thread(), [*text, *chat]

    loop_thread, tokens = asyncio.run(tokenize())
    assert tokens == [5, 1]
    assert len(tokenizer.threads) == 2 and loop_thread not in tokenizer.threads
