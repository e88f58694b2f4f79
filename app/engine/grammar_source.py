"""A request's grammar as llguidance's grammar text, checked: torch-free, so that the web server refuses a
grammar that cannot compile (a 400 naming the field) before the engine sees it (app/engine/grammar.py uses
the same text)."""

from __future__ import annotations

import json
import re

import llguidance

from app.engine.protocol import Grammar, InvalidRequest

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(grammar: Grammar) -> str:
    """The llguidance grammar of a request's `grammar`; InvalidRequest naming `grammar.param` when it
    cannot be built."""
    kind, source = grammar.kind, grammar.source
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    try:
        return _from_source(kind, source, grammar.param)
    except InvalidRequest:
        raise
    except Exception as exc:  # llguidance refuses what it cannot read with plain exceptions
        raise not_compiled(grammar, str(exc)) from None


def _from_source(kind: str, source: str, param: str) -> str:
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"the JSON schema is not JSON: {exc}", param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("a JSON schema must be an object", param)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        choices = json.loads(source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest("choices must be a non-empty list of non-empty strings", param)
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(source)
    raise InvalidRequest(f"unknown grammar kind {kind!r}", param)


def check_grammar(grammar: Grammar) -> str:
    """The grammar's llguidance text once it is known to compile; InvalidRequest with the reason if not."""
    text = grammar_text(grammar)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise not_compiled(grammar, error)
    return text


def not_compiled(grammar: Grammar, error: str) -> InvalidRequest:
    """The error of a grammar that cannot be compiled, with llguidance's reason on one line."""
    reason = " ".join(error.split())[:400]
    return InvalidRequest(f"the {grammar.describe()} cannot be compiled: {reason}", grammar.param)
