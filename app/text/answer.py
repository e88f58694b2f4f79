"""An assistant's answer taken apart as it streams: reasoning, content and tool calls.

Qwen3's chat templates have the model think inside `<think>...</think>` (or open the think block in the
prompt, so the answer starts inside it) and call tools with blocks of
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. `AnswerSplitter.feed` takes the answer's
text piece by piece and returns what each piece adds, as OpenAI's deltas carry it: reasoning, content, or a
whole tool call once its block has closed. Text that may be the start of a tag is held back until the next
piece says whether it is one; `finish` hands out what is left (a block that never closed stays content).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass
class AnswerParts:
    """What a piece of the answer adds: reasoning text, content text, whole tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: AnswerParts) -> None:
        """Append `other` to these parts."""
        self.reasoning += other.reasoning
        self.content += other.content
        if other.tool_calls:
            self.tool_calls = [*(self.tool_calls or []), *other.tool_calls]


def parse_tool_call(block: str) -> ToolCall | None:
    """The call in a tool-call block's text, or None when it is not `{"name": str, "arguments": ...}`."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], text)


class AnswerSplitter:
    """Splits an answer's text into reasoning, content and tool calls as it arrives.

    `thinking` says the prompt left the model inside a think block; without it a think block counts only
    where the answer opens with one. With `tools` off, tool-call blocks stay content.
    """

    def __init__(self, thinking: bool = False, tools: bool = True) -> None:
        self.tools = tools
        self._state = "reasoning" if thinking else "start"
        self._held = ""  # text not yet handed out: a possible tag's start, or an open tool-call block
        self.calls = 0

    def feed(self, text: str) -> AnswerParts:
        """What `text`, the answer's next piece, adds."""
        self._held += text
        parts = AnswerParts()
        while self._held:
            if not self._step(parts):
                break
        return parts

    def finish(self) -> AnswerParts:
        """What is left once the answer has ended."""
        parts = AnswerParts()
        held, self._held = self._held, ""
        if self._state == "reasoning":
            parts.reasoning += held
        elif self._state == "call":
            parts.content += CALL_OPEN + held
        elif self._state == "content":
            parts.content += held
        self._state = "content"
        return parts

    def _step(self, parts: AnswerParts) -> bool:
        """Hand out what the held text settles; False when it needs more text first."""
        held = self._held
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._held, self._state = stripped[len(THINK_OPEN) :], "reasoning"
                return True
            if stripped and not THINK_OPEN.startswith(stripped):
                self._held, self._state = stripped, "content"
                return True
            return False
        if self._state == "reasoning":
            return self._until(THINK_CLOSE, parts, "reasoning", "after_think")
        if self._state in ("after_think", "after_call"):  # the blank lines after a block
            stripped = held.lstrip()
            if not stripped:
                return False
            self._held, self._state = stripped, "content"
            return True
        if self._state == "content":
            if not self.tools:
                parts.content += held
                self._held = ""
                return True
            return self._until(CALL_OPEN, parts, "content", "call")
        end = held.find(CALL_CLOSE)  # inside a tool-call block: wait for its end
        if end < 0:
            return False
        block, self._held, self._state = held[:end], held[end + len(CALL_CLOSE) :], "content"
        call = parse_tool_call(block.strip())
        if call is None:
            parts.content += CALL_OPEN + block + CALL_CLOSE
        else:
            self.calls += 1
            parts.tool_calls = [*(parts.tool_calls or []), call]
            self._state = "after_call"
        return True

    def _until(self, tag: str, parts: AnswerParts, field: str, then: str) -> bool:
        """Hand the held text up to `tag` to `field` and go to state `then` past it; without the tag, hand
        out all but a tail that could start it."""
        held = self._held
        at = held.find(tag)
        if at >= 0:
            setattr(parts, field, getattr(parts, field) + held[:at])
            self._held, self._state = held[at + len(tag) :], then
            return True
        keep = _partial_tag(held, tag)
        out = held[: len(held) - keep]
        setattr(parts, field, getattr(parts, field) + out)
        self._held = held[len(held) - keep :]
        return False


def _partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters are the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def opens_thinking(decode: Callable[[list[int]], str], prompt: list[int]) -> bool:
    """Whether a rendered prompt (token ids; `decode` gives their text, special tokens kept) leaves the
    model inside a think block, as thinking templates do."""
    return decode(prompt[-16:]).rstrip().endswith(THINK_OPEN)


def split_answer(text: str, thinking: bool = False, tools: bool = True) -> AnswerParts:
    """A whole answer's reasoning, content and tool calls."""
    splitter = AnswerSplitter(thinking, tools)
    parts = splitter.feed(text)
    parts.add(splitter.finish())
    return parts
