"""The model's MTP head as a draft source (`--spec mtp`).

The head's row t joins the main model's final hidden state at t with the embedding of token t+1 and scores
token t+2 (app/models/qwen3.py, `MTPHead`). So it can read a window's rows only once the token after each is
known: when the window's tokens have been read, the head reads every row the window added to a drafting
request (each prompt chunk's rows; a verifying chunk's rows up to its last accepted guess), its keys and
values going into the request's own KV blocks under the head's layer numbers, so that it attends to the
whole conversation as it did in training. From the last row's output it guesses the token after the newest
one; each further guess is one more step of the head on its own output and the guess before (a step's keys
and values sit where the next window's pass writes the true ones). Guesses are the head's argmax: they are
proposals, and verification keeps every request's own distribution whatever they are. A captured pass can
leave them on the device (`on_device`, app/engine/head_graphs.py): what it returns are then placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from app.engine.paged_state import PagedState
from app.engine.transfer import device_tensor
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM

if TYPE_CHECKING:
    from app.engine.head_graphs import DeviceGuesses, HeadGraphs


@dataclass(frozen=True)
class MtpSpan:
    """One request's rows for the head: `rows` (indices into the hidden states kept of the window) at the
    positions from `past`, `next_ids` the token after each, in state `slot` whose positions `blocks` hold;
    then `guesses` tokens to guess after the last row (0: none)."""

    slot: int
    past: int
    rows: list[int]
    next_ids: list[int]
    blocks: list[int]
    guesses: int


class MtpDrafter:
    """Runs the MTP head over windows' kept hidden states and returns its guesses; with `graphs`, a pass
    they hold replays its captured graph (app/engine/head_graphs.py)."""

    def __init__(self, model: CausalLM, state: PagedState, graphs: HeadGraphs | None = None) -> None:
        if model.mtp is None:
            raise ValueError("the model has no MTP head")
        self.model = model
        self.state = state
        self.graphs = graphs
        self.paged = model.backends.paged_attention is not None
        self.device = model.model.embed_tokens.weight.device

    def _batch(self, chunks: list[tuple[int, list[int], int]]) -> ForwardBatch:
        """An eager pass's batch. Its rows are marked live (`live_rows`, every one real): the kernels then
        run the variants the warm-up compiled (app/engine/warm_up.py marks its rows not live)."""
        batch = ForwardBatch.build(chunks, self.state, self.device)
        if self.paged:
            layout = self.state.layout(batch.spans)
            batch.layout = replace(layout, live_rows=torch.ones_like(layout.slot_mapping))
        return batch

    def _read(self, hidden: torch.Tensor, spans: list[MtpSpan]) -> tuple[torch.Tensor, ForwardBatch]:
        """The head's pass over the spans' rows (their keys and values written): its output and batch."""
        for span in spans:
            self.state.set_block_table(span.slot, span.blocks)
        batch = self._batch([(s.slot, s.next_ids, s.past) for s in spans])
        rows = device_tensor([r for s in spans for r in s.rows], torch.long, self.device)
        return self.model.mtp_forward(hidden[rows], batch.input_ids, batch), batch

    def _graphed(self, hidden: torch.Tensor, spans: list[MtpSpan], on_device: bool) -> list[list[int]] | None:
        """The guesses through the captured pass (`on_device`: their placeholders), or None where it holds
        too few spans. A span of more rows than it takes (a prompt's) has all its rows but the last read
        eagerly first, and only the last one in the capture: the head's chained steps then run eagerly only
        for requests that ask for more guesses than were captured."""
        assert self.graphs is not None
        taken = self.graphs.rows_per
        long = [s for s in spans if len(s.rows) > taken]
        if len(spans) > self.graphs.buckets[-1] or any(s.guesses > self.graphs.guesses for s in spans):
            return None
        if long:
            self._read(hidden, [replace(s, rows=s.rows[:-1], next_ids=s.next_ids[:-1]) for s in long])
            spans = [
                replace(s, past=s.past + len(s.rows) - 1, rows=s.rows[-1:], next_ids=s.next_ids[-1:])
                if len(s.rows) > taken
                else s
                for s in spans
            ]
        bucket = self.graphs.bucket(spans)
        assert bucket is not None, "a span the captured pass does not take"
        return self.graphs.run(hidden, spans, bucket, on_device)

    @torch.inference_mode()
    def guess(
        self, hidden: torch.Tensor, spans: list[MtpSpan], on_device: bool = False
    ) -> tuple[list[list[int]], DeviceGuesses | None]:
        """Read `spans` (their rows of `hidden`, the final hidden states a window kept) into the head's keys
        and values; the guesses of each span, in order (empty where it asks for none). With `on_device` a
        captured pass leaves them on the device: they are then placeholders of the source returned (else
        None)."""
        if not spans:
            return [], None
        if self.graphs is not None:
            graphed = self._graphed(hidden, spans, on_device)
            if graphed is not None:
                return graphed, self.graphs.latest
        out, batch = self._read(hidden, spans)
        guessing = [i for i, s in enumerate(spans) if s.guesses]
        if not guessing:
            return [[] for _ in spans], None
        ends = [batch.spans[i].start + batch.spans[i].length - 1 for i in guessing]
        out = out[device_tensor(ends, torch.long, self.device)]
        tokens = self.model.logits(out).argmax(-1)
        steps = [tokens]
        active = list(range(len(guessing)))  # positions in `guessing` still guessing
        for step in range(1, max(spans[i].guesses for i in guessing)):
            keep = [j for j, g in enumerate(active) if spans[guessing[g]].guesses > step]
            if len(keep) < len(active):
                index = device_tensor(keep, torch.long, self.device)
                out, tokens = out[index], tokens[index]
                active = [active[j] for j in keep]
            chained = []
            for g in active:
                span = spans[guessing[g]]
                chained.append((span.slot, [0], span.past + len(span.rows) - 1 + step))
            out = self.model.mtp_forward(out, tokens, self._batch(chained), step)
            tokens = self.model.logits(out).argmax(-1)
            steps.append(torch.full((len(guessing),), -1, dtype=tokens.dtype, device=self.device))
            steps[-1][device_tensor(active, torch.long, self.device)] = tokens
        table = torch.stack(steps, dim=1).tolist()
        guesses: list[list[int]] = [[] for _ in spans]
        for g, i in enumerate(guessing):
            guesses[i] = table[g][: spans[i].guesses]
        return guesses, None
