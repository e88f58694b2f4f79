"""Rendering of Hugging Face chat templates (Jinja2) with the semantics of transformers."""

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.errors import StrataError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(StrataError):
    """A chat template failed to compile or to render, or rejected the conversation."""


def _raise_exception(message: str) -> NoReturn:
    """Template global: abort rendering with the template's own message."""
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter: JSON without Jinja's HTML escaping, as transformers defines it."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Template global: the current local time formatted with `fmt`."""
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """Template global `dict`: builds dicts without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        """Build a dict like `dict(...)`."""
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        """Build a dict like `dict.fromkeys(...)`."""
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Template global `namespace` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _one_line(text: str) -> str:
    """Collapse all whitespace runs of `text` into single spaces."""
    return " ".join(text.split())


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys and expose the reasoning under every name templates read, like transformers."""
    prepared = {key: value for key, value in message.items() if value is not None}
    reasoning = next((prepared[key] for key in _REASONING_FIELDS if key in prepared), None)
    if reasoning is not None:
        prepared = {"thinking": reasoning, **prepared, "reasoning_content": reasoning}
    return prepared


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja2 environment that transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled Hugging Face `chat_template` bound to a tokenizer's special tokens."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        """Compile `source`; raise ChatTemplateError on a syntax error.

        Special tokens that are None are left undefined in the template, as transformers does.
        """
        self.source = source
        tokens = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "pad_token": pad_token,
            "unk_token": unk_token,
        }
        self.special_tokens = {name: token for name, token in tokens.items() if token is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                _one_line(f"chat template syntax error at line {exc.lineno}: {exc.message}")
            ) from exc

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to text.

        The template sees `messages`, `tools`, `documents` (None unless given), `add_generation_prompt`, the
        special tokens and `extra` (e.g. `enable_thinking`), which overrides special tokens of the same name.
        """
        context = {
            **self.special_tokens,
            "documents": None,
            **extra,
            "messages": [_prepare_message(message) for message in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatTemplateError(_one_line(f"chat template failed: {exc}")) from exc
