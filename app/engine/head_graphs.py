"""CUDA graphs of the MTP head's pass over a window's verified rows (`--spec mtp`).

After a window that verified drafts, each drafting request has 1 to K + 1 rows for the head to read (its
newest token and the guesses accepted) and wants K guesses: one pass of the head over those rows, then K - 1
chained steps of one row each (app/engine/mtp_drafts.py). Run eagerly, that is three forwards of the head's
layer and their layouts built on the host each window, several times what the window itself costs on a small
model. Here the whole pass is captured per span count (the decode bucket sizes up to the slot count): the
read as a varlen batch of at most K + 1 rows a span (the rows left over form one padding sequence on the
scratch block), the chained steps as decode rows, every step's positions, slot mappings and lengths static
inputs filled on the host in one go and copied over in two copies; each step's argmax feeds the next on the
device, and the K guesses of every span come back in one copy.

A chained step past what a span asks for (its guesses, capped where its blocks end) writes its keys and
values to the scratch block and its guesses are dropped. A span of more rows (a prompt's) has all its rows but
the last read by an eager pass first (app/engine/mtp_drafts.py), the last one here.

With `on_device` the guesses stay where the pass left them (`DeviceGuesses`): the next window feeds them from
there, so the host plans and queues it while the device runs the head, and their copy to the host comes
behind them, read when that window's tokens are.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from app.engine.cuda_graphs import buckets_up_to, capture_each
from app.engine.drafts import guess_placeholder
from app.engine.mtp_drafts import MtpSpan
from app.engine.paged_state import PagedState
from app.engine.transfer import device_tensor
from app.models.batch import ForwardBatch, PagedLayout, SequenceSpan
from app.models.qwen3 import CausalLM

log = logging.getLogger("strata.engine")


class _Segments:
    """Named segments of one host buffer (pinned on a GPU) and of its device copy, filled through numpy views
    and sent over in one copy."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        total = sum(sizes.values())
        self.host = torch.zeros(total, dtype=dtype)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.device = torch.zeros(total, dtype=dtype, device=device)
        bounds = np.cumsum([0, *sizes.values()])
        array = self.host.numpy()
        self.np = {name: array[a:b] for name, a, b in zip(sizes, bounds[:-1], bounds[1:], strict=True)}
        self.on = {name: self.device[a:b] for name, a, b in zip(sizes, bounds[:-1], bounds[1:], strict=True)}

    def send(self) -> None:
        self.device.copy_(self.host, non_blocking=True)


class DeviceGuesses:
    """The guesses of one captured pass of the head, [spans, guesses] on the device (`flat`: what guess
    placeholders stand for, row-major) and copied to `host` behind them; `stale` once a later pass replaced
    them (they may since have been overwritten)."""

    def __init__(self, guesses: torch.Tensor, host: torch.Tensor) -> None:
        self.flat = guesses.reshape(-1)
        self._host = host.reshape(-1)[: self.flat.numel()]
        self._host.copy_(self.flat, non_blocking=True)
        self._copied = torch.cuda.Event() if guesses.device.type == "cuda" else None
        if self._copied is not None:
            self._copied.record()
        self._values: list[int] | None = None
        self.stale = False

    def value(self, index: int) -> int:
        """Guess `index`'s value, once its copy to the host is done."""
        if self._values is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._values = self._host.tolist()
        return self._values[index]


class HeadGraphs:
    """The MTP head's pass over up to `slots` spans of at most `guesses` + 1 rows, each giving `guesses`
    guesses, captured per span count; `max_blocks` block-table columns a request can need."""

    def __init__(self, model: CausalLM, state: PagedState, slots: int, guesses: int, max_blocks: int) -> None:
        assert model.mtp is not None, "the model has no MTP head"
        self.model, self.state = model, state
        self.guesses = guesses
        self.rows_per = guesses + 1
        self.buckets = buckets_up_to(slots)
        top = self.buckets[-1]
        tokens, seqs = top * self.rows_per, top + 1
        self.width = max(max_blocks, -(-tokens // state.block_size))  # the padding sequence's blocks too
        device = state.device
        self.device = device
        longs = dict.fromkeys(("next_ids", "positions", "mapping", "live", "row_slots"), tokens)
        longs |= {"state_slots": seqs, "last_rows": top}
        ints = {"query_start": seqs + 1, "seq_lens": seqs, "table": seqs * self.width}
        for j in range(1, guesses):
            longs |= {f"positions{j}": top, f"mapping{j}": top, f"live{j}": top, f"row_slots{j}": top}
            ints |= {f"seq_lens{j}": top}
        ints |= {"steps_start": top + 1}
        self._long = _Segments(longs, torch.int64, device)
        self._int = _Segments(ints, torch.int32, device)
        self._int.np["steps_start"][:] = np.arange(top + 1)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        dtype = model.model.embed_tokens.weight.dtype
        self.hidden = torch.zeros(tokens, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}
        self._out_host = torch.zeros(top * guesses, dtype=torch.int64)
        if device.type == "cuda":
            self._out_host = self._out_host.pin_memory()
        self.latest: DeviceGuesses | None = None  # the last pass's guesses left on the device

    def bucket(self, spans: list[MtpSpan]) -> int | None:
        """The span count of the smallest capture that holds the spans, or None when they need the eager pass
        (a span of more rows than a verified window gives it, or more guesses than captured)."""
        if not spans or any(not 0 < len(s.rows) <= self.rows_per or s.guesses > self.guesses for s in spans):
            return None
        return next((b for b in self.buckets if b >= len(spans)), None)

    def _fill(self, spans: list[MtpSpan], bucket: int) -> None:
        """Write the spans' read and chained steps into the static inputs of the `bucket`-span capture."""
        if self._copied is not None:
            self._copied.synchronize()
        size, scratch = self.state.block_size, self.state.scratch_block
        long, ints = self._long.np, self._int.np
        n, tokens, seqs = len(spans), bucket * self.rows_per, bucket + 1
        lengths = np.zeros(seqs, np.int64)
        pasts = np.zeros(seqs, np.int64)
        lengths[:n] = [len(s.rows) for s in spans]
        pasts[:n] = [s.past for s in spans]
        real = int(lengths[:n].sum())
        lengths[n] = tokens - real  # one padding sequence on the scratch block
        starts = np.zeros(seqs + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        ints["query_start"][: seqs + 1] = starts
        ints["seq_lens"][:seqs] = pasts + lengths
        table = ints["table"][: seqs * self.width].reshape(seqs, self.width)
        table[:] = scratch
        for i, span in enumerate(spans):
            blocks = span.blocks[: self.width]
            table[i, : len(blocks)] = blocks
        seq = np.repeat(np.arange(seqs), lengths)
        positions = pasts[seq] + np.arange(tokens) - starts[seq]
        long["positions"][:tokens] = positions
        long["mapping"][:tokens] = table[seq, positions // size] * size + positions % size
        long["next_ids"][:tokens] = 0
        if real:
            long["next_ids"][:real] = [t for s in spans for t in s.next_ids]
        long["live"][:tokens] = np.arange(tokens) < real
        slots = np.full(seqs, self.state.scratch_slot, np.int64)
        slots[:n] = [s.slot for s in spans]
        long["state_slots"][:seqs] = slots
        long["row_slots"][:tokens] = slots[seq]
        long["last_rows"][:bucket] = 0
        long["last_rows"][:n] = starts[1 : n + 1] - 1
        last = pasts[:bucket] + lengths[:bucket] - 1  # each span's last position
        asks = np.zeros(bucket, np.int64)
        asks[:n] = [s.guesses for s in spans]
        held = np.zeros(bucket, np.int64)
        held[:n] = [len(s.blocks) * size for s in spans]
        for j in range(1, self.guesses):
            position = np.where(np.arange(bucket) < n, last + j, 0)
            writes = (j < asks) & (position < held)  # else to the scratch block, and its guess dropped
            column = np.minimum(position // size, self.width - 1)
            home = table[np.arange(bucket), column] * size + position % size
            long[f"positions{j}"][:bucket] = position
            long[f"mapping{j}"][:bucket] = np.where(writes, home, scratch * size)
            long[f"live{j}"][:bucket] = writes
            long[f"row_slots{j}"][:bucket] = slots[:bucket]
            ints[f"seq_lens{j}"][:bucket] = position + 1
        self._long.send()
        self._int.send()
        if self._copied is not None:
            self._copied.record()

    def _layouts(self, bucket: int) -> tuple[ForwardBatch, list[ForwardBatch]]:
        """The read's batch and each chained step's, over the static inputs of the `bucket`-span capture."""
        long, ints = self._long.on, self._int.on
        tokens, seqs = bucket * self.rows_per, bucket + 1
        table = ints["table"][: seqs * self.width].view(seqs, self.width)
        read = PagedLayout(
            query_start=ints["query_start"][: seqs + 1],
            seq_lens=ints["seq_lens"][:seqs],
            block_table=table,
            slot_mapping=long["mapping"][:tokens],
            state_slots=long["state_slots"][:seqs],
            max_query_len=self.rows_per,
            live_rows=long["live"][:tokens],
            row_slots=long["row_slots"][:tokens],
        )
        spans = [SequenceSpan(seq=self.state.scratch_slot, start=0, length=0, past=0)] * seqs
        first = ForwardBatch(long["next_ids"][:tokens], long["positions"][:tokens], spans, self.state, read)
        steps = []
        for j in range(1, self.guesses):
            layout = PagedLayout(
                query_start=ints["steps_start"][: bucket + 1],
                seq_lens=ints[f"seq_lens{j}"][:bucket],
                block_table=table[:bucket],
                slot_mapping=long[f"mapping{j}"][:bucket],
                state_slots=long["state_slots"][:bucket],
                max_query_len=1,
                live_rows=long[f"live{j}"][:bucket],
                row_slots=long[f"row_slots{j}"][:bucket],
            )
            positions = long[f"positions{j}"][:bucket]
            steps.append(ForwardBatch(positions, positions, spans[:bucket], self.state, layout))
        return first, steps

    def forward(self, bucket: int) -> torch.Tensor:
        """The captured pass: the guesses [bucket, guesses] of each span, greedy on the head's logits."""
        first, steps = self._layouts(bucket)
        model = self.model
        out = model.mtp_forward(self.hidden[: bucket * self.rows_per], first.input_ids, first)
        hidden = out[self._long.on["last_rows"][:bucket]]
        tokens = model.logits(hidden).argmax(-1)
        guesses = [tokens]
        for j, step in enumerate(steps, start=1):
            hidden = model.mtp_forward(hidden, tokens, step, j)
            tokens = model.logits(hidden).argmax(-1)
            guesses.append(tokens)
        return torch.stack(guesses, dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every span count, largest first (smaller ones reuse its memory)."""
        self.graphs, self.out = capture_each(self.buckets[::-1], lambda b: self._fill([], b), self.forward)
        log.info("captured the MTP head's pass: %s spans, %d guesses", self.buckets, self.guesses)

    @torch.inference_mode()
    def run(
        self, hidden: torch.Tensor, spans: list[MtpSpan], bucket: int, on_device: bool = False
    ) -> list[list[int]]:
        """The guesses of each span (as many as it asks for) after reading its rows of `hidden` (the final
        hidden states a window kept); with `on_device`, their placeholders, the guesses left on the device
        as `latest`. Without a captured graph (CPU tests) the same pass runs eagerly over the same static
        inputs."""
        if self.latest is not None:
            self.latest.stale = True  # the replay below may overwrite its guesses
            self.latest = None
        self._fill(spans, bucket)
        rows = device_tensor([r for s in spans for r in s.rows], torch.long, self.device)
        self.hidden[: len(rows)] = hidden[rows]
        graph = self.graphs.get(bucket)
        if graph is None:
            guesses = self.forward(bucket)
        else:
            graph.replay()
            guesses = self.out[bucket]
        guesses = guesses[: len(spans)]
        if on_device:
            self.latest = DeviceGuesses(guesses, self._out_host)
            width = self.guesses
            return [[guess_placeholder(i * width + j) for j in range(s.guesses)] for i, s in enumerate(spans)]
        table = guesses.tolist()
        return [row[: s.guesses] for row, s in zip(table, spans, strict=True)]
