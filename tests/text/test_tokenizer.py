"""Tokenizer loading, encoding and chat encoding, checked against transformers on the tiny tokenizer."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.errors import StrataError
from app.text.chat_template import ChatTemplateError
from app.text.tiny import CHATML_TEMPLATE, write_tiny_tokenizer
from app.text.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "Emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "中文分词测试，日本語のテキスト、한국어",
    "Accents: café, naïve, Åström, e\u0301",
    "Specials inline: <|im_start|>user\nhi<|im_end|><|endoftext|>",
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime. 🔢"},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "中文呢？"},
    ],
]


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' view of the tiny tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_dir)


def copy_tokenizer_json(src: Path, dst: Path, config: dict | None = None) -> Path:
    """A tokenizer directory with `src`'s tokenizer.json and the given tokenizer_config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


def test_tiny_layout(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.bos_token is None
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.chat_template is not None
    assert tok.chat_template.source == CHATML_TEMPLATE


def test_tiny_is_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()


@pytest.mark.parametrize(("vocab_size", "expected"), [(259, 259), (300, 300), (4096, None)])
def test_tiny_vocab_size(tmp_path: Path, vocab_size: int, expected: int | None) -> None:
    write_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    size = Tokenizer.from_dir(tmp_path).vocab_size
    assert size == expected if expected is not None else 512 < size <= vocab_size


def test_tiny_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 259"):
        write_tiny_tokenizer(tmp_path, vocab_size=258)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_characters_split_into_byte_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1
    assert tok.decode(ids) == "😀"


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1
    assert ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)
    assert tok.token_to_id("<|not_a_token|>") is None


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers_ids(tok: Tokenizer, hf: PreTrainedTokenizerBase, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_matches_transformers_metadata(tok: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.eos_token == hf.eos_token
    assert tok.eos_token_id == hf.eos_token_id
    assert tok.bos_token == hf.bos_token


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages", CHATS)
def test_chat_matches_transformers(
    tok: Tokenizer, hf: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == want
    assert ids[0] == tok.token_to_id("<|im_start|>")


def test_chat_generation_prompt_default(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    assert isinstance(info.value, StrataError)
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json" in str(info.value)
    assert "\n" not in str(info.value)


def test_invalid_config(tmp_path: Path, tiny_dir: Path) -> None:
    copy_tokenizer_json(tiny_dir, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(StrataError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)


def test_without_config_has_no_chat_template(tmp_path: Path, tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(copy_tokenizer_json(tiny_dir, tmp_path))
    assert tok.chat_template is None
    assert tok.eos_token is None
    assert tok.eos_token_id is None
    assert tok.vocab_size == 512
    with pytest.raises(TokenizerError, match="^model has no chat template$"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="^model has no chat template$"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_template_list_and_added_token_dicts(tmp_path: Path, tiny_dir: Path) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "normalized": False},
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS{{ messages | length }}"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
        ],
    }
    path = copy_tokenizer_json(tiny_dir, tmp_path, config)
    tok = Tokenizer.from_dir(path)
    assert tok.bos_token == "<|endoftext|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "<|endoftext|>hi<|im_end|>"
    hf = AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert tok.encode_chat(messages) == hf.apply_chat_template(messages, tokenize=True, return_dict=False)


@pytest.mark.parametrize("config_template", [None, "CONFIG{{ messages | length }}"])
def test_chat_template_jinja_file(tmp_path: Path, tiny_dir: Path, config_template: str | None) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if config_template is not None:
        config["chat_template"] = config_template
    path = copy_tokenizer_json(tiny_dir, tmp_path, config)
    (path / "chat_template.jinja").write_text("FILE{{ messages[0].content }}", encoding="utf-8")
    messages = [{"role": "user", "content": "hi"}]
    text = Tokenizer.from_dir(path).apply_chat_template(messages)
    assert text == "FILEhi"
    assert text == AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)


def test_chat_extra_kwargs_and_errors(tmp_path: Path, tiny_dir: Path) -> None:
    template = (
        "{% if enable_thinking is defined and not enable_thinking %}"
        "{{ raise_exception('no thinking') }}{% endif %}"
        "{{ tools | length if tools else 0 }}"
    )
    path = copy_tokenizer_json(tiny_dir, tmp_path, {"chat_template": template})
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template([], tools=[{"name": "a"}, {"name": "b"}]) == "2"
    with pytest.raises(ChatTemplateError, match="^no thinking$"):
        tok.apply_chat_template([], enable_thinking=False)


def test_bad_chat_template_fails_on_load(tmp_path: Path, tiny_dir: Path) -> None:
    path = copy_tokenizer_json(tiny_dir, tmp_path, {"chat_template": "{% if %}"})
    with pytest.raises(ChatTemplateError, match="^chat template syntax error"):
        Tokenizer.from_dir(path)
