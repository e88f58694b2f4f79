"""What a request's structured-output and tool fields ask of its tokens: the engine's `Grammar`, checked.

`response_format` (OpenAI: `json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (Lark, as llguidance reads it) and its `structured_outputs` object each
become one grammar; a request may give one of them. `tool_choice` `required` or a named function becomes a
grammar of Qwen3's tool-call blocks holding the tools' names and parameter schemas, so that the answer is
one or more calls (one with a named function, or with `parallel_tool_calls` false) and always valid JSON.
"""

from __future__ import annotations

import json
from typing import Any

from app.engine.grammar_source import JSON_OPTIONS, check_grammar
from app.engine.protocol import Grammar, InvalidRequest
from app.text.answer import CALL_CLOSE, CALL_OPEN
from webui.openai_schema import ChatCompletionRequest, NamedToolChoice, SamplingRequest, Tool


def request_grammar(request: SamplingRequest) -> Grammar | None:
    """The grammar a request's structured-output fields ask for (None: free text), compiled once to check
    it; InvalidRequest naming the field when two are given or one cannot be compiled."""
    given = _structured_fields(request)
    if len(given) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in given))
        raise InvalidRequest(f"give one structured output, not several ({names})", given[1][0])
    if not given:
        return None
    grammar = given[0][1]
    check_grammar(grammar)
    return grammar


def _structured_fields(request: SamplingRequest) -> list[tuple[str, Grammar]]:
    """Each structured-output field the request sets, as (its name, its grammar)."""
    found: list[tuple[str, Grammar]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", Grammar("json_object", param="response_format")))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                message = "response_format json_schema needs json_schema.schema"
                raise InvalidRequest(message, "response_format")
            found.append(("response_format", _json(fmt.json_schema.schema_, "response_format")))
    if request.guided_json is not None:
        found.append(("guided_json", _json(request.guided_json, "guided_json")))
    if request.guided_regex is not None:
        found.append(("guided_regex", Grammar("regex", request.guided_regex, "guided_regex")))
    if request.guided_choice is not None:
        found.append(("guided_choice", Grammar("choice", json.dumps(request.guided_choice), "guided_choice")))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", Grammar("lark", request.guided_grammar, "guided_grammar")))
    outputs = request.structured_outputs
    if outputs is not None:
        param = "structured_outputs"
        if outputs.json is not None:
            found.append((param, _json(outputs.json, param)))
        if outputs.regex is not None:
            found.append((param, Grammar("regex", outputs.regex, param)))
        if outputs.choice is not None:
            found.append((param, Grammar("choice", json.dumps(outputs.choice), param)))
        if outputs.grammar is not None:
            found.append((param, Grammar("lark", outputs.grammar, param)))
    return found


def _json(schema: Any, param: str) -> Grammar:
    """A JSON-schema grammar from a schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{param} is not JSON: {exc}", param) from None
    return Grammar("json_schema", json.dumps(schema), param)


def tool_choice_grammar(request: ChatCompletionRequest) -> Grammar | None:
    """The grammar that makes the answer tool calls (`tool_choice` required or named), else None;
    InvalidRequest where the choice names no tool given or a tool's parameters cannot be compiled."""
    choice, tools = request.tool_choice, request.tools or []
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            named = choice.function.name
            raise InvalidRequest(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
        tools, many = chosen, False
    else:
        many = request.parallel_tool_calls is not False
    schema = {"anyOf": [_call_schema(tool) for tool in tools], "x-guidance": JSON_OPTIONS}
    repeat = ' ("\\n" call)*' if many else ""
    lark = (
        f"start: call{repeat}\n"
        f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
        f"body: %json {json.dumps(schema)}\n"
    )
    grammar = Grammar("lark", lark, "tools")
    check_grammar(grammar)
    return grammar


def _call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON of one call to `tool`: its name, then arguments matching its parameters."""
    parameters = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
