"""A stage worker of the layer split: one process holding a part of the model's layers and their state.

Spawned by `StagePipeline` (split.py); joins the process group, loads its part, answers `StageLoaded`, takes
the state's size (`StageSetup`), then runs every window that comes down the stages until told to stop: the
window's state copies and block tables on its own state, its layers over the stream it receives, and the
result on to the next stage (the last norms the rows that sample and sends them back to stage 0).
"""

from __future__ import annotations

import logging
import signal
import time
import traceback

import msgspec
import torch
import torch.distributed as dist

from app.engine.config import EngineConfig
from app.engine.paged_state import PagedState
from app.engine.split import (
    TIMEOUT,
    StageAnswer,
    StageLink,
    StageLoaded,
    StageSetup,
    StageWork,
    stage_device,
    use_threads,
)
from app.kernels.backends import select_backends
from app.loading.loader import load_model, resolve_dtype
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM, ModelPart

log = logging.getLogger("strata.engine")


def run_stage(
    stage: int, parts: list[ModelPart], init: str, config_bytes: bytes, device: str, threads: int | None
) -> None:
    """Process entry point of stage `stage` (1 or more) of `parts`, with `threads` on a CPU."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process owns the split's lifetime
    if threads is not None:
        use_threads(threads)
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    where = stage_device(device, stage)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    backend = "nccl" if where.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=stage, world_size=len(parts), timeout=TIMEOUT)
    link = StageLink(where)
    part = parts[stage]
    try:
        backends = select_backends(config.backend, where.type, exact=config.exact)
        assert config.model is not None
        model, checkpoint = load_model(
            config.model, config.dtype, where, progress=False, backends=backends, part=part
        )
        dtype = resolve_dtype(config.dtype, checkpoint, where)
    except Exception as exc:  # the engine process reports it, in one line
        link.send_object(StageLoaded(f"{type(exc).__name__}: {exc}"), 0)
        return
    link.send_object(StageLoaded(), 0)
    setup = link.recv_object(0)
    assert isinstance(setup, StageSetup)
    state = PagedState(
        model.config,
        setup.blocks,
        config.block_size,
        config.parallel,
        dtype,
        where,
        checkpoints=setup.checkpoints,
        layers=part.layers,
    )
    try:
        with torch.inference_mode():
            _serve(stage, part, model, state, link, dtype)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _serve(
    stage: int, part: ModelPart, model: CausalLM, state: PagedState, link: StageLink, dtype: torch.dtype
) -> None:
    """Run windows as they come from the stage before until a `StageWork` says stop (passed on)."""
    hidden = model.config.hidden_size
    paged = model.backends.paged_attention is not None
    while True:
        waited = time.perf_counter()
        work = link.recv_object(stage - 1)
        assert isinstance(work, StageWork)
        if work.stop:
            if not part.last:
                link.send_object(work, stage + 1)
            link.flush()
            return
        x, pending = link.recv_tensors([(work.tokens, hidden)] * 2, dtype, stage - 1)
        began = time.perf_counter()
        waited = began - waited
        work.copies.apply(state)
        for slot, blocks in work.tables.items():
            state.set_block_table(slot, blocks)
        batch = ForwardBatch.build(
            [(slot, [0] * rows, past) for slot, rows, past in work.chunks], state, state.device, work.saves
        )
        if paged:
            batch.layout = state.layout(batch.spans)
        x, pending = model.model.run_layers(batch, part.layers, x, pending)
        if not part.last:
            work.stages.append((link.settled(began), waited))
            link.send_object(work, stage + 1)
            link.send_tensors([x, pending], stage + 1)
            continue
        final = None
        if work.rows:
            final = model.model.final_norm(x, pending)[torch.tensor(work.rows, device=state.device)]
        link.send_object(StageAnswer([*work.stages, (link.settled(began), waited)]), 0)
        if final is not None:
            link.send_tensors([final], 0)
