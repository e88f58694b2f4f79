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
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from app.engine.config import EngineConfig
from app.engine.cuda_graphs import StageGraphs, WindowRows
from app.engine.expert_report import ExpertReporter
from app.engine.paged_state import PagedState, device_kv_bytes, resident_blocks
from app.engine.parking import ConversationPark, stage_directory, stage_identity
from app.engine.protocol import EXPERT_REPORT_S
from app.engine.split import (
    TIMEOUT,
    BusyClock,
    StageAnswer,
    StageLink,
    StageLoaded,
    StageSetup,
    StageStart,
    StageWork,
    default_backend,
    stage_device,
    use_threads,
)
from app.engine.warm_up import warm_up_kernels
from app.kernels import kv_quant
from app.kernels.backends import select_backends
from app.loading.identity import model_identity
from app.loading.loader import experts_within, load_model, resolve_dtype
from app.models.batch import ForwardBatch
from app.models.expert_tier import TieredExperts, decoder_tiers, use_staging
from app.models.placement import spare_slots
from app.models.qwen3 import CausalLM, ModelPart

log = logging.getLogger("strata.engine")


def run_stage(
    stage: int,
    stages: int,
    init: str,
    gpu: int | None,
    model: str | None = None,
    through_host: bool = False,
) -> None:
    """Process entry point of stage `stage` (1 or more) of `stages`: joins the split at `init` (on GPU `gpu`
    of this host, or the CPU), takes the engine's settings and parts from stage 0 (`StageStart`; `model`
    names where this host keeps the model, if not where the engine's does), then serves windows.
    `through_host`: stages share a card, and tensors between them go through host memory over gloo."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process owns the split's lifetime
    where = stage_device("cpu" if gpu is None else "cuda", gpu or 0)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    backend = default_backend(where, through_host)
    dist.init_process_group(backend, init_method=init, rank=stage, world_size=stages, timeout=TIMEOUT)
    link = StageLink(where, through_host)
    start = link.recv_object(0)
    assert isinstance(start, StageStart)
    if start.threads is not None:
        use_threads(start.threads)
    config = msgspec.msgpack.decode(start.config, type=EngineConfig)
    if model is not None:
        config = msgspec.structs.replace(config, model=model)
    part = start.parts[stage]
    try:
        backends = select_backends(config.backend, where.type, exact=config.exact)
        assert config.model is not None
        resident = config.expert_cache
        if config.expert_vram is not None:
            resident = experts_within(config.model, config.dtype, config.expert_vram, where, part, backends)
        model, checkpoint = load_model(
            config.model,
            config.dtype,
            where,
            progress=False,
            backends=backends,
            resident_experts=resident,
            spare_experts=spare_slots(resident or 0) if config.adapt_async else 0,
            part=part,
            placement=config.expert_placement,
        )
        dtype = resolve_dtype(config.dtype, checkpoint, where)
        tiers = [m for m in model.modules() if isinstance(m, TieredExperts)]
        kv_dtype = kv_quant.cache_dtype(config.kv_dtype, dtype)  # checked by the engine before the setup
        on_device = device_kv_bytes(
            model.config, config.kv_memory, config.kv_resident, config.block_size, kv_dtype, part.layers
        )
        staged = use_staging(tiers, config.pcie_frac, decoder_tiers(model), on_device, backends.tier_link)
        if staged is not None:
            torch.set_num_threads(1)  # as in the engine process: the CPU pool's threads do the host's work
    except Exception as exc:  # the engine process reports it, in one line
        link.send_object(StageLoaded(f"{type(exc).__name__}: {exc}"), 0)
        return
    link.send_object(StageLoaded(staged=staged is not None), 0)
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
        kv_dtype=kv_dtype,
        resident=resident_blocks(config.kv_resident, config.block_size),
    )
    if where.type == "cuda" and model.backends.paged_attention is not None:
        warm_up_kernels(model, state, setup.window_tokens, part, dtype)
    graphs = None
    if setup.graphs is not None:  # captured on a GPU; without one (tests) run over the static inputs
        graphs = StageGraphs(model, state, setup.graphs, part, dtype)
        if where.type == "cuda":
            graphs.capture()
    park = None  # as stage 0 decides in EngineCore._conversation_park
    directory = stage_directory(config, stage, stages)
    if config.prefix_cache and (config.park_memory > 0 or directory is not None):
        base = f"{model_identity(Path(config.model))}:{dtype}"
        counts = state.keys.shape[0], state.conv.shape[0]
        identity = stage_identity(base, part.layers, *counts, state.keys.dtype)
        park = ConversationPark(
            state, identity, config.park_memory, directory, config.park_disk, follower=True
        )
        park.reserve_pinned()
    try:
        with torch.inference_mode():
            reporter = ExpertReporter(model, tiers, where.type)
            tiered = _Tiers(tiers, config.adapt_every)
            _serve(stage, part, model, state, link, dtype, tiered, reporter, park, graphs)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


class _Tiers:
    """This stage's expert tiers, adapted on the engine core's schedule: swaps landed before each window, the
    most routed experts made resident every `adapt_every` windows (0: frozen)."""

    def __init__(self, tiers: list[TieredExperts], adapt_every: int) -> None:
        self.tiers, self.adapt_every, self.windows = tiers, adapt_every, 0

    def before(self) -> None:
        for tier in self.tiers:
            tier.land()

    def after(self) -> int:
        """Experts moved onto the device after this window."""
        self.windows += 1
        if self.adapt_every and self.windows % self.adapt_every == 0:
            return sum(tier.adapt() for tier in self.tiers)
        return 0


def _serve(
    stage: int,
    part: ModelPart,
    model: CausalLM,
    state: PagedState,
    link: StageLink,
    dtype: torch.dtype,
    tiers: _Tiers,
    reporter: ExpertReporter,
    park: ConversationPark | None,
    graphs: StageGraphs | None,
) -> None:
    """Run windows as they come from the stage before until a `StageWork` says stop (passed on); every
    EXPERT_REPORT_S seconds its layers' routing report goes down with a window. With a `park`, each window's
    changes to stage 0's park are made here first, and the conversations it restores restored after the
    window's state copies, as stage 0 does. A window stage 0 replayed from its graphs replays the same
    bucket of `graphs` where this stage holds it."""
    hidden = model.config.hidden_size
    reported = time.monotonic()
    clock = BusyClock(state.device)
    tables: dict[int, list[int]] = {}  # every slot's block table as stage 0 last sent it
    while True:
        waited = time.perf_counter()
        work = link.recv_object(stage - 1)
        assert isinstance(work, StageWork)
        if work.stop:
            if park is not None:  # stage 0's last changes, then the files still being written
                for change in work.parks:
                    park.apply(change)
                park.flush()
            if not part.last:
                link.send_object(work, stage + 1)
            link.flush()
            return
        x, pending = link.recv_tensors([(work.tokens, hidden)] * 2, dtype, stage - 1)
        waited = time.perf_counter() - waited
        began = clock.mark()
        if park is not None:
            for change in work.parks:
                park.apply(change)
        work.copies.apply(state)
        if park is not None:
            for key, tokens, slot, blocks in work.unparks:
                park.restore_key(key, tokens, slot, blocks)
        tables.update(work.tables)
        tiers.before()
        if graphs is not None and work.bucket is not None and graphs.holds(work.bucket):
            window = WindowRows.of_stage(work.chunks, tables, work.saves, work.stepwise)
            out = graphs.run_part(window, work.bucket, (x, pending))
            x, pending = (out, None) if part.last else (out[0], out[1])
        else:
            x, pending = _eager_part(model, state, part, work, tables, x, pending)
        reporter.swaps += tiers.after()
        now = time.monotonic()
        if reporter.layers and now - reported >= EXPERT_REPORT_S:
            usage, reported = reporter.take(now - reported), now
            work.experts.append(usage)  # type: ignore[arg-type]
        if not part.last:
            clock.span(began)
            work.stages.append((clock.oldest(), waited))
            link.send_object(work, stage + 1)
            link.send_tensors([x, pending], stage + 1)
            continue
        final = None
        if work.rows:
            if pending is not None:  # an eager window's
                x = model.model.final_norm(x, pending)
            final = x[torch.tensor(work.rows, device=state.device)]
        clock.span(began)
        link.send_object(StageAnswer([*work.stages, (clock.oldest(), waited)], work.experts), 0)
        if final is not None:
            link.send_tensors([final], 0)


def _eager_part(
    model: CausalLM,
    state: PagedState,
    part: ModelPart,
    work: StageWork,
    tables: dict[int, list[int]],
    x: torch.Tensor,
    pending: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This stage's layers run eagerly over the window (`tables`: every slot's block table): the stream and
    the last one's output."""
    for slot, _, _ in work.chunks:
        state.set_block_table(slot, tables[slot])
    chunks = [(slot, [0] * rows, past) for slot, rows, past in work.chunks]
    batch = ForwardBatch.build(chunks, state, state.device, work.saves, work.stepwise)
    if model.backends.paged_attention is not None:
        batch.layout = state.layout(batch.spans)
        if not model.backends.stepwise_spans:
            batch.in_steps(state.layout)
    else:
        batch.in_steps(None)
    return model.model.run_layers(batch, part.layers, x, pending)
