"""The simplest `SequenceState`: plain contiguous tensors per sequence, grown as tokens arrive (for tests)."""

from __future__ import annotations

import torch

from app.models.batch import SequenceSpan


class ContiguousState:
    """Per-sequence state in plain contiguous tensors, grown as tokens arrive.

    The reference the paged pool is compared with: no blocks, no slots, nothing shared.
    """

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._linear: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, span.seq)
        if key in self._kv:
            old_k, old_v = self._kv[key]
            k = torch.cat((old_k[: span.past], k))
            v = torch.cat((old_v[: span.past], v))
        elif span.past:
            raise ValueError(f"sequence {span.seq} has no state for its {span.past} past tokens")
        self._kv[key] = (k, v)
        return k, v

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._linear.get((layer, seq), (None, None))

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self._linear[(layer, seq)] = (conv, recurrent)

    def drop(self, seq: int) -> None:
        """Forget everything held for a sequence."""
        for table in (self._kv, self._linear):
            for key in [key for key in table if key[1] == seq]:
                del table[key]
