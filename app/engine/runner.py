"""The model runner: one forward per window, then sampling.

It drives the device for each window. The other engine modules that touch devices are the ones it uses: the
paged state (paged_state.py), the window graphs (cuda_graphs.py), the park's copies (parking.py) and a layer
split's stages (split.py, stage_worker.py); the engine core reads routing counters back every EXPERT_REPORT_S
seconds. The scheduler and everything it
imports never do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from app.engine.cuda_graphs import Bucket, Fed, StageGraphs, WindowGraphs, WindowRows
from app.engine.drafts import MtpGuesses, guess_index
from app.engine.grammar import Grammars, TokenMask
from app.engine.paged_state import PagedState, StateCopies
from app.engine.parking import ConversationPark, Parked
from app.engine.protocol import ExpertUsage, PositionLogprobs, StageTimes
from app.engine.sampler import DrawnTokens, RowSampling, Sampler
from app.engine.scheduler import Chunk, Window, placeholder_row
from app.engine.split import StagePipeline, StageWork, Unpark
from app.engine.transfer import device_tensor
from app.engine.warm_up import warm_up_kernels
from app.models.batch import ForwardBatch
from app.models.config import LINEAR_ATTENTION
from app.models.qwen3 import CausalLM


@dataclass
class Sampled:
    """A token drawn for the request of `chunk`, with its log-probabilities when asked for."""

    chunk: Chunk
    token_id: int
    logprobs: PositionLogprobs | None


@dataclass
class Launched:
    """A window queued on the device: the chunks that sample, one entry a row they sample at, in the order
    of the tokens drawn for them (still on the device, their copy to the host queued), and whether it
    replayed a CUDA graph. On a layer split the window is still going down the stages: `later` draws its
    tokens once the last one answers. A window with rows under a grammar is `pending` until
    `ModelRunner.sample_pending` draws its tokens, once the tokens before them are read. With the MTP head
    drafting, `kept` holds the final hidden states of every row of the `kept_chunks` (those of requests it
    drafts for), in order, for the head to read once the window's tokens are known."""

    sampling: list[Chunk]
    drawn: DrawnTokens | None
    replayed: bool
    later: Callable[[], DrawnTokens | None] | None = None
    pending: tuple[torch.Tensor, list[RowSampling]] | None = None  # logits whose sampling waits for masks
    kept_chunks: list[Chunk] = field(default_factory=list)
    kept: torch.Tensor | None = None


class ModelRunner:
    """Flattens a window into one varlen batch (prompt chunks and decode rows together), runs it, samples.

    With whole-batch kernels the batch carries a `PagedLayout`; with `graphs`, a window that fits one of
    their buckets replays a captured CUDA graph instead of running eagerly.
    """

    def __init__(
        self,
        model: CausalLM,
        state: PagedState,
        sampler: Sampler,
        graphs: WindowGraphs | None = None,
        park: ConversationPark | None = None,
        pipeline: StagePipeline | None = None,
    ) -> None:
        self.model = model
        self.pipeline = pipeline
        self.park = park
        self.state = state
        self.sampler = sampler
        self.graphs = graphs
        self.paged = model.backends.paged_attention is not None
        self.recurrent = LINEAR_ATTENTION in model.config.layer_types
        self.last_replayed = False  # whether the last window replayed a CUDA graph
        self.last_wait_s = 0.0  # how long the host waited for the device to read the last window's tokens
        self.last_stages: list[StageTimes] | None = None  # a split's stage times for the last window read
        self.last_reports: list[ExpertUsage] = []  # and the other stages' routing reports that came with it
        self._drawn: torch.Tensor | None = None  # the tokens of the last window launched, on the device
        self.guesses: torch.Tensor | None = None  # the MTP head's guesses left on the device, flat (core.py)
        self.grammars: Grammars | None = None  # set by the engine once a request has a grammar
        # on a layer split: the stamp of a block table (`BlockPool.stamp_of`, set by the engine), and the
        # stamp of each slot's table as last sent down the stages (sent again only once it changed)
        self.table_stamp: Callable[[list[int]], int] | None = None
        self._sent_tables: dict[int, int] = {}
        self.device = model.model.embed_tokens.weight.device

    def warm_up(self, most_rows: int) -> None:
        """Compile the kernel variants of eager windows of up to `most_rows` rows on a GPU before the first
        request arrives (`warm_up_kernels`; on a layer split, stage 0's part, as every stage does its own)."""
        if self.paged and self.device.type == "cuda":
            part = self.pipeline.part if self.pipeline else None
            warm_up_kernels(self.model, self.state, most_rows, part)

    @torch.inference_mode()
    def launch(self, window: Window) -> Launched:
        """Queue the window's state copies, forward pass and sampling on the device; return without waiting.

        A chunk whose last token is a placeholder (`scheduler.placeholder`) is fed the token drawn on the
        device for that row of the window launched before, which the host has not read yet; a draft token
        that is a guess placeholder (`drafts.guess_placeholder`), the head's guess it stands for.
        """
        chunks, graphs = window.chunks, self.graphs
        copies = StateCopies(
            window.saves, window.block_copies, window.restores, [c.slot for c in chunks if c.fresh]
        )
        copies.apply(self.state)
        unparks: list[Unpark] = []
        for parked, slot, blocks in window.unparks:
            assert self.park is not None and isinstance(parked, Parked)
            self.park.restore(parked, slot, blocks)
            unparks.append((self.park.key_of(parked), parked.tokens, slot, blocks))
        fed = self._fed(chunks)
        streams = self.state.count_reads([(c.request.blocks, c.past + len(c.tokens)) for c in chunks])
        bucket = graphs.bucket(chunks) if graphs is not None and not streams else None
        if self.pipeline is not None:  # every stage's blocks have the numbers of stage 0's
            return self._down_the_stages(chunks, fed, copies, unparks, bucket)
        self.last_replayed = bucket is not None
        kept_chunks, kept_rows = _kept(chunks)
        kept = None
        if graphs is not None and bucket is not None:
            sampling = [c for c in chunks for _ in range(c.sampled_rows)]
            logits = graphs.run(chunks, bucket, fed)
            if kept_rows:
                kept = graphs.hidden_rows(device_tensor(kept_rows, torch.long, self.device))
        else:
            sampling, logits, kept = self._eager(chunks, fed, kept_rows)
        self._drawn = None
        if not sampling:
            return Launched([], None, self.last_replayed, kept_chunks=kept_chunks, kept=kept)
        if any(c.request.matcher is not None for c in sampling):  # its masks wait for the tokens before
            pending = (logits, _row_sampling(sampling, True))
            return Launched(
                sampling, None, self.last_replayed, pending=pending, kept_chunks=kept_chunks, kept=kept
            )
        drawn = self.sampler.sample(logits, _row_sampling(sampling))
        drawn.to_host()
        self._drawn = drawn.tokens
        return Launched(sampling, drawn, self.last_replayed, kept_chunks=kept_chunks, kept=kept)

    def sample_pending(self, launched: Launched) -> None:
        """Draw a pending window's tokens under its rows' grammar masks (queued behind its forward pass,
        which may still be running); the next window can then feed them."""
        assert launched.pending is not None
        logits, rows = launched.pending
        launched.pending = None
        launched.drawn = self.sampler.sample(logits, rows, self._token_mask(launched.sampling, launched=True))
        launched.drawn.to_host()
        self._drawn = launched.drawn.tokens

    def _token_mask(self, sampling: list[Chunk], launched: bool = False) -> TokenMask | None:
        """The masks of the sampled rows whose requests follow a grammar that is not yet whole, or None
        where no row has one. Their matchers must have seen every token before the rows' own (`launched`:
        the newest token is the row's own placeholder, already appended)."""
        constrained = [
            (i, c.request)
            for i, c in enumerate(sampling)
            if c.request.matcher is not None and not Grammars.complete(c.request.matcher)
        ]
        if not constrained:
            return None
        assert self.grammars is not None
        before = slice(None, -1) if launched else slice(None)
        assert all(t >= 0 for _, r in constrained for t in r.output[before][-1:]), (
            "a grammar row's token unread"
        )
        words = self.grammars.bitmask([r.matcher for _, r in constrained], pin=self.device.type == "cuda")
        return TokenMask([i for i, _ in constrained], words)

    def _down_the_stages(
        self,
        chunks: list[Chunk],
        fed: Fed | None,
        copies: StateCopies,
        unparks: list[Unpark],
        bucket: Bucket | None,
    ) -> Launched:
        """Send the window down a layer split's stages (stage 0's layers run here now: `bucket` of its stage
        graphs replayed, or eagerly) with what the park changed since the last window and the conversations
        it restores in this one; its tokens are drawn when `collect` reads the last stage's answer. The rows'
        sampling is fixed now, before later windows of other slot groups change what the requests hold."""
        assert self.pipeline is not None and fed is None  # a group's window waits for its last one's tokens
        graphs = self.graphs
        self.last_replayed = bucket is not None
        sampling, last_rows = _sampled_rows(chunks)
        layers: Callable[[], torch.Tensor]
        if bucket is not None:
            assert isinstance(graphs, StageGraphs)
            window = WindowRows.of_chunks(chunks)
            layers = partial(graphs.run_part, window, bucket)
        else:
            layers = partial(self.pipeline.first_layers, self._batch(chunks, fed))
        work = StageWork(
            chunks=[(c.slot, len(c.tokens), c.past) for c in chunks],
            saves={c.slot: c.save for c in chunks if c.save is not None},
            tables=self._changed_tables(chunks),
            copies=copies,
            stepwise=stepwise_rows(chunks) if self.recurrent else {},
            parks=self.park.take_mirror() if self.park is not None else [],
            unparks=unparks,
            bucket=bucket,
        )
        kept_chunks, kept_rows = _kept(chunks)
        self.pipeline.send(last_rows + kept_rows, work, layers)
        rows = _row_sampling(sampling, copied=True)
        mask = self._token_mask(sampling)
        pipeline = self.pipeline
        launched = Launched(sampling, None, self.last_replayed, kept_chunks=kept_chunks)

        def draw() -> DrawnTokens | None:
            hidden, self.last_stages, self.last_reports = pipeline.receive(len(rows) + len(kept_rows))
            if hidden is None:
                return None
            if kept_rows:
                launched.kept = hidden[len(rows) :]
            if not rows:
                return None
            drawn = self.sampler.sample(self.model.logits(hidden[: len(rows)]), rows, mask)
            drawn.to_host()
            return drawn

        launched.later = draw
        return launched

    def _changed_tables(self, chunks: list[Chunk]) -> dict[int, list[int]]:
        """The chunks' block tables the stages do not hold yet, by slot (all without `table_stamp`)."""
        tables = {}
        for chunk in chunks:
            blocks = chunk.request.blocks
            stamp = None if self.table_stamp is None else self.table_stamp(blocks)
            if stamp is None or self._sent_tables.get(chunk.slot) != stamp:
                tables[chunk.slot] = blocks
                if stamp is not None:
                    self._sent_tables[chunk.slot] = stamp
        return tables

    def collect(self, launched: Launched) -> list[Sampled]:
        """Wait for a launched window's tokens; one per chunk that samples, in launch order."""
        self.last_wait_s = 0.0
        self.last_stages, self.last_reports = None, []
        if launched.later is not None:
            launched.drawn, launched.later = launched.later(), None
        if launched.drawn is None:
            return []
        result = launched.drawn.read()
        self.last_wait_s = result.wait_s
        drawn = zip(launched.sampling, result.token_ids, result.logprobs, strict=True)
        return [Sampled(chunk, token, logprobs) for chunk, token, logprobs in drawn]

    def _fed(self, chunks: list[Chunk]) -> Fed | None:
        """The rows whose token is a placeholder and the device tokens that replace them, or None."""
        rows, sources, guessed, guesses, end = [], [], [], [], 0
        for chunk in chunks:
            end += len(chunk.tokens)
            if chunk.drafts:  # its newest token is known; its guesses may be on the device
                for row in range(end - chunk.drafts, end):
                    index = guess_index(chunk.tokens[row - end])
                    if index is not None:
                        guessed.append(row)
                        guesses.append(index)
            elif chunk.tokens[-1] < 0:  # only a request's newest token can be one
                rows.append(end - 1)
                sources.append(placeholder_row(chunk.tokens[-1]))
        if not rows and not guessed:
            return None
        n, g = len(rows), len(guessed)
        index = device_tensor(rows + guessed + sources + guesses, torch.long, self.device)
        feeds = []
        if rows:
            if self._drawn is None:
                raise RuntimeError("a window feeds placeholder tokens but no window was launched before it")
            feeds.append(self._drawn[index[n + g : n + g + n]])
        if guessed:
            if self.guesses is None:
                raise RuntimeError("a window feeds guess placeholders but the head left no guesses")
            feeds.append(self.guesses[index[n + g + n :]])
        return index[: n + g], feeds[0] if len(feeds) == 1 else torch.cat(feeds)

    def _batch(self, chunks: list[Chunk], fed: Fed | None) -> ForwardBatch:
        """The window's flat batch (its rows' block tables set).

        Replayed windows read their rows' block tables themselves; eager ones go through the state's.
        """
        for chunk in chunks:
            self.state.set_block_table(chunk.slot, chunk.request.blocks)
        batch = ForwardBatch.build(
            [(c.slot, c.tokens, c.past) for c in chunks],
            self.state,
            self.device,
            saves={c.slot: c.save for c in chunks if c.save is not None},
            stepwise=stepwise_rows(chunks) if self.recurrent else None,
        )
        if fed is not None:
            batch.input_ids[fed[0]] = fed[1]
        if self.paged:
            batch.layout = self.state.layout(batch.spans)
        if self.recurrent and not (self.paged and self.model.backends.stepwise_spans):
            batch.in_steps(self.state.layout if self.paged else None)
        return batch

    def _eager(
        self, chunks: list[Chunk], fed: Fed | None, kept_rows: list[int]
    ) -> tuple[list[Chunk], torch.Tensor, torch.Tensor | None]:
        """One forward over the flat batch; the chunks that sample, their logits, and the final hidden
        states of `kept_rows` (None without any)."""
        batch = self._batch(chunks, fed)
        sampling, last_rows = _sampled_rows(chunks)
        hidden = self.model(batch)
        kept = hidden[device_tensor(kept_rows, torch.long, self.device)] if kept_rows else None
        if not sampling:
            return [], hidden[:0], kept
        logits = self.model.logits(hidden[device_tensor(last_rows, torch.long, self.device)])
        return sampling, logits, kept


def _sampled_rows(chunks: list[Chunk]) -> tuple[list[Chunk], list[int]]:
    """The chunks that sample, one entry a row they sample at (a chunk with drafts at its last 1 + drafts
    rows), and those rows of the window, flat in chunk order."""
    sampling, rows, end = [], [], 0
    for chunk in chunks:
        end += len(chunk.tokens)
        for j in range(chunk.sampled_rows):
            sampling.append(chunk)
            rows.append(end - chunk.sampled_rows + j)
    return sampling, rows


def _kept(chunks: list[Chunk]) -> tuple[list[Chunk], list[int]]:
    """The chunks of requests the MTP head drafts for, and the window's rows of them, in order."""
    kept, rows, start = [], [], 0
    for chunk in chunks:
        if isinstance(chunk.request.drafter, MtpGuesses):
            kept.append(chunk)
            rows.extend(range(start, start + len(chunk.tokens)))
        start += len(chunk.tokens)
    return kept, rows


def stepwise_rows(chunks: list[Chunk]) -> dict[int, tuple[int, ...]]:
    """The slots of the stepwise chunks (`Chunk.stepwise`) to the state slots that keep the state after
    each of their rows (`Chunk.step_saves`)."""
    return {c.slot: c.step_saves for c in chunks if c.stepwise}


def _row_sampling(sampling: list[Chunk], copied: bool = False) -> list[RowSampling]:
    """How each sampled row draws its token; with `copied`, over copies of what its request holds. Row j of
    a chunk with drafts draws as if its first j drafts had been generated (they have, if it is read)."""
    rows = []
    previous, j = None, 0
    for chunk in sampling:
        j = j + 1 if chunk is previous else 0
        previous = chunk
        r = chunk.request
        output = list(r.output) if copied else r.output
        if j:
            output = output + chunk.tokens[len(chunk.tokens) - chunk.drafts :][:j]
        rows.append(
            RowSampling(
                params=r.params,
                position=len(r.prompt) + len(output),
                prompt_token_ids=list(r.prompt) if copied else r.prompt,
                output_token_ids=output,
            )
        )
    return rows
