"""CUDA graphs of decode windows: the forward pass and LM head captured once per batch bucket.

A decode window (every row one new token of a running request) is padded to the next bucket size and replayed
from static input buffers; padding rows write into the pool's scratch block and slot, which no request owns,
and are not counted as routed tokens. Prompt windows run eagerly. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from app.engine.paged_state import PagedState
from app.models.batch import ForwardBatch, PagedLayout, SequenceSpan
from app.models.qwen3 import CausalLM

log = logging.getLogger("strata.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: the token to read, its position, the request's slot and its block table."""

    token: int
    position: int
    slot: int
    blocks: list[int]


def buckets_up_to(rows: int) -> list[int]:
    """The bucket sizes used for at most `rows` rows: the standard ones below it, then `rows` itself."""
    return [b for b in BUCKETS if b < rows] + [rows]


class DecodeGraphs:
    """One captured graph per bucket, sharing static inputs and one memory pool."""

    def __init__(self, model: CausalLM, state: PagedState, max_rows: int, max_blocks: int) -> None:
        self.model = model
        self.state = state
        self.buckets = buckets_up_to(max_rows)
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        device = state.device
        rows = max_rows
        # Static inputs: int64 ones in one tensor, int32 ones in another, each filled by one copy per window.
        self._long = torch.zeros(5 * rows, dtype=torch.int64, device=device)
        self._int = torch.zeros(rows + rows * max_blocks, dtype=torch.int32, device=device)
        self._long_host = torch.zeros(5 * rows, dtype=torch.int64).pin_memory()
        self._int_host = torch.zeros(rows + rows * max_blocks, dtype=torch.int32).pin_memory()
        parts = self._long.split(rows)
        self.input_ids, self.positions, self.slot_mapping = parts[0], parts[1], parts[2]
        self.state_slots, self.live = parts[3], parts[4]
        self.seq_lens = self._int[:rows]
        self.block_table = self._int[rows:].view(rows, max_blocks)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._fill([])

    def _fill(self, rows: list[DecodeRow]) -> None:
        """Write `rows` into the static inputs, padding the rest onto the scratch block and slot."""
        size = self.state.block_size
        scratch = self.state.scratch_block
        long_host = self._long_host.view(5, self.max_rows)
        long_host[0].zero_()
        long_host[1].zero_()
        long_host[2].fill_(scratch * size)
        long_host[3].fill_(self.state.scratch_slot)
        long_host[4].zero_()
        seq_lens = self._int_host[: self.max_rows]
        seq_lens.fill_(1)
        table = self._int_host[self.max_rows :].view(self.max_rows, self.max_blocks)
        table[:, 0] = scratch
        for i, row in enumerate(rows):
            used = row.position // size + 1
            long_host[0, i] = row.token
            long_host[1, i] = row.position
            long_host[2, i] = row.blocks[row.position // size] * size + row.position % size
            long_host[3, i] = row.slot
            long_host[4, i] = 1
            seq_lens[i] = row.position + 1
            table[i, :used] = torch.tensor(row.blocks[:used], dtype=torch.int32)
        self._long.copy_(self._long_host, non_blocking=True)
        self.seq_lens.copy_(seq_lens, non_blocking=True)
        # Rows read only the columns their length covers: copy no more than the widest row needs.
        width = max((r.position // size + 1 for r in rows), default=1)
        self.block_table[:, :width].copy_(table[:, :width], non_blocking=True)

    def _batch(self, rows: int) -> ForwardBatch:
        """A forward batch over the first `rows` static rows."""
        layout = PagedLayout(
            query_start=self.query_start[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_table=self.block_table[:rows],
            slot_mapping=self.slot_mapping[:rows],
            state_slots=self.state_slots[:rows],
            max_query_len=1,
            live_rows=self.live[:rows],
        )
        spans = [SequenceSpan(seq=self.state.scratch_slot, start=i, length=1, past=0) for i in range(rows)]
        return ForwardBatch(self.input_ids[:rows], self.positions[:rows], spans, self.state, layout)

    def _forward(self, rows: int) -> torch.Tensor:
        return self.model.logits(self.model(self._batch(rows)))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (so smaller ones reuse its memory)."""
        pool = None
        for rows in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[rows] = self._forward(rows)
            pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs for %s rows", ", ".join(map(str, self.buckets)))

    def fits(self, rows: int) -> bool:
        """Whether a decode window of `rows` rows can be replayed."""
        return 0 < rows <= self.max_rows

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Replay the smallest bucket holding `rows`; returns their logits [rows, vocab] (fp32)."""
        bucket = next(b for b in self.buckets if b >= len(rows))
        self._fill(rows)
        self.graphs[bucket].replay()
        return self.logits[bucket][: len(rows)]
