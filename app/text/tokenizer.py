"""A Hugging Face `tokenizer.json` tokenizer (or one rebuilt from a GGUF file's metadata) with the model's
special tokens and chat template."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from app.errors import StrataError
from app.jsonfile import read_json_object
from app.text.chat_template import ChatTemplate

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# GGUF token types that are special (control) or added by the model's authors (user-defined)
_GGUF_SPECIAL_TYPES = (3, 4)
# Qwen2's split of text into words before byte-level BPE (GGUF pre-tokenizer "qwen2")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


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

    @classmethod
    def load(cls, path: Path | str) -> "Tokenizer":
        """The tokenizer of a model: from a GGUF file's metadata, or from an HF directory's files."""
        return cls.from_gguf(Path(path)) if Path(path).suffix == ".gguf" else cls.from_dir(Path(path))

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        """Rebuild the byte-level BPE tokenizer (`tokenizer.ggml.model` gpt2, as llama.cpp writes Qwen models)
        stored in a GGUF file: its tokens, merges, special tokens, pre-tokenizer and chat template."""
        import gguf  # only needed for GGUF files

        from app.loading.gguf_file import gguf_shards

        try:
            fields = gguf.GGUFReader(gguf_shards(path)[0]).fields  # a split file's metadata is in its first
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc
        meta = {name: field.contents() for name, field in fields.items() if name.startswith("tokenizer.")}
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer {kind!r} in {path.name}; supported: gpt2 (BPE)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = tokenizers.Tokenizer(
            tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False)
        )
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = tokenizers.pre_tokenizers.ByteLevel
        if pre == "qwen2":
            split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT), behavior="isolated")
            backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
                [split, byte_level(add_prefix_space=False, use_regex=False)]
            )
        elif pre in ("default", "gpt2"):
            backend.pre_tokenizer = byte_level(add_prefix_space=False)
        else:
            raise TokenizerError(
                f"unsupported GGUF pre-tokenizer {pre!r} in {path.name}; supported: qwen2, gpt2"
            )
        backend.decoder = tokenizers.decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        backend.add_special_tokens(
            [
                tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                for i, kind in enumerate(types)
                if kind in _GGUF_SPECIAL_TYPES
            ]
        )

        def token(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        bos = token("bos") if meta.get("tokenizer.ggml.add_bos_token") else None
        return cls(
            backend,
            bos_token=bos,
            eos_token=token("eos"),
            pad_token=token("padding"),
            unk_token=token("unknown"),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, leaving out special tokens unless `skip_special_tokens` is False."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what llguidance reads)."""
        return self._backend.to_str()

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
