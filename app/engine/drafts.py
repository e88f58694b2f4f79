"""Draft tokens for speculative decoding: guesses of a request's next tokens that one window verifies.

A drafting request's decode row becomes 1 + K rows: its newest token and K guessed ones. The window samples
every row as it would sample that position (docs/BATCHING.md, "Drafts"), and the guesses are accepted while
each equals the token drawn before it: the tokens handed out are exactly the tokens drawn, so greedy and
seeded outputs are those of decoding one token a window, and any other request's tokens are drawn from the
model's distribution as before (a fixed guess accepted with the probability the model gives it, and on a
miss the token drawn from the rest of the distribution: rejection sampling of a one-token proposal).

`NgramDrafter` (`--spec ngram`) guesses from the conversation itself: the tokens that followed the last
time its newest few tokens occurred (prompt lookup). It is pure Python, in the scheduler's process.
`MtpGuesses` (`--spec mtp`) holds what the model's MTP head guessed after the request's last window read
(app/engine/mtp_drafts.py runs the head on the device); the scheduler only takes them. A captured pass of the
head leaves its guesses on the device: the request then holds `guess_placeholder`s, which the next window
feeds from there (app/engine/runner.py) while the host plans it, and whose values its verification reads.
"""

from __future__ import annotations

from typing import Protocol

NGRAM_MAX, NGRAM_MIN = 4, 1  # the longest and shortest suffixes looked up
# Guess placeholders lie at and below this; a window's placeholders (scheduler.placeholder) lie above it.
GUESS_PLACEHOLDER = -(1 << 40)


def guess_placeholder(index: int) -> int:
    """The stand-in for guess `index` (row-major over spans and guesses) of the head's latest pass whose
    guesses stayed on the device."""
    return GUESS_PLACEHOLDER - index


def guess_index(token: int) -> int | None:
    """The index of the guess that `token` stands for, or None where it is a token (or a window's
    placeholder)."""
    return GUESS_PLACEHOLDER - token if token <= GUESS_PLACEHOLDER else None


class GuessSource(Protocol):
    """Where guess placeholders' values are: a pass of the head whose guesses stayed on the device."""

    stale: bool  # a later pass has replaced it: its placeholders stand for nothing any more

    def value(self, index: int) -> int:
        """Guess `index`'s value (waits for its copy to the host)."""
        ...


class DraftSource(Protocol):
    """Where a request's draft tokens come from."""

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens guessed to follow `tokens` (the request's prompt and output, all known)."""
        ...


class MtpGuesses:
    """The MTP head's guesses for one request: those it made after the request's newest token, if any."""

    def __init__(self) -> None:
        self._after = -1  # the request's length when the guesses were made
        self._guesses: list[int] = []
        self._source: GuessSource | None = None

    def offer(self, length: int, guesses: list[int], source: GuessSource | None = None) -> None:
        """Guesses of the tokens after the first `length` tokens of the request (placeholders of `source`'s
        guesses, where it is given)."""
        self._after, self._guesses, self._source = length, guesses, source

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The first `k` guesses, if they follow `tokens` as they are now and still stand for guesses;
        else none."""
        if len(tokens) != self._after or (self._source is not None and self._source.stale):
            return []
        return self._guesses[:k]


class NgramDrafter:
    """Prompt-lookup drafts for one request: an index from each n-gram (NGRAM_MIN..NGRAM_MAX tokens) to
    where the tokens after its latest occurrence start, extended as the request's tokens grow."""

    def __init__(self) -> None:
        self._follows: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # tokens whose n-grams ending just before them are indexed

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens guessed to follow `tokens` (the request's prompt and output, all known): those
        after the latest earlier occurrence of its longest suffix that occurred before; none if none did."""
        self._index(tokens)
        end = len(tokens)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            start = self._follows.get(tuple(tokens[end - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a follower since the last call (those ending before each new
        token); a later occurrence replaces an earlier one."""
        for position in range(max(self._indexed, 1), len(tokens)):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, position) + 1):
                self._follows[tuple(tokens[position - n : position])] = position
        self._indexed = max(self._indexed, len(tokens))


def accepted(drafts: list[int], drawn: list[int]) -> int:
    """How many of `drafts` a window accepts, given the tokens `drawn` at its 1 + len(drafts) rows (row j
    after the request's newest token and the first j drafts): draft j stands while it equals the token drawn
    at row j. The request then gains drawn[: accepted + 1]."""
    if len(drawn) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts are verified by {len(drafts) + 1} rows, got {len(drawn)}")
    count = 0
    while count < len(drafts) and drawn[count] == drafts[count]:
        count += 1
    return count
