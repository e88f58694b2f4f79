"""CUDA graphs of decode windows: the forward pass and LM head captured once per batch bucket.

A decode window (every row one new token of a running request) is padded to the next bucket size and replayed
from static input buffers; padding rows write into the pool's scratch block and slot, which no request owns,
and are not counted as routed tokens. Prompt windows run eagerly. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
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
        self._long_host = torch.zeros(5 * rows, dtype=torch.int64)
        self._int_host = torch.zeros(rows + rows * max_blocks, dtype=torch.int32)
        if device.type == "cuda":  # pinned, so the copies to the device are asynchronous
            self._long_host, self._int_host = self._long_host.pin_memory(), self._int_host.pin_memory()
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
        """Write `rows` into the static inputs, padding the rest onto the scratch block and slot.

        Filled through numpy views of the pinned host buffers (no per-row torch calls), then copied over.
        """
        n, size = len(rows), self.state.block_size
        scratch = self.state.scratch_block
        long_host = self._long_host.numpy().reshape(5, self.max_rows)
        int_host = self._int_host.numpy()
        seq_lens = int_host[: self.max_rows]
        table = int_host[self.max_rows :].reshape(self.max_rows, self.max_blocks)
        long_host[:, n:] = np.array([0, 0, scratch * size, self.state.scratch_slot, 0])[:, None]
        seq_lens[n:] = 1
        table[n:, 0] = scratch
        if n:
            positions = np.fromiter((r.position for r in rows), np.int64, n)
            current = np.fromiter((r.blocks[r.position // size] for r in rows), np.int64, n)
            long_host[0, :n] = np.fromiter((r.token for r in rows), np.int64, n)
            long_host[1, :n] = positions
            long_host[2, :n] = current * size + positions % size
            long_host[3, :n] = np.fromiter((r.slot for r in rows), np.int64, n)
            long_host[4, :n] = 1
            seq_lens[:n] = positions + 1
            for i, row in enumerate(rows):
                used = row.position // size + 1
                table[i, :used] = row.blocks[:used]
        self._long.copy_(self._long_host, non_blocking=True)
        self.seq_lens.copy_(self._int_host[: self.max_rows], non_blocking=True)
        # Rows read only the columns their length covers: copy no more than the widest row needs.
        width = max((r.position // size + 1 for r in rows), default=1)
        host_table = self._int_host[self.max_rows :].view(self.max_rows, self.max_blocks)
        self.block_table[:, :width].copy_(host_table[:, :width], non_blocking=True)

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
