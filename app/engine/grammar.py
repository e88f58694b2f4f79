"""Structured output: a request's grammar as a mask over the vocabulary at each token it samples.

A request may carry a `Grammar` (a JSON schema, any JSON object, a regular expression, a Lark grammar or a
list of choices). The engine keeps one llguidance matcher per such request: before a window samples for it,
the matcher's bitmask of the tokens that keep the output inside the grammar (end-of-sequence only where the
output is complete) is computed on the host, for every constrained row of the window at once and in
parallel (`Grammars.bitmask`); the sampler sets every other token's logit to -inf (`TokenMask`); each token
read back is fed to its matcher (`advance`). Rows without a grammar are left as they are, so free and
constrained requests share windows and the free ones draw what they would draw alone.

JSON is generated compactly with one space after `,` and `:` (as Python's `json.dumps` writes it): with free
whitespace a sampling model can spend its tokens on blanks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from app.engine.grammar_source import check_grammar, not_compiled
from app.engine.protocol import Grammar
from app.engine.transfer import device_tensor

MASK_THREADS = 4  # host threads computing a window's masks
BITS = 32


@dataclass
class TokenMask:
    """Which tokens the constrained rows of a window may take: `rows` (indices into the window's sampled
    rows) and their bitmasks `words` [len(rows), ceil(vocab / 32)] int32, bit j of word i allowing token
    32 * i + j."""

    rows: list[int]
    words: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with the tokens the mask forbids at -inf (a new tensor)."""
        vocab, device = logits.shape[1], logits.device
        words = self.words.to(device, non_blocking=True)
        shifts = torch.arange(BITS, dtype=torch.int32, device=device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
        index = device_tensor(self.rows, torch.long, device)
        out = logits.clone()
        out[index] = out[index].masked_fill(~allowed, float("-inf"))
        return out


class Grammars:
    """The engine's llguidance tokenizer (the model's vocabulary: `vocab` logits, the tokenizer's tokens and
    its end-of-sequence ids) and what each constrained request needs: a matcher, its masks, its tokens."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor(MASK_THREADS)
        self._words = (vocab + BITS - 1) // BITS

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`; InvalidRequest where it cannot be compiled for this vocabulary."""
        matcher = llguidance.LLMatcher(self.tokenizer, check_grammar(grammar), log_level=0)
        if matcher.is_error():
            raise not_compiled(grammar, matcher.get_error())
        return matcher

    def bitmask(self, matchers: Sequence[llguidance.LLMatcher], pin: bool = False) -> torch.Tensor:
        """The next-token bitmasks of `matchers`, [len(matchers), words] int32, computed in parallel (pinned
        host memory with `pin`, for a copy to a GPU)."""
        words = torch.empty((len(matchers), self._words), dtype=torch.int32, pin_memory=pin)
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], words.data_ptr(), self._words * 4, len(matchers)
            )
        return words

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> None:
        """Feed a drawn token to its request's matcher (drawn under its mask, so always accepted)."""
        matcher.consume_token(token)

    @staticmethod
    def complete(matcher: llguidance.LLMatcher) -> bool:
        """Whether the grammar's output is finished (nothing but end-of-sequence may follow)."""
        return matcher.is_stopped()
