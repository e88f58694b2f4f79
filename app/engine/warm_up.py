"""Kernel warm-up: the kernel variants of eager windows compiled before the first request arrives.

Triton compiles a kernel on first use for each specialisation (tile sizes, whether sizes are multiples of
16); without a warm-up the first windows that read a prompt would stall every decoding slot while they
compile (on an H200 the first 512-token prompt of a fresh eager process took 2.4 s). Windows replayed from
CUDA graphs were compiled when captured; this covers the eager ones, each stage of a layer split, whose
windows all run eagerly, and the MTP head's eager pass over prompt rows.
"""

from __future__ import annotations

import dataclasses

import torch

from app.engine.paged_state import PagedState
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM, ModelPart

# Windows of prompt chunks beside decode rows, and of decode rows alone: the shapes whose kernels differ.
WARM_UP_WINDOWS = ((97, 1, 1, 1), (96, 1, 1), (160,), (1, 1))


@torch.inference_mode()
def warm_up_kernels(
    model: CausalLM,
    state: PagedState,
    part: ModelPart | None = None,
    stream: torch.dtype = torch.bfloat16,
) -> None:
    """Run WARM_UP_WINDOWS on the scratch block and slot of the paged state (nothing else is touched or
    counted; callers do so on GPUs): the whole model, or a split's stage `part` (the embedding and LM head on
    the first stage, the final norm on the last; a later stage's layers from a residual stream of zeros in
    `stream`'s dtype)."""
    scratch, size = state.scratch_slot, state.block_size
    state.set_block_table(scratch, [state.scratch_block] * (-(-max(map(sum, WARM_UP_WINDOWS)) // size)))
    decoder = model.model
    for lengths in WARM_UP_WINDOWS:
        batch = ForwardBatch.build([(scratch, [0] * n, 0) for n in lengths], state, state.device)
        layout = state.layout(batch.spans)
        batch.layout = dataclasses.replace(layout, live_rows=torch.zeros_like(layout.slot_mapping))
        if part is None:
            hidden = model(batch)
            model.logits(hidden[-1:])
            _warm_up_head(model, state, hidden, batch)
            continue
        if part.first:
            x, pending = decoder.embed_tokens(batch.input_ids), None
        else:
            shape = (sum(lengths), model.config.hidden_size)
            x = torch.zeros(shape, dtype=stream, device=state.device)
            pending = torch.zeros_like(x)
        x, pending = decoder.run_layers(batch, part.layers, x, pending)
        if part.first:
            model.logits(x[-1:])
            _warm_up_head(model, state, torch.zeros_like(x), batch)
        if part.last:
            decoder.final_norm(x, pending)
    state.reset_slot(scratch)
    if state.device.type == "cuda":
        torch.cuda.synchronize()


def _warm_up_head(model: CausalLM, state: PagedState, hidden: torch.Tensor, batch: ForwardBatch) -> None:
    """The MTP head's eager pass over the window's rows, where it drafts (its layers then have keys and
    values in the state; `--spec mtp` reads each prompt's rows with it as soon as they are read)."""
    if model.mtp is not None and state.holds_layer(model.config.num_hidden_layers):
        model.logits(model.mtp_forward(hidden, batch.input_ids, batch)[-1:])
