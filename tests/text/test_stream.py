"""Streaming detokenization: deltas join to the full decode; incomplete characters and stops are held back."""

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from app.text.stream import TextStream
from app.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "Emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧 done",
    "中文分词测试，日本語のテキスト、한국어",
    "Accents: café, naïve, Åström, e\u0301, ñandú",
    "  spaces  \n\n\ttabs\r\nand 😀 at the end 😀",
    "The river town woke slowly. 🌊🏞️ Fishermen pulled their boats.",
]

CHATML_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


class RecordingTokenizer(Tokenizer):
    """A tokenizer that records how many ids each decode was given."""

    decoded_lengths: list[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode as usual, noting the number of ids."""
        self.decoded_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def stream_deltas(stream: TextStream, ids: Sequence[int], step: int = 1) -> list[str]:
    """The deltas of feeding `ids` to `stream` `step` at a time, then finishing it."""
    deltas = [stream.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, stream.finish()]


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte of `data`, from encoding it a character at a time (each must split into bytes)."""
    ids = []
    for char in data.decode("utf-8"):
        pieces = tok.encode(char, add_special_tokens=False)
        assert len(pieces) == len(char.encode("utf-8"))
        ids += pieces
    return ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Say something:", CHATML_PROMPT])
def test_token_by_token_equals_full_decode(tok: Tokenizer, text: str, prompt: str) -> None:
    ids = tok.encode(text)
    stream = TextStream(tok, tok.encode(prompt))
    deltas = stream_deltas(stream, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert stream.text == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert not stream.stopped


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4
    stream = TextStream(tok, [])
    assert [stream.add([i]) for i in ids] == ["", "", "", "😀"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [2, 3, 7])
def test_batches_of_tokens_equal_full_decode(tok: Tokenizer, text: str, step: int) -> None:
    ids = tok.encode(text)
    deltas = stream_deltas(TextStream(tok, []), ids, step)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_text_before_an_incomplete_character_is_not_delayed(tok: Tokenizer) -> None:
    ids = tok.encode("ab😀")
    stream = TextStream(tok, [])
    assert stream.add(ids[:-1]) == "ab"
    assert stream.add(ids[-1:]) == "😀"


def test_incomplete_character_at_the_end_comes_out_of_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]
    stream = TextStream(tok, [])
    deltas = [stream.add([i]) for i in ids]
    assert "".join(deltas) == "ok "
    assert stream.finish() == tok.decode(ids)[len("ok ") :] == "\ufffd"
    assert stream.text == tok.decode(ids)


@pytest.mark.parametrize("seed", range(200))
def test_random_tokens_reassemble_to_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    skip = seed % 2 == 0
    prompt = rng.choice([[], tok.encode("Hello"), tok.encode(CHATML_PROMPT)])
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
    stream = TextStream(tok, prompt, skip_special_tokens=skip)
    deltas = stream_deltas(stream, ids, rng.choice([1, 1, 2, 5]))
    expected = tok.decode(ids, skip)
    assert "".join(deltas) == expected
    assert stream.text == expected


@pytest.mark.parametrize("seed", range(50))
def test_random_bytes_reassemble_to_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    pool = byte_token_ids(tok, "a é中😀".encode())
    ids = [rng.choice(pool) for _ in range(rng.randrange(1, 120))]
    deltas = stream_deltas(TextStream(tok, []), ids)
    assert "".join(deltas) == tok.decode(ids)


def test_long_run_of_invalid_bytes_streams_with_a_bounded_window(tiny_dir: Path) -> None:
    rec = RecordingTokenizer.from_dir(tiny_dir)
    rec.decoded_lengths = []
    continuation = byte_token_ids(rec, "é".encode())[1]
    ids = rec.encode("start ") + [continuation] * 300 + rec.encode(" end 😀" * 50)
    expected = rec.decode(ids)
    rec.decoded_lengths.clear()
    stream = TextStream(rec, [])
    deltas = [stream.add([i]) for i in ids]
    assert "\ufffd" * 250 in "".join(deltas)
    assert "".join(deltas) + stream.finish() == expected
    assert max(rec.decoded_lengths) <= 2 * 8 + 2


def test_special_tokens_kept_or_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>there<|endoftext|>")
    assert "".join(stream_deltas(TextStream(tok, [], skip_special_tokens=True), ids)) == "Hithere"
    kept = "".join(stream_deltas(TextStream(tok, [], skip_special_tokens=False), ids))
    assert kept == "Hi<|im_end|>there<|endoftext|>"


def test_skipped_special_tokens_inside_a_character(tok: Tokenizer) -> None:
    emoji = tok.encode("😀")
    ids = [emoji[0], 0, 1, emoji[1], 2, *emoji[2:]] + [0] * 40
    stream = TextStream(tok, [])
    deltas = stream_deltas(stream, ids)
    assert "".join(deltas) == tok.decode(ids) == "😀"
    ids_kept_specials = "".join(stream_deltas(TextStream(tok, [], skip_special_tokens=False), ids))
    assert ids_kept_specials == tok.decode(ids, False)


def run_with_stop(
    tok: Tokenizer, text: str, stop: Sequence[str], include_stop: bool = False, step: int = 1
) -> tuple[TextStream, list[str]]:
    """Stream `text`'s tokens `step` at a time with stop strings `stop`; the stream and the add deltas."""
    ids = tok.encode(text)
    stream = TextStream(tok, [], stop=stop, include_stop=include_stop)
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(stream.add(ids[i : i + step]))
        if stream.stopped:
            break
    return stream, deltas


def test_single_token_stop(tok: Tokenizer) -> None:
    text = "Hello! How can I help you today?"
    assert "!" in [tok.decode([i]) for i in tok.encode(text)]
    stream, deltas = run_with_stop(tok, text, ["!"])
    assert stream.stopped
    assert "".join(deltas) == stream.text == "Hello"
    assert stream.add(tok.encode(" more")) == ""
    assert stream.finish() == ""
    assert stream.text == "Hello"


def test_stop_spanning_several_tokens(tok: Tokenizer) -> None:
    text = "Stop here: END. More text after."
    assert [tok.decode([i]) for i in tok.encode("END")] == ["E", "N", "D"]
    stream, deltas = run_with_stop(tok, text, ["END."])
    assert stream.stopped
    assert "".join(deltas) == "Stop here: "
    assert not any(part in delta for delta in deltas for part in "END.")


def test_stop_in_the_middle_of_a_token(tok: Tokenizer) -> None:
    text = "The river town woke slowly."
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert "ver" in pieces
    _, deltas = run_with_stop(tok, text, ["e"])
    assert "".join(deltas) == "Th"
    _, deltas = run_with_stop(tok, text, ["iv"])
    assert "".join(deltas) == "The r"
    stream, deltas = run_with_stop(tok, text, ["ive"], include_stop=True)
    assert stream.stopped
    assert "".join(deltas) == "The rive"


def test_include_stop(tok: Tokenizer) -> None:
    text = "Stop here: END. More text after."
    stream, deltas = run_with_stop(tok, text, ["END."], include_stop=True)
    assert stream.stopped
    assert "".join(deltas) == stream.text == "Stop here: END."
    assert stream.add(tok.encode("x")) == "" and stream.finish() == ""


def test_earlier_stop_wins(tok: Tokenizer) -> None:
    text = "Hello! How can I help you today?"
    for stop in (["help", "How"], ["How", "help"]):
        _, deltas = run_with_stop(tok, text, stop)
        assert "".join(deltas) == "Hello! "
        _, deltas = run_with_stop(tok, text, stop, include_stop=True)
        assert "".join(deltas) == "Hello! How"


@pytest.mark.parametrize("step", [1, 2, 3, 100])
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_result_does_not_depend_on_batching(tok: Tokenizer, step: int, include_stop: bool) -> None:
    text = "Stop here: END. More text after."
    expected = {False: "Stop here: E", True: "Stop here: END"}[include_stop]
    stream, deltas = run_with_stop(tok, text, ["END. More", "ND", "xyz"], include_stop, step)
    assert stream.stopped
    assert "".join(deltas) == expected


def test_stop_prefix_that_is_not_a_stop_is_emitted_later(tok: Tokenizer) -> None:
    text = "Hello! How can I help you today?"
    stream, deltas = run_with_stop(tok, text, ["How are"])
    assert not stream.stopped
    assert "" in deltas
    joined = "".join(deltas)
    assert joined == "Hello! How can I help you today?"
    at_how = [tok.decode([i]) for i in tok.encode(text)].index("H", 1)
    assert "".join(deltas[: at_how + 1]) == "Hello! "
    assert deltas[at_how + 1] == ""
    assert deltas[at_how + 2] == "How can"


def test_held_back_stop_prefix_comes_out_of_finish(tok: Tokenizer) -> None:
    stream, deltas = run_with_stop(tok, "Stop here: EN", ["END"])
    assert "".join(deltas) == "Stop here: "
    assert stream.finish() == "EN"
    assert not stream.stopped
    assert stream.text == "Stop here: EN"
    assert stream.add(tok.encode("D")) == ""


@pytest.mark.parametrize("seed", range(100))
def test_stop_never_leaks(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = rng.choice(TEXTS)
    start = rng.randrange(len(text) - 1)
    stop = text[start : start + rng.randrange(1, 6)]
    include_stop = rng.random() < 0.5
    stream, deltas = run_with_stop(tok, text, [stop, "not there"], include_stop, rng.choice([1, 1, 3]))
    at = text.index(stop)
    assert stream.stopped
    assert "".join(deltas) == stream.text == text[: at + len(stop) if include_stop else at]
    emitted = 0
    for delta in deltas:
        emitted += len(delta)
        assert emitted <= at or include_stop
        assert "\ufffd" not in delta


def test_stop_can_be_multibyte(tok: Tokenizer) -> None:
    text = "中文分词测试，日本語のテキスト"
    _, deltas = run_with_stop(tok, text, ["日本"])
    assert "".join(deltas) == "中文分词测试，"
    assert not any("\ufffd" in delta for delta in deltas)


def test_empty_stop_string_is_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        TextStream(tok, [], stop=["ok", ""])
