"""A flat forward batch: tokens of several sequences back to back, and the state they read and write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's rows in a flat batch: `length` tokens from row `start`, owning state `seq`.

    `past` is how many tokens of this sequence the state already holds; the rows continue it.
    """

    seq: int
    start: int
    length: int
    past: int

    @property
    def rows(self) -> slice:
        """The slice of the flat batch holding this sequence's tokens."""
        return slice(self.start, self.start + self.length)


class SequenceState(Protocol):
    """Per-sequence model state that the layers read and extend: attention K/V and Gated DeltaNet state.

    The engine's paged pool implements it (app/engine/paged_state.py); tests use a contiguous holder.
    """

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [length, kv_heads, head_dim] after the span's past; return all [past+length, ...]."""
        ...

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The conv state [channels, kernel-1] and recurrent state [v_heads, k_dim, v_dim], or None."""
        ...

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store the sequence's new conv and recurrent state."""
        ...


@dataclass
class ForwardBatch:
    """Inputs of one forward pass: token ids and positions [tokens], the spans, and the state to use."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    spans: list[SequenceSpan]
    state: SequenceState

    @classmethod
    def build(
        cls,
        chunks: list[tuple[int, list[int], int]],
        state: SequenceState,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Lay out (seq, token ids, past length) chunks back to back; positions continue each past."""
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        for seq, tokens, past in chunks:
            spans.append(SequenceSpan(seq=seq, start=len(ids), length=len(tokens), past=past))
            ids.extend(tokens)
            positions.extend(range(past, past + len(tokens)))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            spans=spans,
            state=state,
        )

    def last_rows(self) -> torch.Tensor:
        """Index of each span's last row: where its next-token logits come from."""
        return torch.tensor([s.start + s.length - 1 for s in self.spans], device=self.input_ids.device)
