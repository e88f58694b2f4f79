"""A flat forward batch: tokens of several sequences back to back, and the state they read and write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's rows in a flat batch: `length` tokens from row `start`, owning state `seq`.

    `past` is how many tokens of this sequence the state already holds; the rows continue it. When `save_slot`
    is set, the recurrent layers also leave their state after position `save_at` (inside the span, a multiple
    of the delta rule's chunk, at least one chunk after `past`) in that state slot: a checkpoint.

    A `stepwise` span's rows are tokens the sequence generated (draft tokens being verified): the recurrent
    layers read them one at a time, each as a decode row, and leave the state after row j in `row_saves[j]`
    (fewer entries than rows: the later rows keep nothing; -1: that row keeps nothing). It has no checkpoint
    (`save_slot`): its row saves are its checkpoints.
    """

    seq: int
    start: int
    length: int
    past: int
    save_at: int = 0
    save_slot: int | None = None
    stepwise: bool = False
    row_saves: tuple[int, ...] = ()

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


@dataclass(frozen=True)
class PagedLayout:
    """The flat batch described in device tensors, for kernels that read paged state in one launch.

    query_start [seqs + 1] int32: row offsets of the sequences (the last entry is the number of rows);
    seq_lens [seqs] int32: keys per sequence once this batch's rows are written (past + length);
    block_table [seqs, max_blocks] int32: the KV blocks of each sequence, in position order;
    slot_mapping [tokens] int64: where each row's key and value go in the cache seen as [blocks * block_size];
    state_slots [seqs] int64: each sequence's Gated DeltaNet state slot;
    max_query_len: the longest span (host int, sizes kernel grids);
    live_rows [tokens] int64 or None: 1 for real rows, 0 for padding rows (a CUDA graph's bucket), so that
    padding is not counted as routed tokens;
    row_slots [tokens] int64 or None: each row's state slot (its sequence's), for counts kept per slot;
    save_at [seqs] int32 and save_slots [seqs] int64, or None when no span saves: each span's `save_at` (0:
    none) and `save_slot`;
    stepwise [seqs] int32 and row_saves [tokens] int64, or None (both) when no span is stepwise: 1 for the
    spans whose rows the recurrent layers read one at a time, as decode rows (`SequenceSpan.stepwise`), and
    for each row of those the state slot that keeps the recurrent state after it (-1: none);
    streamed: where the batch reads KV blocks kept in host RAM (`--kv-resident`), the state's plan for
    streaming them in (app/engine/kv_stream.py), which `PagedStatePools.kv_view` follows; None: none.
    """

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    max_query_len: int
    live_rows: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    save_at: torch.Tensor | None = None
    save_slots: torch.Tensor | None = None
    stepwise: torch.Tensor | None = None
    row_saves: torch.Tensor | None = None
    streamed: object | None = None


class PagedStatePools(SequenceState, Protocol):
    """A `SequenceState` whose storage whole-batch kernels address directly through a `PagedLayout`."""

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value caches [blocks, block_size, kv_heads, head_dim]."""
        ...

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] in the layer's caches at a `kv_view` layout's slots."""
        ...

    def kv_view(self, layer: int, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor, PagedLayout]:
        """The layer's key and value caches for a batch of `layout`, and the layout as they are addressed
        (blocks streamed in from host RAM named where they were staged); layers ask in order."""
        ...

    def linear_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's conv state [slots, channels, kernel-1] and recurrent state [slots, heads, dk, dv]."""
        ...


@dataclass
class ForwardBatch:
    """Inputs of one forward pass: token ids and positions [tokens], the spans, and the state to use.

    `layout` is set when the state is paged and the backends read it in whole-batch kernels. `steps` (see
    `in_steps`), when set, is how the recurrent layers take the batch: in order, each the rows of its index;
    after step j they copy the state of each (seq, state slot) of `step_saves[j]` into that slot.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    spans: list[SequenceSpan]
    state: SequenceState
    layout: PagedLayout | None = None
    steps: list[tuple[torch.Tensor, ForwardBatch]] | None = None
    step_saves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        chunks: list[tuple[int, list[int], int]],
        state: SequenceState,
        device: torch.device | str = "cpu",
        saves: dict[int, tuple[int, int]] | None = None,
        stepwise: dict[int, tuple[int, ...]] | None = None,
    ) -> ForwardBatch:
        """Lay out (seq, token ids, past length) chunks back to back; positions continue each past.

        `saves` maps a seq to (position, state slot) of the checkpoint its span leaves, `stepwise` the seqs of
        stepwise spans to their row saves (`SequenceSpan`).
        """
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        saves, stepwise = saves or {}, stepwise or {}
        for seq, tokens, past in chunks:
            save_at, save_slot = saves.get(seq, (0, None))
            spans.append(
                SequenceSpan(
                    seq=seq,
                    start=len(ids),
                    length=len(tokens),
                    past=past,
                    save_at=save_at,
                    save_slot=save_slot,
                    stepwise=seq in stepwise and len(tokens) > 1,
                    row_saves=stepwise.get(seq, ()),
                )
            )
            ids.extend(tokens)
            positions.extend(range(past, past + len(tokens)))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            spans=spans,
            state=state,
        )

    def in_steps(self, layout: Callable[[list[SequenceSpan]], PagedLayout] | None = None) -> None:
        """Let the recurrent layers take the stepwise spans one row at a time, for backends whose kernels
        do not read them in one launch: step 0 holds every other span whole and their first rows, step j
        their row j, each a batch of its own (with `layout`'s layout of its spans). Each step's rows are then
        computed as in a window of single decode rows. A stepwise span's row saves are left after the step
        that reads that row (`step_saves`)."""
        longest = max((s.length for s in self.spans if s.stepwise), default=0)
        if longest <= 1:
            return
        steps = []
        for j in range(longest):
            rows: list[int] = []
            spans = []
            for span in self.spans:
                if span.stepwise and j < span.length:
                    taken, past = [span.start + j], span.past + j
                    if j < len(span.row_saves) and span.row_saves[j] >= 0:
                        self.step_saves.setdefault(j, []).append((span.seq, span.row_saves[j]))
                    span = replace(span, stepwise=False, row_saves=())
                elif not span.stepwise and j == 0:
                    taken, past = list(range(span.start, span.start + span.length)), span.past
                else:
                    continue
                spans.append(replace(span, start=len(rows), length=len(taken), past=past))
                rows += taken
            index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
            step = ForwardBatch(self.input_ids[index], self.positions[index], spans, self.state)
            if layout is not None:
                step.layout = layout(spans)
            steps.append((index, step))
        self.steps = steps

    def last_rows(self) -> torch.Tensor:
        """Index of each span's last row: where its next-token logits come from."""
        return torch.tensor([s.start + s.length - 1 for s in self.spans], device=self.input_ids.device)
