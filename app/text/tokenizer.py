"""A Hugging Face `tokenizer.json` tokenizer with the model's special tokens and chat template."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from app.errors import StrataError
from app.jsonfile import read_json_object
from app.text.chat_template import ChatTemplate

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(StrataError):
    """A tokenizer could not be loaded or cannot do what was asked of it."""


def _token_content(value: Any) -> str | None:
    """A special token from `tokenizer_config.json`: a string or an AddedToken dict `{"content": ...}`."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _config_chat_template(value: Any) -> str | None:
    """The chat template from `tokenizer_config.json`: a string or a list of `{"name", "template"}` dicts."""
    if isinstance(value, list):
        defaults = (entry for entry in value if isinstance(entry, dict) and entry.get("name") == "default")
        return next((entry.get("template") for entry in defaults), None)
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text to token ids and back, plus chat rendering, over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap `backend` with the given special tokens and optional chat template source."""
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._chat_template = (
            ChatTemplate(
                chat_template,
                bos_token=bos_token,
                eos_token=eos_token,
                pad_token=pad_token,
                unk_token=unk_token,
            )
            if chat_template is not None
            else None
        )

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        """Load `tokenizer.json`, plus `tokenizer_config.json` and `chat_template.jinja` when present.

        A `chat_template.jinja` file takes priority over the config's `chat_template`, as in transformers.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"cannot load {tokenizer_file}: {' '.join(str(exc).split())}") from exc
        config_file = path / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _config_chat_template(config.get("chat_template"))
        tokens = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        return cls(backend, chat_template=chat_template, **tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, leaving out special tokens unless `skip_special_tokens` is False."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The token with id `i`, or None when there is none."""
        return self._backend.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token, if the model has one."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token, if the model has one."""
        return self._eos_token

    @property
    def eos_token_id(self) -> int | None:
        """The id of the end-of-sequence token, if the model has one."""
        return self.token_to_id(self._eos_token) if self._eos_token is not None else None

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template, if it has one."""
        return self._chat_template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the chat template; `extra` (e.g. `tools`, `enable_thinking`) reaches it."""
        if self._chat_template is None:
            raise TokenizerError("model has no chat template")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat, encoded without adding special tokens (the template has them)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)
