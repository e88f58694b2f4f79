"""The model runner: one forward per window, then sampling.

It drives the device for each window. The other engine modules that touch devices are the ones it uses: the
paged state (paged_state.py), the window graphs (cuda_graphs.py) and the park's copies (parking.py); the
engine core reads routing counters back every EXPERT_REPORT_S seconds. The scheduler and everything it
imports never do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from app.engine.cuda_graphs import WindowGraphs
from app.engine.paged_state import PagedState
from app.engine.parking import ConversationPark, Parked
from app.engine.protocol import PositionLogprobs
from app.engine.sampler import RowSampling, Sampler
from app.engine.scheduler import Chunk, Window
from app.engine.transfer import device_tensor
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM


@dataclass
class Sampled:
    """A token drawn for the request of `chunk`, with its log-probabilities when asked for."""

    chunk: Chunk
    token_id: int
    logprobs: PositionLogprobs | None


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
    ) -> None:
        self.model = model
        self.park = park
        self.state = state
        self.sampler = sampler
        self.graphs = graphs
        self.paged = model.backends.paged_attention is not None
        self.last_replayed = False  # whether the last window replayed a CUDA graph
        self.last_wait_s = 0.0  # how long the last window's host waited for the device
        self.device = model.model.embed_tokens.weight.device

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the kernel variants of eager windows on a GPU before the first request arrives.

        Triton compiles a kernel on first use for each specialisation (tile sizes, whether sizes are multiples
        of 16); without this, the first windows that read a prompt would stall every decoding slot while they
        compile. Runs prompt chunks beside decode rows on the scratch block and slot; nothing is counted.
        """
        if not self.paged or self.device.type != "cuda":
            return
        scratch, size = self.state.scratch_slot, self.state.block_size
        self.state.set_block_table(scratch, [self.state.scratch_block] * (-(-160 // size)))
        for lengths in ((97, 1, 1, 1), (96, 1, 1), (160,), (1, 1)):
            batch = ForwardBatch.build([(scratch, [0] * n, 0) for n in lengths], self.state, self.device)
            layout = self.state.layout(batch.spans)
            batch.layout = dataclasses.replace(layout, live_rows=torch.zeros_like(layout.slot_mapping))
            self.model.logits(self.model(batch)[-1:])
        self.state.reset_slot(scratch)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def execute(self, window: Window) -> list[Sampled]:
        """Run the window's forward pass; return one sampled token per chunk that ends at its newest token."""
        self._copy_state(window)
        chunks, graphs = window.chunks, self.graphs
        for chunk in chunks:
            if chunk.fresh:
                self.state.reset_slot(chunk.slot)
        bucket = graphs.bucket(chunks) if graphs is not None else None
        self.last_replayed = bucket is not None
        if graphs is not None and bucket is not None:
            sampling = [c for c in chunks if c.samples]
            logits = graphs.run(chunks, bucket)
            if sampling and len(sampling) < len(chunks):
                rows = [i for i, c in enumerate(chunks) if c.samples]
                logits = logits[device_tensor(rows, torch.long, self.device)]
        else:
            sampling, logits = self._eager(chunks)
        self.last_wait_s = 0.0
        if not sampling:
            return []
        requests = [chunk.request for chunk in sampling]
        result = self.sampler(
            logits,
            [
                RowSampling(
                    params=r.params,
                    position=len(r.prompt) + len(r.output),
                    prompt_token_ids=r.prompt,
                    output_token_ids=r.output,
                )
                for r in requests
            ],
        )
        self.last_wait_s = result.wait_s
        return [
            Sampled(chunk, token, logprobs)
            for chunk, token, logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True)
        ]

    def _copy_state(self, window: Window) -> None:
        """Before the forward: the window's checkpoint saves, block copies, restores and unparks, in order."""
        for slot, checkpoint in window.saves:
            self.state.copy_slot(slot, checkpoint)
        for source, target in window.block_copies:
            self.state.copy_block(source, target)
        for checkpoint, slot in window.restores:
            self.state.copy_slot(checkpoint, slot)
        for parked, slot, blocks in window.unparks:
            assert self.park is not None and isinstance(parked, Parked)
            self.park.restore(parked, slot, blocks)

    def _eager(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor]:
        """One forward over the flat batch; the chunks that sample and their logits.

        Replayed windows read their rows' block tables themselves; eager ones go through the state's.
        """
        for chunk in chunks:
            self.state.set_block_table(chunk.slot, chunk.request.blocks)
        batch = ForwardBatch.build(
            [(c.slot, c.tokens, c.past) for c in chunks],
            self.state,
            self.device,
            saves={c.slot: c.save for c in chunks if c.save is not None},
        )
        if self.paged:
            batch.layout = self.state.layout(batch.spans)
        hidden = self.model(batch)
        sampling = [(span, chunk) for span, chunk in zip(batch.spans, chunks, strict=True) if chunk.samples]
        if not sampling:
            return [], hidden[:0]
        rows = device_tensor([span.start + span.length - 1 for span, _ in sampling], torch.long, self.device)
        return [chunk for _, chunk in sampling], self.model.logits(hidden[rows])
