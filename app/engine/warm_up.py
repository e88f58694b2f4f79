"""Kernel warm-up: the kernel variants of eager windows compiled before the first request arrives.

Triton compiles a kernel on first use for each specialisation (tile sizes, whether sizes are multiples of
16); without a warm-up the first windows that read a prompt would stall every decoding slot while they
compile (on an H200 the first 512-token prompt of a fresh eager process took 2.4 s). Windows replayed from
CUDA graphs were compiled when captured; this covers the eager ones, each stage of a layer split, whose
windows all run eagerly, and the MTP head's eager pass over prompt rows.

Launch choices that depend on a window's size pick further variants: the MoE kernels' tiles (up to
`DECODE_TOKENS` rows, or beyond) and whether a grid launches dependently on the one before it (small grids
do, `triton_launch.pdl`). So the warm-up also runs about the most rows of the decode tiles and of a window:
without them the head's first eager pass over a prompt's rows compiled 1-4 variants (on an H200 the first
token of a 64-token prompt came after 101 ms against 23 ms without drafts).
"""

from __future__ import annotations

import dataclasses

import torch

from app.engine.paged_state import PagedState
from app.models.batch import ForwardBatch
from app.models.expert_tier import TieredExperts
from app.models.qwen3 import CausalLM, ModelPart

# Windows of prompt chunks beside decode rows, and of decode rows alone: the shapes whose kernels differ.
WARM_UP_WINDOWS = ((97, 1, 1, 1), (96, 1, 1), (160,), (1, 1))


def warm_up_windows(most_rows: int) -> tuple[tuple[int, ...], ...]:
    """WARM_UP_WINDOWS, then windows of about the most rows the MoE kernels' decode tiles take and of
    `most_rows` (the engine's token budget a window), the sizes at which launch choices change, each of a
    multiple of 16 rows and of one that is not (Triton specialises integer arguments on it)."""
    from app.kernels.triton_moe import DECODE_TOKENS  # here: a CPU-only install has no Triton

    most_rows = max(most_rows, 4)
    near = (DECODE_TOKENS - 1, 1), (DECODE_TOKENS - 2,), (most_rows - 1, 1), (most_rows - 3,)
    return (*WARM_UP_WINDOWS, *near)


@torch.inference_mode()
def warm_up_kernels(
    model: CausalLM,
    state: PagedState,
    most_rows: int,
    part: ModelPart | None = None,
    stream: torch.dtype = torch.bfloat16,
) -> None:
    """Run `warm_up_windows(most_rows)` on the scratch block and slot of the paged state (nothing else is
    touched or counted; callers do so on GPUs): the whole model, or a split's stage `part` (the embedding and
    LM head on the first stage, the final norm on the last; a later stage's layers from a residual stream of
    zeros in `stream`'s dtype)."""
    scratch, size = state.scratch_slot, state.block_size
    windows = warm_up_windows(most_rows)
    state.set_block_table(scratch, [state.scratch_block] * (-(-max(map(sum, windows)) // size)))
    decoder = model.model
    for lengths in windows:
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
    for module in model.modules():
        if isinstance(module, TieredExperts):
            module.take_counts()  # the warm-up's routed entries and copies are nobody's: dropped
    if state.device.type == "cuda":
        torch.cuda.synchronize()


def _warm_up_head(model: CausalLM, state: PagedState, hidden: torch.Tensor, batch: ForwardBatch) -> None:
    """The MTP head's eager pass over the window's rows, where it drafts (its layers then have keys and
    values in the state; `--spec mtp` reads each prompt's rows with it as soon as they are read)."""
    if model.mtp is not None and state.holds_layer(model.config.num_hidden_layers):
        model.logits(model.mtp_forward(hidden, batch.input_ids, batch)[-1:])
