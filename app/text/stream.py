"""Incremental detokenization of one generated sequence, with stop strings whose text never leaks out.

Byte-level BPE tokens can end in the middle of a UTF-8 character, so the text of a sequence is not the text of
its tokens joined. `TextStream` decodes a short window of recent tokens, compares it with the decode of the
window's leading context tokens, and passes on only text that later tokens can no longer change: everything
before a trailing run of U+FFFD (an incomplete character renders as one). Stop strings are looked for in that
text; a tail that could still grow into a stop string is held back until it either does or cannot.
"""

from collections.abc import Sequence

from app.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first generated ones, so those render as they would in the full text.
_CONTEXT_TOKENS = 5
# Undecided tokens (their text still ends in U+FFFD) that are waited for before looking for where to cut.
_MAX_PENDING_TOKENS = 8


class _WindowDecoder:
    """Token ids to final text chunks, decoding only a bounded window of recent tokens.

    The window holds context tokens (`_ids[:_read]`, whose text `_context_text` is already passed on) and
    pending tokens after them. Of the pending tokens' text, the first `_passed` characters are passed on too.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool) -> None:
        """Start after `context_ids`, the last tokens before the sequence (e.g. the prompt's)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped: dict[int, bool] = {}
        self._ids = self._kept(context_ids)
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        self._passed = 0

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` as the tokenizer renders it."""
        return self._tokenizer.decode(ids, self._skip_special_tokens)

    def _kept(self, ids: Sequence[int]) -> list[int]:
        """`ids` less the special tokens that decoding skips: they cannot change the text, only widen it."""
        if not self._skip_special_tokens:
            return list(ids)
        for i in ids:
            if i not in self._skipped:
                self._skipped[i] = not self._decode([i]) and bool(self._tokenizer.decode([i], False))
        return [i for i in ids if not self._skipped[i]]

    def add(self, token_ids: Sequence[int]) -> str:
        """Take in the next tokens; return the text they make final."""
        self._ids.extend(self._kept(token_ids))
        text = self._decode(self._ids)
        new = text[len(self._context_text) :]
        ready = new.rstrip(_REPLACEMENT)
        chunk = ready[self._passed :]
        self._passed = max(self._passed, len(ready))
        if new and ready == new:
            self._advance(len(self._ids), len(new))
        elif len(self._ids) - self._read > _MAX_PENDING_TOKENS:
            chunk += self._cut(text)
        return chunk

    def flush(self) -> str:
        """The rest of the text as the tokenizer renders it, trailing U+FFFD included."""
        return self._decode(self._ids)[len(self._context_text) :][self._passed :]

    def _advance(self, end: int, end_offset: int) -> None:
        """Make `_ids[_read:end]` the context, its text being the first `end_offset` pending characters."""
        del self._ids[: self._read]
        self._read = end - self._read
        self._context_text = self._decode(self._ids[: self._read])
        self._passed -= end_offset

    def _cut(self, text: str) -> str:
        """Pass on a long undecided tail up to the last token boundary where the text is final.

        A boundary is final when the window's text `text` is the text before it joined with the text after
        it: no character spans it, so later tokens cannot change what lies before it. U+FFFD runs this long
        are genuine (invalid bytes), not an incomplete character.
        """
        for end in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[:end])
            tail = self._decode(self._ids[end:])
            if tail and head + tail == text:
                head_new = head[len(self._context_text) :]
                chunk = head_new[self._passed :]
                self._passed = max(self._passed, len(head_new))
                self._advance(end, len(head_new))
                return chunk
        return ""


class TextStream:
    """Turns generated token ids into text deltas as they arrive.

    Text is held back while it ends in an incomplete character, or while its end could be the start of a stop
    string. When the text contains a stop string, the stream stops: the text from that stop string's start
    on is dropped (with `include_stop`, it is kept up to the stop string's end). Should several occur, the
    one that ends first wins, and of those ending at the same place the one that starts first, so the result
    does not depend on how the tokens were batched. Without a stop, the deltas of `add` and `finish` join to
    the tokenizer's decode of all generated ids, decoded after the prompt.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        """Stream the text generated after `prompt_token_ids`, stopping at any of `stop` (none empty)."""
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(stop)
        self._longest_stop = max(map(len, self._stop), default=0)
        self._include_stop = include_stop
        self._decoder = _WindowDecoder(tokenizer, prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens)
        self._held = ""
        self._deltas: list[str] = []
        self._stopped = False
        self._finished = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Take in newly generated tokens; return the text that may be shown now ("" once stopped or done)."""
        if self._stopped or self._finished:
            return ""
        return self._release(self._decoder.add(token_ids), final=False)

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found."""
        return self._stopped

    def finish(self) -> str:
        """End the sequence; return the text still held back ("" when stopped or already finished)."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        return self._release(self._decoder.flush(), final=True)

    @property
    def text(self) -> str:
        """All text emitted so far: the deltas joined."""
        return "".join(self._deltas)

    def _release(self, chunk: str, final: bool) -> str:
        """Append final text `chunk` to the held-back text; return what of it may be shown."""
        text = self._held + chunk
        match = self._find_stop(text)
        if match is not None:
            self._stopped = True
            start, end = match
            delta, self._held = text[: end if self._include_stop else start], ""
        else:
            keep = 0 if final else self._stop_prefix_length(text)
            delta, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if delta:
            self._deltas.append(delta)
        return delta

    def _find_stop(self, text: str) -> tuple[int, int] | None:
        """Start and end of the stop string in `text` that ends first (then starts first), if any."""
        matches = [(at + len(s), at) for s in self._stop if (at := text.find(s)) >= 0]
        if not matches:
            return None
        end, start = min(matches)
        return start, end

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of `text` that a stop string starts with."""
        for size in range(min(len(text), self._longest_stop - 1), 0, -1):
            if any(s.startswith(text[-size:]) for s in self._stop):
                return size
        return 0
