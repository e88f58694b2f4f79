"""CUDA graphs of windows: the forward pass and LM head captured per bucket, replayed from static inputs.

Two kinds of bucket share one set of static input buffers and one memory pool:

- decode buckets (every row a decode row): `rows` rows, each its own sequence, padded with single-row
  sequences on the scratch block and slot;
- mixed buckets (prompt chunks, with or without decode rows): `tokens` rows in `seqs` sequences (the slot
  count plus one), the longest at most `longest` rows. The window's chunks come first; the rows left over form
  one padding sequence on the scratch block and slot, and the sequences left over are empty. `longest` only
  sizes the kernels' grids (empty programs exit at once), so a window picks the smallest one that holds it.

Padding rows are not counted as routed tokens (`live` is 0 there). A window larger than every bucket runs
eagerly, and `--enforce-eager` turns graphs off.

Windows that verify draft tokens replay mixed buckets too: a drafting chunk is a stepwise sequence of 1 + K
rows (its recurrent layers read it token by token, leaving the state after each row in its draft slots: the
static `stepwise` and `row_saves`), and the graph scores every row a chunk samples at (`sample_rows`, room for
`draft_rows` more than one a sequence).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from app.engine.paged_state import PagedState
from app.engine.scheduler import Chunk
from app.engine.transfer import device_tensor
from app.models.batch import ForwardBatch, PagedLayout, SequenceSpan
from app.models.expert_tier import TieredExperts
from app.models.gdn import GatedDeltaNet
from app.models.pieces import Pieces
from app.models.qwen3 import CausalLM, ModelPart

log = logging.getLogger("strata.engine")

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
LONGEST_BUCKETS = (128, 512, 2048)
MAX_GRAPH_TOKENS = 4096  # windows with more rows run eagerly: their GPU time dwarfs the host's

Fed = tuple[torch.Tensor, torch.Tensor]  # rows of a window and the device tokens they are fed instead
K = TypeVar("K")


@dataclass(frozen=True)
class Bucket:
    """One captured shape: `tokens` rows in `seqs` sequences, the longest at most `longest` rows."""

    tokens: int
    seqs: int
    longest: int

    @property
    def decode(self) -> bool:
        """A decode bucket: one row per sequence."""
        return self.longest == 1


@dataclass(frozen=True)
class GraphSizes:
    """What window graphs are sized for: `slots` batch slots, `max_blocks` block-table columns a request can
    need, `max_tokens` the most rows of a window, `draft_rows` the most draft tokens a window verifies."""

    slots: int
    max_blocks: int
    max_tokens: int
    draft_rows: int = 0


@dataclass(frozen=True)
class WindowRows:
    """A window's sequences as the static inputs take them, in order: each one's rows, past tokens, state slot
    and block table; the checkpoint saves and stepwise row saves of some (by index); the token ids of every
    row, flat (None on a stage of a layer split, which receives the residual stream instead); and the rows
    each samples at."""

    lengths: np.ndarray
    pasts: np.ndarray
    slots: np.ndarray
    tables: list[Sequence[int]]
    ids: np.ndarray | None
    saves: list[tuple[int, tuple[int, int]]]
    step_saves: list[tuple[int, tuple[int, ...]]]
    sampled: np.ndarray

    @staticmethod
    def of_chunks(chunks: Sequence[Chunk]) -> WindowRows:
        """A window's chunks, in one pass over them (a decode window's host time is mostly this)."""
        lengths, pasts, slots, tables, ids, sampled = [], [], [], [], [], []
        saves, step_saves = [], []
        for i, c in enumerate(chunks):
            lengths.append(len(c.tokens))
            pasts.append(c.past)
            slots.append(c.slot)
            tables.append(c.request.blocks)
            ids += c.tokens
            sampled.append(c.sampled_rows)
            if c.save is not None:
                saves.append((i, c.save))
            if c.stepwise:
                step_saves.append((i, c.step_saves))
        return WindowRows(
            lengths=np.array(lengths, np.int64),
            pasts=np.array(pasts, np.int64),
            slots=np.array(slots, np.int64),
            tables=tables,
            ids=np.array(ids, np.int64),
            saves=saves,
            step_saves=step_saves,
            sampled=np.array(sampled, np.int64),
        )

    @staticmethod
    def of_stage(
        chunks: Sequence[tuple[int, int, int]],
        tables: dict[int, list[int]],
        saves: dict[int, tuple[int, int]],
        stepwise: dict[int, tuple[int, ...]],
    ) -> WindowRows:
        """A window as a later stage of a layer split gets it (`StageWork`): each chunk's (slot, rows, past),
        and by slot the block tables, checkpoint saves and stepwise row saves; no token ids, no sampling."""
        n = len(chunks)
        index = {slot: i for i, (slot, _, _) in enumerate(chunks)}
        return WindowRows(
            lengths=np.fromiter((rows for _, rows, _ in chunks), np.int64, n),
            pasts=np.fromiter((past for _, _, past in chunks), np.int64, n),
            slots=np.fromiter((slot for slot, _, _ in chunks), np.int64, n),
            tables=[tables[slot] for slot, _, _ in chunks],
            ids=None,
            saves=[(index[slot], save) for slot, save in saves.items()],
            step_saves=[(index[slot], rows) for slot, rows in stepwise.items()],
            sampled=np.zeros(n, np.int64),
        )


def warm_up_on_side(run: Callable[[], object]) -> torch.cuda.Stream:
    """Run `run` twice on a side stream, as a capture needs first (its allocations and compiles done outside
    the graph); the stream, which the current one then waits for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    return side


def capture_each(
    keys: Sequence[K], fill: Callable[[K], None], forward: Callable[[K], torch.Tensor]
) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, torch.Tensor]]:
    """`forward(key)` warmed up and captured for each key in order, its static inputs filled by `fill(key)`
    first, all graphs on one memory pool (each later one reusing the earlier's memory: largest first); then
    each launched once, since a graph uploads at its first launch (at start, not in a request's time). The
    graphs and the tensor each forward returned."""
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outs: dict[K, torch.Tensor] = {}
    pool = None
    for key in keys:
        fill(key)
        warm_up_on_side(lambda key=key: forward(key))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outs[key] = forward(key)
        pool = graph.pool()
        graphs[key] = graph
    for key, graph in graphs.items():
        fill(key)
        graph.replay()
    torch.cuda.synchronize()
    return graphs, outs


def buckets_up_to(rows: int) -> list[int]:
    """Decode bucket sizes for at most `rows` rows: the standard ones below it, then `rows` itself."""
    return [b for b in DECODE_BUCKETS if b < rows] + [rows]


def token_buckets(max_tokens: int) -> list[int]:
    """Mixed-window row counts up to `max_tokens` (capped at MAX_GRAPH_TOKENS), ending at that count."""
    top = min(max_tokens, MAX_GRAPH_TOKENS)
    return [b for b in TOKEN_BUCKETS if b < top] + [top]


def mixed_buckets(max_tokens: int, seqs: int) -> list[Bucket]:
    """Every mixed bucket: each token count with each longest-span bound below it, and itself."""
    return [
        Bucket(tokens, seqs, longest)
        for tokens in token_buckets(max_tokens)
        for longest in [q for q in LONGEST_BUCKETS if q < tokens] + [tokens]
    ]


class WindowGraphs:
    """Captured graphs of decode and mixed windows, sharing static inputs and one memory pool.

    `slots` batch slots; `max_blocks` block-table columns a request can need; `max_tokens` the most rows of a
    window the scheduler plans (token budget plus the alignment overrun of a prompt piece). With
    `keep_hidden` (the MTP head drafts) every replay also leaves its rows' final hidden states in one static
    buffer (`hidden_rows`). `draft_rows`: the most draft tokens a window verifies (slots times the engine's
    draft tokens; 0 without drafts), which its mixed buckets score beside one row a sequence.

    A model with an expert tier gets decode windows only, each captured piecewise (app/models/pieces.py): a
    graph up to each tiered layer's resident experts, the layer's misses computed by the host between two
    replays. Its windows with prompt rows run eagerly (their misses cost far more than the launches).
    """

    def __init__(
        self,
        model: CausalLM,
        state: PagedState,
        slots: int,
        max_blocks: int,
        max_tokens: int,
        keep_hidden: bool = False,
        draft_rows: int = 0,
    ) -> None:
        self.model = model
        self.state = state
        self.slots = slots
        seqs = slots + 1  # the chunks' sequences and one of padding
        self.tiers = [m for m in model.modules() if isinstance(m, TieredExperts)]
        # drafting chunks replay mixed buckets where recurrent layers read them token by token in one launch
        recurrent = any(isinstance(m, GatedDeltaNet) for m in model.modules())
        self.draft_rows = draft_rows if model.backends.stepwise_spans or not recurrent else 0
        self.stepping = recurrent and self.draft_rows > 0  # the layout carries stepwise spans
        mixed = [] if self.tiers else mixed_buckets(max_tokens, seqs)
        self.buckets = mixed + [Bucket(n, n, 1) for n in buckets_up_to(slots)]
        self.max_tokens = max(b.tokens for b in self.buckets)
        self.max_seqs = max(b.seqs for b in self.buckets)
        size = state.block_size
        self.width = max(max_blocks, -(-self.max_tokens // size))  # the padding sequence's blocks too
        tokens, seqs = self.max_tokens, self.max_seqs
        device = state.device
        # Static inputs: int64 ones in one tensor, int32 ones in another, each filled by one copy per window.
        self._long_sizes = [tokens] * 6 + [seqs] * 2 + [seqs + self.draft_rows]
        self._int_sizes = [seqs + 1, seqs, seqs, seqs, seqs * self.width]
        self._long = torch.zeros(sum(self._long_sizes), dtype=torch.int64, device=device)
        self._int = torch.zeros(sum(self._int_sizes), dtype=torch.int32, device=device)
        self._long_host = torch.zeros_like(self._long, device="cpu")
        self._int_host = torch.zeros_like(self._int, device="cpu")
        # Pinned, so the copies to the device are asynchronous; the event marks when the last ones are done
        # (a window whose chunks sample nothing leaves the host free to fill the next before they ran).
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._long_host, self._int_host = self._long_host.pin_memory(), self._int_host.pin_memory()
            self._copied = torch.cuda.Event()
        (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.live,
            self.row_slots,
            self.row_saves,
            self.state_slots,
            self.save_slots,
            self.sample_rows,
        ) = self._long.split(self._long_sizes)
        self.query_start, self.seq_lens, self.save_at, self.stepwise, table = self._int.split(self._int_sizes)
        self.block_table = table.view(seqs, self.width)
        # numpy views of the pinned host buffers, made once: a window fills them without torch calls
        self._long_views = np.split(self._long_host.numpy(), np.cumsum(self._long_sizes)[:-1])
        self._int_views = np.split(self._int_host.numpy(), np.cumsum(self._int_sizes)[:-1])
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.pieces: dict[Bucket, Pieces] = {}  # a tiered model's buckets
        self.outs: dict[Bucket, torch.Tensor] = {}  # what each bucket's forward returns, static
        self._hidden: torch.Tensor | None = None
        if keep_hidden:
            dtype = model.model.embed_tokens.weight.dtype
            self._hidden = torch.zeros(tokens, model.config.hidden_size, dtype=dtype, device=device)
        self._fill([], self.buckets[-1])

    @property
    def mixed_rows(self) -> tuple[int, ...]:
        """The row counts of the mixed buckets, ascending: what windows with prompt rows are padded to."""
        return tuple(sorted({b.tokens for b in self.buckets if not b.decode}))

    def bucket(self, chunks: Sequence[Chunk]) -> Bucket | None:
        """The smallest bucket that holds the window's chunks, or None when it must run eagerly: windows
        with more draft tokens than `draft_rows` (among them every drafting window where the recurrent
        layers' kernels do not read stepwise spans in one launch)."""
        if not chunks or len(chunks) > self.slots:
            return None
        stepwise = any(c.stepwise for c in chunks)
        if stepwise and sum(c.sampled_rows - 1 for c in chunks if c.sampled_rows) > self.draft_rows:
            return None
        rows = sum(len(c.tokens) for c in chunks)
        if not stepwise and all(c.decode for c in chunks):
            return next((b for b in self.buckets if b.decode and b.tokens >= rows), None)
        longest = max(len(c.tokens) for c in chunks)
        return next(
            (b for b in self.buckets if not b.decode and b.tokens >= rows and b.longest >= longest), None
        )

    def _fill(self, chunks: Sequence[Chunk], bucket: Bucket) -> None:
        """Write the chunks into the static inputs of `bucket`, padding onto the scratch block and slot."""
        self._fill_rows(WindowRows.of_chunks(chunks), bucket)

    def _fill_rows(self, window: WindowRows, bucket: Bucket) -> None:
        """Write the window's sequences into the static inputs of `bucket`, padding onto the scratch block and
        slot.

        Filled through numpy views of the pinned host buffers (no per-row torch calls), then copied over.
        """
        if self._copied is not None:
            self._copied.synchronize()
        size, scratch = self.state.block_size, self.state.scratch_block
        n = len(window.lengths)
        lengths = np.zeros(bucket.seqs, np.int64)
        pasts = np.zeros(bucket.seqs, np.int64)
        lengths[:n] = window.lengths
        pasts[:n] = window.pasts
        real = int(lengths[:n].sum())
        if bucket.decode:
            lengths[n:] = 1
        elif n < bucket.seqs:
            lengths[n] = bucket.tokens - real  # one padding sequence (the rest stay empty)
        ids, positions, mapping, live, row_slots, row_saves, state_slots, save_slots, sample_rows = (
            self._long_views
        )
        query_start, seq_lens, save_at, stepwise, table = self._int_views
        table = table.reshape(self.max_seqs, self.width)
        starts = np.zeros(bucket.seqs + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        query_start[: bucket.seqs + 1] = starts
        seq_lens[: bucket.seqs] = pasts + lengths
        seq = np.repeat(np.arange(bucket.seqs), lengths)  # [tokens]: each row's sequence
        rows = np.arange(bucket.tokens)
        positions[: bucket.tokens] = pasts[seq] + rows - starts[seq]
        used = -(-(pasts + lengths) // size)
        table[: bucket.seqs, 0] = scratch
        for i, blocks in enumerate(window.tables):
            table[i, : used[i]] = blocks[: used[i]]
        for i in range(n, bucket.seqs):
            table[i, : used[i]] = scratch
        row_positions = positions[: bucket.tokens]
        mapping[: bucket.tokens] = table[seq, row_positions // size] * size + row_positions % size
        ids[: bucket.tokens] = 0
        if real and window.ids is not None:
            ids[:real] = window.ids
        live[: bucket.tokens] = rows < real
        state_slots[: bucket.seqs] = self.state.scratch_slot
        state_slots[:n] = window.slots
        row_slots[: bucket.tokens] = state_slots[seq]
        save_at[: bucket.seqs] = 0
        save_slots[: bucket.seqs] = -1
        for i, save in window.saves:
            save_at[i], save_slots[i] = save
        if not bucket.decode:  # a decode bucket scores every row and holds no stepwise chunk
            stepwise[: bucket.seqs] = 0
            row_saves[: bucket.tokens] = -1
            for i, saves in window.step_saves:  # verifies drafts: read token by token
                stepwise[i] = 1
                row_saves[starts[i] : starts[i] + len(saves)] = saves
            # the rows each chunk samples at (its last `sampled_rows`), in order, then unused ones
            counts = window.sampled
            total = int(counts.sum())
            firsts = np.cumsum(counts) - counts
            within = np.arange(total) - np.repeat(firsts, counts)
            sample_rows[:total] = np.repeat(starts[1 : n + 1] - counts, counts) + within
            sample_rows[total : bucket.seqs + self.draft_rows] = 0
        self._long.copy_(self._long_host, non_blocking=True)
        self._int[: -self._int_sizes[-1]].copy_(self._int_host[: -self._int_sizes[-1]], non_blocking=True)
        # Rows read only the columns their length covers: copy no more than the widest row needs.
        width = int(used.max(initial=1))
        host_table = self._int_host[-self._int_sizes[-1] :].view(self.max_seqs, self.width)
        self.block_table[: bucket.seqs, :width].copy_(host_table[: bucket.seqs, :width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _batch(self, bucket: Bucket) -> ForwardBatch:
        """A forward batch over the static inputs of `bucket`."""
        tokens, seqs = bucket.tokens, bucket.seqs
        layout = PagedLayout(
            query_start=self.query_start[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_table=self.block_table[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            state_slots=self.state_slots[:seqs],
            max_query_len=bucket.longest,
            live_rows=self.live[:tokens],
            row_slots=self.row_slots[:tokens],
            save_at=None if bucket.decode else self.save_at[:seqs],
            save_slots=None if bucket.decode else self.save_slots[:seqs],
            stepwise=self.stepwise[:seqs] if self.stepping and not bucket.decode else None,
            row_saves=self.row_saves[:tokens] if self.stepping and not bucket.decode else None,
        )
        spans = [SequenceSpan(seq=self.state.scratch_slot, start=0, length=0, past=0)] * seqs
        return ForwardBatch(self.input_ids[:tokens], self.positions[:tokens], spans, self.state, layout)

    def forward(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's forward over the static inputs: logits of every row of a decode bucket, of the rows
        in `sample_rows` of a mixed one."""
        hidden = self.model(self._batch(bucket))
        if self._hidden is not None:
            self._hidden[: bucket.tokens].copy_(hidden)
        if not bucket.decode:
            hidden = hidden[self.sample_rows[: bucket.seqs + self.draft_rows]]
        return self.model.logits(hidden)

    def hidden_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states of `rows` of the last window replayed (`keep_hidden`), copied out."""
        assert self._hidden is not None, "the graphs keep no hidden states"
        return self._hidden[rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (so smaller ones reuse its memory)."""
        order = sorted(self.buckets, key=lambda b: (b.tokens, b.longest), reverse=True)
        if not self.tiers:
            self.graphs, self.outs = capture_each(order, lambda b: self._fill([], b), self.forward)
        else:
            pool = torch.cuda.graph_pool_handle()
            for bucket in order:
                self._fill([], bucket)
                side = warm_up_on_side(lambda bucket=bucket: self.forward(bucket))
                self._capture_pieces(bucket, Pieces(pool), side)
            torch.cuda.synchronize()
        decode = [b.tokens for b in self.buckets if b.decode]
        log.info("captured window graphs: decode %s rows; mixed %s rows", decode, list(self.mixed_rows))

    def _capture_pieces(self, bucket: Bucket, pieces: Pieces, stream: torch.cuda.Stream) -> None:
        """Capture `bucket` piecewise on `stream`: every tier cuts the graph at its misses."""
        for tier in self.tiers:
            tier.pieces = pieces
        try:
            with torch.cuda.stream(stream):
                pieces.begin()
                self.outs[bucket] = self.forward(bucket)
                pieces.end()
        finally:
            for tier in self.tiers:
                tier.pieces = None
        torch.cuda.current_stream().wait_stream(stream)
        self.pieces[bucket] = pieces

    @torch.inference_mode()
    def time_mixed(self, repeats: int = 3) -> list[tuple[int, float]]:
        """Seconds of one replay of each mixed row count (its widest bucket), measured on the device: what a
        window with prompt rows costs before any has run. Empty without captured graphs."""
        widest: dict[int, Bucket] = {}
        for bucket in sorted(self.graphs, key=lambda b: b.longest):
            if not bucket.decode:
                widest[bucket.tokens] = bucket
        timings = []
        for tokens, bucket in sorted(widest.items()):
            self._fill([], bucket)
            graph = self.graphs[bucket]
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            end.synchronize()
            timings.append((tokens, start.elapsed_time(end) / 1000 / repeats))
        return timings

    def run(self, chunks: Sequence[Chunk], bucket: Bucket, fed: Fed | None = None) -> torch.Tensor:
        """Replay `bucket` for the chunks; returns logits [rows, vocab] (fp32) of the rows they sample at, in
        order (`Chunk.sampled_rows` of each).

        `fed` replaces the input tokens of some rows with tokens on the device (drawn by the window before).
        Without a captured graph (CPU tests) the same forward runs eagerly over the same static inputs.
        """
        self._fill(chunks, bucket)
        if fed is not None:
            self.input_ids[fed[0]] = fed[1]
        logits = self._replay(bucket)
        if not bucket.decode:
            return logits[: sum(c.sampled_rows for c in chunks)]
        if all(c.samples for c in chunks):
            return logits[: len(chunks)]
        rows = [i for i, c in enumerate(chunks) if c.samples]
        return logits[device_tensor(rows, torch.long, logits.device)]

    def _replay(self, bucket: Bucket) -> torch.Tensor:
        """Replay `bucket` over the static inputs as filled (its pieces or its graph), or without a capture
        (CPU tests) run its forward over them eagerly; what its forward returns."""
        pieces, graph = self.pieces.get(bucket), self.graphs.get(bucket)
        if pieces is not None:
            pieces.replay()
        elif graph is not None:
            graph.replay()
        else:
            return self.forward(bucket)
        return self.outs[bucket]

    def holds(self, bucket: Bucket) -> bool:
        """Whether `bucket` is one of these graphs' (captured, where they are)."""
        return bucket in self.buckets


class StageGraphs(WindowGraphs):
    """Window graphs of one stage of a layer split (`part`): its layers captured per bucket, from the token
    ids (stage 0: the embedding first) or from the residual stream and the last layer's output as the stage
    before sends them (static inputs too), to the stream and this stage's last output for the next stage,
    or on the last stage to the final hidden states of every row. Stage 0 picks a window's bucket and sends it
    down with the window; a stage runs it eagerly where the bucket is not one of its own (an expert tier
    there captures decode windows only). `dtype`: the stream's."""

    def __init__(
        self, model: CausalLM, state: PagedState, sizes: GraphSizes, part: ModelPart, dtype: torch.dtype
    ) -> None:
        self.part = part
        super().__init__(
            model, state, sizes.slots, sizes.max_blocks, sizes.max_tokens, draft_rows=sizes.draft_rows
        )
        self.stream: torch.Tensor | None = None  # the stream [0] and the last layer's output [1] as received
        if not part.first:
            shape = (2, self.max_tokens, model.config.hidden_size)
            self.stream = torch.zeros(shape, dtype=dtype, device=state.device)

    def forward(self, bucket: Bucket) -> torch.Tensor:
        """This stage's layers over the bucket's static inputs: [2, tokens, hidden] (the stream and the last
        layer's output), or on the last stage the final hidden states [tokens, hidden]."""
        batch, decoder, rows = self._batch(bucket), self.model.model, bucket.tokens
        if self.stream is None:
            x, pending = decoder.embed_tokens(batch.input_ids), None
        else:
            x, pending = self.stream[0, :rows], self.stream[1, :rows]
        x, pending = decoder.run_layers(batch, self.part.layers, x, pending, keep_picks=self.part.last)
        assert pending is not None  # every stage holds a layer
        if self.part.last:
            return decoder.final_norm(x, pending)
        return torch.stack((x, pending))

    def run_part(
        self, window: WindowRows, bucket: Bucket, received: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Replay `bucket` for the window, after the stream and last output `received` from the stage before
        (not on stage 0): [2, rows, hidden] for the next stage, the window's rows only and a tensor of their
        own (a send may still read it when the next window replays), or on the last stage the final hidden
        states of the bucket's rows (static: index them before the next window)."""
        self._fill_rows(window, bucket)
        if self.stream is not None:
            assert received is not None
            rows = received[0].shape[0]
            self.stream[0, :rows].copy_(received[0])
            self.stream[1, :rows].copy_(received[1])
        out = self._replay(bucket)
        if self.part.last:
            return out
        return out[:, : int(window.lengths.sum())].clone()
