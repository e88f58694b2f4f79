"""EngineCore: step() = schedule() -> runner.launch(window) -> the tokens of the window before -> outputs."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from app.default_model import default_model_dir
from app.engine.config import GIB, EngineConfig
from app.engine.cuda_graphs import GraphSizes, StageGraphs, WindowGraphs
from app.engine.drafts import GuessSource, MtpGuesses, accepted, guess_index
from app.engine.expert_report import ExpertReporter, joined
from app.engine.grammar import Grammars
from app.engine.head_graphs import HeadGraphs
from app.engine.mtp_drafts import MtpDrafter, MtpSpan
from app.engine.paged_state import (
    PagedState,
    device_kv_bytes,
    kv_block_bytes,
    resident_blocks,
    slot_state_bytes,
)
from app.engine.parking import ConversationPark, layer_counts, stage_directory, stage_identity
from app.engine.protocol import (
    EXPERT_REPORT_S,
    AddRequest,
    ExpertUsage,
    PositionLogprobs,
    Ready,
    RequestOutput,
    SlotStats,
    StageTimes,
    WindowStats,
    check_request,
)
from app.engine.runner import Launched, ModelRunner
from app.engine.sampler import Sampler
from app.engine.scheduler import Phase, Request, Scheduler, SchedulerConfig, Window, placeholder
from app.engine.split import StagePipeline, split_layers, stages_for
from app.errors import StrataError
from app.kernels import kv_quant
from app.kernels.backends import select_backends
from app.kernels.interface import CHUNK
from app.loading import progress
from app.loading.checkpoint import open_checkpoint
from app.loading.identity import model_identity
from app.loading.loader import experts_within, resolve_dtype, weight_elements
from app.loading.model import LoadedModel, open_model
from app.models.config import LINEAR_ATTENTION
from app.models.expert_tier import RoutedBefore, TieredExperts, decoder_tiers, use_staging
from app.models.placement import PLACEMENTS, spare_slots
from app.models.qwen3 import ModelPart
from app.text.stream import TextStream

HOST_KV_SHARE = 0.8  # the most of the host's available RAM the KV blocks beyond --kv-resident may take
PLACE_BYTES = 64 << 20  # KV bytes a window may copy to move its requests' blocks from host RAM to the device
log = logging.getLogger("strata.engine")
CHECKPOINTS_PER_SLOT = 1  # recurrent-state checkpoints kept for the prefix cache, per batch slot
READ_WAIT_S = 0.01  # how long an engine with nothing to run waits for a parked file before the next window


def resolve_device(name: str) -> str:
    """cpu, cuda, or for auto the GPU when there is one; cuda without a GPU is an error."""
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name == "cuda" and not available:
        raise StrataError("--device cuda: no CUDA device is available")
    return name


NO_DRAFT_SLOTS = (
    "this model's recurrent state needs room to roll drafts back: start the engine with --spec to draft"
)


@dataclass
class _Flight:
    """A window launched on the device: the output index of each placeholder it fills (in the order of its
    sampling rows), when planning it began (perf_counter) and when it was launched (wall clock)."""

    window: Window
    launched: Launched | None
    indices: list[int]
    began: float
    started: float
    wait_s: float = 0.0  # how long reading its tokens waited for the device
    stages: list[StageTimes] | None = None  # on a layer split: each stage's times for it
    slots: list[tuple[Request, SlotStats]] = field(default_factory=list)  # as the window left them
    drafts: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, guesses, accepted) a chunk
    guessed: GuessSource | None = None  # the head's guesses on the device when it was launched

    @property
    def replayed(self) -> bool:
        return self.launched is not None and self.launched.replayed


@dataclass(frozen=True)
class _Drawn:
    """A token read back: the request's generated token number `index`, and its logprobs if asked for."""

    request: Request
    index: int
    logprobs: PositionLogprobs | None


class EngineCore:
    """The engine's loop body: owns the model, the scheduler and each request's text stream."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Load `config.model` (or use `loaded`, a model already built with `self.backends`'s kernels), then
        build the state, the window graphs, the park, the runner and the scheduler, in that order."""
        self.config = config
        self.device = resolve_device(config.device)
        self.backends = select_backends(config.backend, self.device, exact=config.exact)
        log.info("backends: %s on %s", self.backends.name, self.device)
        if config.adapt_every < 0:
            raise StrataError(f"--adapt-every must be 0 (frozen) or more windows, not {config.adapt_every}")
        if config.pcie_frac is not None and not 0 <= config.pcie_frac <= 1:
            raise StrataError(f"--pcie-frac must be a share between 0 and 1, not {config.pcie_frac}")
        if config.expert_cache is not None and config.expert_cache < 0:
            raise StrataError(
                f"--expert-cache must be 0 or more experts per layer, not {config.expert_cache}"
            )
        if config.expert_placement not in PLACEMENTS:
            raise StrataError(f"--expert-placement must be one of {', '.join(PLACEMENTS)}")
        if config.expert_cache is not None and config.expert_vram is not None:
            raise StrataError("give --expert-cache (experts a layer) or --expert-vram (bytes), not both")
        if config.expert_vram is not None and config.expert_vram < 0:
            raise StrataError(f"--expert-vram must be 0 or more bytes, not {config.expert_vram}")
        if config.kv_resident is not None and config.kv_resident < 0:
            raise StrataError(f"--kv-resident must be 0 or more tokens, not {config.kv_resident}")
        self.pipeline: StagePipeline | None = None
        if config.stage_gpus and config.layer_split is None:
            raise StrataError("--stage-gpus places the stages of a --layer-split")
        if config.layer_split is not None and loaded is not None:
            raise StrataError("--layer-split loads the model's parts in its stages: give a model path")
        if loaded is None:
            path = config.model or default_model_dir()
            parts = self._layer_split(Path(path))
            if parts is not None:
                self.pipeline = StagePipeline(config, Path(path), parts, self.device)
            resident = config.expert_cache
            if config.expert_vram is not None:
                part = parts[0] if parts is not None else None
                resident = experts_within(
                    path, config.dtype, config.expert_vram, self.device, part, self.backends
                )
                log.info(
                    "--expert-vram holds %s experts a layer",
                    "every one of the" if resident is None else resident,
                )
            loaded = open_model(
                path,
                config.dtype,
                self.device,
                progress=True,
                backends=self.backends,
                resident_experts=resident,
                spare_experts=spare_slots(resident or 0) if config.adapt_async else 0,
                part=parts[0] if parts is not None else None,
                placement=config.expert_placement,
            )
        self.loaded = loaded
        self.groups = self._batch_groups()
        model = loaded.model
        narrowed = self._dtype != torch.bfloat16
        kept = sum(p.numel() for p in model.parameters() if narrowed and p.dtype == torch.bfloat16)
        held = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8)  # bytes of GGUF blocks
        log.info(
            "weights in %s (--dtype %s)%s%s",
            str(self._dtype).removeprefix("torch."),
            config.dtype,
            f"; {kept / 1e6:.1f}M of them kept in bf16, as the checkpoint has them, for the kernels"
            if kept
            else "",
            f"; {held / 1e9:.2f} GB of weights held as the file's quantized blocks" if held else "",
        )
        positions = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > positions:
            raise StrataError(
                f"--max-model-len {config.max_model_len} is beyond this model's {positions} positions "
                "(its max_position_embeddings, which a rope_scaling such as yarn sets as the checkpoint says)"
            )
        self.max_model_len = config.max_model_len or positions
        self.recurrent = LINEAR_ATTENTION in model.config.layer_types
        if config.spec == "mtp" and model.mtp is None:
            raise StrataError("--spec mtp: this model has no MTP head (no mtp.* weights); try --spec ngram")
        self.tiers = [m for m in model.modules() if isinstance(m, TieredExperts)]
        on_device = device_kv_bytes(
            model.config, config.kv_memory, config.kv_resident, config.block_size, self.kv_dtype
        )
        costs = use_staging(
            self.tiers, config.pcie_frac, decoder_tiers(model), on_device, self.backends.tier_link
        )
        if costs is not None:
            # the host's torch work is small beside the CPU pool's; torch's own threads would only contend
            torch.set_num_threads(1)
            log.info(
                "expert tier: misses over PCIe at %.1f GB/s, on the CPU at %.1f GB/s + %.0f us per row "
                "+ %.0f us a call (%.0f us of an expert not shrunk by a split)",
                costs.pcie_bytes_s / 1e9,
                costs.cpu_bytes_s / 1e9,
                costs.cpu_row_s * 1e6,
                costs.cpu_call_s * 1e6,
                costs.cpu_fixed_s * 1e6,
            )
        staged = costs is not None
        if self.pipeline is not None:
            staged = self.pipeline.wait_loaded(model) or staged
        self.window_tokens = config.window_tokens(staged)  # a window's token budget
        self.launched = 0  # windows launched, for the expert tier's adaptation
        progress.stage("warming up: the KV pool, kernels and decode graphs")
        state = self._paged_state()
        log.info(
            "KV pool: %d blocks of %d tokens in %s (--kv-dtype %s)",
            state.blocks,
            config.block_size,
            str(state.keys.dtype).removeprefix("torch."),
            config.kv_dtype,
        )
        if state.stream is not None:
            log.info(
                "KV beyond VRAM: %d blocks on the device, %d in host RAM (%.2f GiB), streamed in",
                state.resident,
                state.blocks - state.resident,
                state.stream.host_bytes / GIB,
            )
        sizes = self._graph_sizes()
        if self.pipeline is not None:
            self.pipeline.set_up(state.blocks, len(state.checkpoint_slots), sizes, self.window_tokens)
        self.park = self._conversation_park(state)
        if self.park is not None:  # before the graphs are captured, which then count routing per slot too
            for tier in self.tiers:
                tier.keep_slot_heat(config.parallel + 1)
        graphs = self._window_graphs(state, sizes)
        self.runner = ModelRunner(model, state, Sampler(config.seed), graphs, self.park, self.pipeline)
        self.mtp = None
        if config.spec == "mtp":
            self.mtp = MtpDrafter(model, state, self._head_graphs(state, graphs))
        self.runner.warm_up(self.window_tokens)
        if self.park is not None:
            self.park.reserve_pinned()
        self.scheduler = Scheduler(self._scheduler_config(state, graphs), parked=self.park)
        self.runner.table_stamp = self.scheduler.pool.stamp_of
        if graphs is not None and self.pipeline is None:  # prompt windows priced before the first one runs
            self.scheduler.calibrate(graphs.time_mixed())
        self.streams: dict[str, TextStream] = {}
        self.windows = 0
        # windows launched and not yet handed out, oldest first: at most one beside the window being planned
        # (overlapped), none (--no-overlap), or one per other slot group on a layer split
        self._flights: deque[_Flight] = deque()
        self._guessed: GuessSource | None = None  # the head's latest guesses left on the device
        self._in_flight = (self.groups - 1) if self.pipeline is not None else int(config.overlap)
        self._emitted_at = 0.0  # when the last window's tokens were handed out (perf_counter)
        self.experts = ExpertReporter(model, self.tiers, self.device)  # this stage's layers
        self._experts_reported = time.monotonic()
        self._stage_reports: list[ExpertUsage] = []  # the other stages' reports not yet sent on
        self._stage_layers: dict[int, list[int]] = {}  # the other stages' layers: where their experts live

    @property
    def tiered(self) -> bool:
        """Whether the model's MoE layers have an expert tier (`--expert-cache`)."""
        return bool(self.tiers)

    @property
    def _dtype(self) -> torch.dtype:
        return self.loaded.model.model.embed_tokens.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (`--kv-dtype`, app/kernels/kv_quant.py)."""
        try:
            dtype = kv_quant.cache_dtype(self.config.kv_dtype, self._dtype)
            kv_quant.row_width(self.loaded.model.config.head_dim, dtype)
        except ValueError as exc:
            raise StrataError(str(exc)) from None
        return dtype

    def _layer_split(self, path: Path) -> list[ModelPart] | None:
        """The stages of `--layer-split` (None: the model runs whole here). `auto` splits over as few GPUs
        as hold the weights."""
        config = self.config
        if config.layer_split is None:
            return None
        checkpoint = open_checkpoint(path)
        spec = config.layer_split
        if spec == "auto":
            cards = [
                torch.cuda.get_device_properties(i).total_memory
                for i in range(torch.cuda.device_count() if self.device == "cuda" else 0)
            ]
            item = torch.empty((), dtype=resolve_dtype(config.dtype, checkpoint, self.device)).element_size()
            spec = str(stages_for(weight_elements(checkpoint) * item, cards))
        parts = split_layers(spec, checkpoint.config.num_hidden_layers)
        return parts if len(parts) > 1 else None

    def _batch_groups(self) -> int:
        """Slot groups (`--batch-groups`): by default one per stage of a layer split on GPUs, else one (on a
        CPU, stage 0's host work for twice the windows cost more than the stages' overlap gained: the demo
        model split in two on 2 cores, docs/PERFORMANCE.md)."""
        groups, stages = self.config.batch_groups, len(self.pipeline.parts) if self.pipeline else 1
        if groups is None:
            return min(stages, self.config.parallel) if self.device == "cuda" else 1
        if not 1 <= groups <= self.config.parallel:
            parallel = self.config.parallel
            raise StrataError(f"--batch-groups must be 1 to --parallel ({parallel}), not {groups}")
        if groups > 1 and self.pipeline is None:
            raise StrataError("--batch-groups pipelines the stages of a --layer-split; without one it is 1")
        return groups

    @property
    def _prefix_checkpoints(self) -> int:
        """State slots where the prefix cache keeps checkpoints (a model with recurrent state)."""
        config = self.config
        return CHECKPOINTS_PER_SLOT * config.parallel if self.recurrent and config.prefix_cache else 0

    @property
    def _draft_slots(self) -> int:
        """State slots where drafting slots keep the state after each verified row but the last
        (`--spec-tokens` a slot, with `--spec` on a model with recurrent state), after the prefix cache's."""
        config = self.config
        return config.parallel * config.spec_tokens if self.recurrent and config.spec != "off" else 0

    @property
    def _drafts_refused(self) -> str | None:
        """Why a request may not ask for drafts (a recurrent model without draft slots), or None."""
        return NO_DRAFT_SLOTS if self.recurrent and not self._draft_slots else None

    def _paged_state(self) -> PagedState:
        """The KV pool and slot state sized from `--kv-memory` (on each stage of a layer split, for its own
        layers): the recurrent state of every slot and checkpoint first, KV blocks with the rest (no more
        than every slot filled to the context uses, nor than the fullest stage holds)."""
        config, model_config, dtype = self.config, self.loaded.model.config, self._dtype
        kv_dtype = self.kv_dtype
        checkpoints = self._prefix_checkpoints + self._draft_slots
        blocks = config.parallel * -(-self.max_model_len // config.block_size)
        parts = self.pipeline.parts if self.pipeline is not None else [None]
        head = self._mtp_layers
        every_stage = 0  # bytes of a block across every stage
        for n, part in enumerate(parts):
            layers = part.layers if part is not None else None
            state_bytes = slot_state_bytes(model_config, dtype, layers) * (config.parallel + checkpoints)
            extra = len(head) if n == 0 else 0  # stage 0 holds the MTP head
            block_bytes = kv_block_bytes(model_config, config.block_size, kv_dtype, layers, extra)
            every_stage += block_bytes
            fits = (config.kv_memory - state_bytes) // block_bytes if block_bytes else blocks
            if fits < 1:
                raise StrataError(
                    f"--kv-memory {config.kv_memory} bytes is too small: {config.parallel} slots and "
                    f"{checkpoints} checkpoints of recurrent state take {state_bytes} and one KV block "
                    f"{block_bytes}"
                )
            blocks = min(blocks, fits)
        device = torch.device(self.device)
        return PagedState(
            model_config,
            blocks,
            config.block_size,
            config.parallel,
            dtype,
            device,
            checkpoints=checkpoints,
            layers=parts[0].layers if parts[0] is not None else None,
            extra_attention=head,
            kv_dtype=kv_dtype,
            resident=self._resident_blocks(blocks, every_stage),
        )

    @property
    def _block_bytes(self) -> int:
        """The bytes of one KV block across every attention layer of the model (of every stage)."""
        config = self.loaded.model.config
        return kv_block_bytes(config, self.config.block_size, self.kv_dtype, extra=len(self._mtp_layers))

    def _resident_blocks(self, blocks: int, block_bytes: int) -> int | None:
        """The blocks of a pool of `blocks` that `--kv-resident` keeps on the device (None: all; on a layer
        split, on each stage's); those beyond, of `block_bytes` (every stage's layers), must fit in the host's
        available RAM."""
        tokens = self.config.kv_resident
        resident = resident_blocks(tokens, self.config.block_size)
        if resident is None or resident >= blocks:
            return None
        host = (blocks - resident) * block_bytes
        available = psutil.virtual_memory().available
        if host > available * HOST_KV_SHARE:
            raise StrataError(
                f"--kv-resident {tokens}: the {blocks - resident} KV blocks beyond it take "
                f"{host / GIB:.1f} GiB of host RAM, more than {HOST_KV_SHARE:.0%} of the "
                f"{available / GIB:.1f} GiB available; "
                "give a smaller --kv-memory or a larger --kv-resident"
            )
        return resident

    @property
    def _mtp_layers(self) -> tuple[int, ...]:
        """The layer numbers of the MTP head's layers when it drafts (`--spec mtp`), after the decoder's."""
        head = self.loaded.model.mtp
        if self.config.spec != "mtp" or head is None:
            return ()
        first = self.loaded.model.config.num_hidden_layers
        return tuple(range(first, first + len(head.layers)))

    def _graphs_wanted(self) -> bool:
        """Whether windows replay captured graphs: on a GPU with whole-batch kernels, unless
        `--enforce-eager`."""
        paged = self.backends.paged_attention is not None
        return self.device == "cuda" and paged and not self.config.enforce_eager

    def _graph_sizes(self) -> GraphSizes | None:
        """What the window graphs (every stage's, on a layer split) are sized for, or None without them."""
        if not self._graphs_wanted():
            return None
        config = self.config
        max_blocks = -(-self.max_model_len // config.block_size)
        # a prompt piece may pass the token budget to reach its next chunk multiple (scheduler.py)
        max_tokens = self.window_tokens + (CHUNK if self.recurrent else 0)
        drafts = config.parallel * config.spec_tokens if config.spec != "off" else 0
        return GraphSizes(config.parallel, max_blocks, max_tokens, drafts)

    def _window_graphs(self, state: PagedState, sizes: GraphSizes | None) -> WindowGraphs | None:
        """The window graphs for `sizes` (with an expert tier: decode windows only, captured piecewise around
        each layer's misses); on a layer split stage 0's (`StageGraphs`), each worker capturing its own.
        Captured on a GPU; without one (tests) windows run their forward over the static inputs."""
        if sizes is None:
            return None
        model = self.loaded.model
        graphs: WindowGraphs
        if self.pipeline is not None:
            graphs = StageGraphs(model, state, sizes, self.pipeline.part, self._dtype)
        else:
            keep = self.config.spec == "mtp"
            graphs = WindowGraphs(
                model, state, sizes.slots, sizes.max_blocks, sizes.max_tokens, keep, sizes.draft_rows
            )
        if state.device.type == "cuda":
            graphs.capture()
        return graphs

    def _head_graphs(self, state: PagedState, graphs: WindowGraphs | None) -> HeadGraphs | None:
        """The MTP head's pass captured for windows of verified rows, where windows replay graphs (an expert
        tier's windows are captured piecewise, and a pool partly in host RAM streams blocks in: their head
        passes run eagerly)."""
        config = self.config
        if graphs is None or graphs.tiers or config.spec_tokens < 1 or state.stream is not None:
            return None
        max_blocks = -(-self.max_model_len // config.block_size)
        head = HeadGraphs(self.loaded.model, state, config.parallel, config.spec_tokens, max_blocks)
        head.capture()
        return head

    def _conversation_park(self, state: PagedState) -> ConversationPark | None:
        """The park of finished conversations, when the prefix cache is on and RAM or disk is given to it (on
        a layer split RAM only: stage 0's, whose changes the other stages' parks make too)."""
        config = self.config
        has_room = config.park_memory > 0 or (config.park_dir and config.park_disk > 0)
        if not config.prefix_cache or not has_room:
            return None
        identity = f"{model_identity(self.loaded.checkpoint.path)}:{self._dtype}"
        if self.pipeline is None:
            directory = Path(config.park_dir) if config.park_dir else None
            return ConversationPark(state, identity, config.park_memory, directory, config.park_disk)
        # every stage parks its own part (parking.py), in its own folder where all stages are on this host
        parts, kv_dtype = self.pipeline.parts, state.keys.dtype
        directory = stage_directory(config, 0, len(parts))
        if directory is None and config.park_memory <= 0:
            return None
        counts = [layer_counts(self.loaded.model.config, part.layers) for part in parts]
        peers = tuple(
            (folder, stage_identity(identity, part.layers, *counts[stage], kv_dtype))
            for stage, part in enumerate(parts[1:], start=1)
            if (folder := stage_directory(config, stage, len(parts))) is not None
        )
        layers = parts[0].layers
        own = stage_identity(identity, layers, state.keys.shape[0], state.conv.shape[0], kv_dtype)
        park = ConversationPark(state, own, config.park_memory, directory, config.park_disk, peers=peers)
        park.mirror = []
        return park

    def _scheduler_config(self, state: PagedState, graphs: WindowGraphs | None) -> SchedulerConfig:
        config = self.config
        return SchedulerConfig(
            parallel=config.parallel,
            max_batched_tokens=self.window_tokens,
            block_size=config.block_size,
            kv_blocks=state.blocks,
            decode_share=config.decode_share,
            prompt_align=CHUNK if self.recurrent else 1,
            prefix_cache=config.prefix_cache,
            checkpoint_slots=state.checkpoint_slots[: self._prefix_checkpoints],
            draft_slots=state.checkpoint_slots[self._prefix_checkpoints :],
            recurrent=self.recurrent,
            window_rows=graphs.mixed_rows if graphs is not None else (),
            groups=self.groups,
            spec_tokens=config.spec_tokens if config.spec != "off" else 0,
            max_length=self.max_model_len,
            kv_on_device=state.resident,
            kv_place_blocks=max(1, PLACE_BYTES // max(1, self._block_bytes)),
        )

    def close(self) -> None:
        """Finish what must outlive the process: parked conversations still being written to disk."""
        if self.park is not None:
            self.park.flush()
        if self.pipeline is not None:  # the other stages make the park's last changes before they stop
            self.pipeline.close(self.park.take_mirror() if self.park is not None else [])

    def ready(self) -> Ready:
        """What clients need to know before sending requests."""
        return Ready(
            model=self.loaded.name,
            model_path=str(self.loaded.checkpoint.path),
            max_model_len=self.max_model_len,
            vocab_size=self.loaded.model.config.vocab_size,
            parallel=self.config.parallel,
            kv_blocks_total=self.scheduler.pool.total,
            block_size=self.config.block_size,
            eos_token_ids=list(self.loaded.eos_token_ids),
            backends=self.backends.name,
            device=self.device,
            dtype=str(self._dtype).removeprefix("torch."),
            prefix_cache=self.config.prefix_cache,
            drafts=self._drafts_refused,
            window_tokens=self.window_tokens,
        )

    def add_request(self, add: AddRequest) -> list[RequestOutput]:
        """Queue a request, or answer at once with an error output when it can never run."""
        try:
            self._check(add)
        except StrataError as e:
            return [RequestOutput(add.request_id, finished=True, finish_reason="error", error=str(e))]
        params = add.params
        request = Request(add.request_id, list(add.prompt_token_ids), params, add.arrival_time)
        if self.mtp is not None and self.scheduler.spec_tokens(request) > 0 and params.grammar is None:
            request.drafter = MtpGuesses()
        if params.grammar is not None:
            try:
                request.matcher = self._grammars().matcher(params.grammar)
            except StrataError as e:
                return [RequestOutput(add.request_id, finished=True, finish_reason="error", error=str(e))]
        self.scheduler.add(request)
        self.streams[add.request_id] = TextStream(
            self.loaded.tokenizer,
            add.prompt_token_ids,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop=params.include_stop_str_in_output,
        )
        return []

    def _check(self, add: AddRequest) -> None:
        prompt = check_request(
            add.prompt_token_ids, add.params, self.loaded.model.config.vocab_size, self.max_model_len
        )
        needed = len(prompt) + add.params.max_tokens
        if needed > self.scheduler.capacity_tokens():
            raise StrataError(
                f"prompt + max_tokens ({needed} tokens) exceeds the KV pool's "
                f"{self.scheduler.capacity_tokens()} tokens (raise --kv-memory)"
            )
        if add.request_id in self.streams:
            raise StrataError(f"request id {add.request_id} is already in use")
        if add.params.spec_tokens and self._drafts_refused is not None:
            raise StrataError(self._drafts_refused)

    def _grammars(self) -> Grammars:
        """The engine's grammar tokenizer (built at the first request with a grammar)."""
        if self.runner.grammars is None:
            self.runner.grammars = Grammars(
                self.loaded.tokenizer.to_json(),
                self.loaded.model.config.vocab_size,
                self.loaded.eos_token_ids,
            )
        return self.runner.grammars

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End a request now (what it read and generated is parked); its slot and blocks are free."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return []
        while request.output and request.output[-1] < 0:
            request.output.pop()  # being drawn: never read
        self._park(request)
        self.scheduler.finish(request, "abort")
        self.streams.pop(request_id, None)
        return [self._final(request, RequestOutput(request_id))]

    def has_work(self) -> bool:
        """Any request running or waiting, or a window whose tokens are not handed out yet."""
        return self.scheduler.has_work() or bool(self._flights)

    def _busy_groups(self) -> frozenset[int]:
        """The slot groups with a window in flight (pipelined groups on a layer split; none otherwise, where
        the next window feeds the tokens the one in flight draws)."""
        if self.pipeline is None:
            return frozenset()
        return frozenset(self.scheduler.group_of(c.slot) for f in self._flights for c in f.window.chunks)

    def step(self) -> tuple[list[RequestOutput], WindowStats | None]:
        """Plan and launch one window, and hand out the tokens of the one before it (overlapped), or of this
        one (`overlap` off). The stats describe the window whose tokens were handed out; None when none was.

        Overlapped, the host plans window N+1 and queues it while the device runs window N; N+1 feeds the
        tokens N draws straight from the device, and a request that N ends runs one row more, never read.
        What a window cost (for the window-cost fit and the decoding slots' share) is the time from one
        window's tokens to the next's on a GPU; on a CPU, where a window is computed as it is launched, the
        time to plan and launch it (overlapped, the step that hands out a window's tokens computes the next).
        """
        began = time.perf_counter()
        flights = self._flights
        done: _Flight | None = None
        resolved: list[_Drawn] = []
        if flights and self.pipeline is None and self._drafting():
            # drafts are guessed from a request's tokens: all of them read (on a layer split the next window
            # is another slot group's, whose last one was handed out before it was planned)
            done = flights.popleft()
            resolved = self._resolve(done)
        # the MTP head's pass over a window still in flight writes its requests' blocks once it is read
        place = not (flights and self.mtp is not None)
        window = self.scheduler.schedule(self._busy_groups(), place=place)
        if done is None and flights and self._needs_history(window):
            done = flights.popleft()
            resolved = self._resolve(done)  # its penalties read them
        if not window.chunks and done is None and not flights and self.park is not None:
            self.park.wait_reads(READ_WAIT_S)  # a request waits for its parked file: do not spin
        flight = self._launch(window, began)
        computed = time.perf_counter() - began  # on a CPU the window was computed in its launch
        if window.chunks:
            flights.append(flight)
        if flight.launched is not None and flight.launched.pending is not None:
            if done is None and len(flights) > 1:  # the masks follow the tokens the window before draws
                done = flights.popleft()
                resolved = self._resolve(done)
            self.runner.sample_pending(flight.launched)
        if done is None and (len(flights) > self._in_flight or (flights and not window.chunks)):
            done = flights.popleft()
            resolved = self._resolve(done)
        elif done is None and not window.chunks:
            done = flight
        self.scheduler.advance(window)
        synchronous = self.device == "cpu" and self.pipeline is None
        if synchronous and window.chunks:
            self.scheduler.observe(window, computed)
        fed = {c.request.request_id: len(c.tokens) for c in window.chunks}
        flight.slots = [(r, self._slot_stats(r, fed.get(r.request_id, 0))) for r in self.scheduler.running]
        outputs = [self._emit(d) for d in resolved if d.request.phase is not Phase.FINISHED]
        if done is None:
            return outputs, None
        now = time.perf_counter()
        span = now - max(done.began, self._emitted_at)  # what the window cost the slots that waited for it
        self._emitted_at = now
        if done.window.chunks and not synchronous:  # an empty window says nothing about what windows cost
            self.scheduler.observe(done.window, span, replayed=done.replayed)
        self.windows += 1
        vram_reads, host_reads = self.runner.state.take_reads()
        stats = WindowStats(
            window=self.windows,
            started=done.started,
            duration_s=span,
            rows=sum(len(c.tokens) for c in done.window.chunks),
            prompt_tokens=done.window.prompt_tokens,
            decode_tokens=done.window.decode_tokens,
            slots=[slot for r, slot in done.slots if r.phase is not Phase.FINISHED],
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.scheduler.pool.used,
            kv_blocks_total=self.scheduler.pool.total,
            prefix_cache_queries=done.window.cache_queries,
            prefix_cache_hits=done.window.cache_hits,
            parking=self.park.stats() if self.park is not None else None,
            finished=sum(o.finished for o in outputs),
            preempted=done.window.preempted,
            experts=self._expert_usage(idle=not self.has_work()),
            step_s=span,
            host_s=span - done.wait_s,
            stages=done.stages,
            drafts=done.drafts,
            kv_vram_reads=vram_reads,
            kv_host_reads=host_reads,
            kv_moved_to_device=done.window.moved[0],
            kv_moved_to_host=done.window.moved[1],
            replayed=done.replayed,
            charged_s=done.window.charged,
            cost_s=done.window.observed,
        )
        return outputs, stats

    def _launch(self, window: Window, began: float) -> _Flight:
        """Queue the window on the device; each request it samples for gets a placeholder token meanwhile."""
        started = time.time()
        for tier in self.tiers:
            tier.land()
        if self.config.adapt_every:  # a resumed conversation brings back the experts it routed to
            for parked, _, _ in window.unparks:
                self._bring_back(getattr(parked, "routed", None))
        launched = self.runner.launch(window) if window.chunks else None
        if launched is not None:
            self.launched += 1
            if self.config.adapt_every and self.launched % self.config.adapt_every == 0:
                self.experts.swaps += sum(tier.adapt() for tier in self.tiers)
        indices = []
        for row, chunk in enumerate(launched.sampling if launched is not None else []):
            chunk.request.output.append(placeholder(row))
            indices.append(len(chunk.request.output) - 1)
        return _Flight(window, launched, indices, began, started, guessed=self._guessed)

    def _resolve(self, flight: _Flight) -> list[_Drawn]:
        """Wait for a flight's tokens and put them in place of its placeholders (requests that ended since
        it was launched take none)."""
        if flight.launched is None:
            return []
        sampled = self.runner.collect(flight.launched)
        flight.wait_s, flight.stages = self.runner.last_wait_s, self.runner.last_stages
        self._stage_reports += self.runner.last_reports
        resolved = []
        taken_of: dict[int, int] = {}  # drafts accepted, by id of the chunk
        row = 0
        while row < len(sampled):
            chunk = sampled[row].chunk
            rows = list(zip(sampled[row : row + chunk.sampled_rows], flight.indices[row:], strict=False))
            row += chunk.sampled_rows
            request = chunk.request
            if request.phase is Phase.FINISHED:
                continue
            if chunk.drafts:
                guesses = self._guess_values(chunk.tokens[len(chunk.tokens) - chunk.drafts :], flight)
                taken = accepted(guesses, [s.token_id for s, _ in rows])
                taken_of[id(chunk)] = taken
                self.scheduler.accept(chunk, taken)
                flight.drafts.append((chunk.slot, chunk.drafts, taken))
                del request.output[rows[taken][1] + 1 :]  # rows after a miss drew for guesses now void
                rows = rows[: taken + 1]
            for s, index in rows:
                request.output[index] = s.token_id
                if request.matcher is not None:
                    Grammars.advance(request.matcher, s.token_id)
                resolved.append(_Drawn(request, index, s.logprobs))
        if flight.launched.kept is not None:
            self._guess(flight.launched, taken_of)
        return resolved

    @staticmethod
    def _guess_values(guesses: list[int], flight: _Flight) -> list[int]:
        """A chunk's draft tokens, its guess placeholders replaced by the guesses they stood for when the
        flight was launched."""
        values = []
        for token in guesses:
            index = guess_index(token)
            if index is not None:
                assert flight.guessed is not None, "a guess placeholder with no guesses on the device"
                token = flight.guessed.value(index)
            values.append(token)
        return values

    def _guess(self, launched: Launched, taken_of: dict[int, int]) -> None:
        """The MTP head reads a window's rows of the requests it drafts for, now that the token after each
        is known, and guesses the tokens after each one's newest (`MtpGuesses.offer`). Its captured pass
        leaves them on the device for the next window to feed, unless a request's sampling reads its
        draft tokens on the host (penalties) or a layer split sends windows down its stages."""
        assert self.mtp is not None and launched.kept is not None
        spans, guessed = [], []
        size, start = self.config.block_size, 0
        for chunk in launched.kept_chunks:
            request, rows = chunk.request, range(start, start + len(chunk.tokens))
            start += len(chunk.tokens)
            if request.phase not in (Phase.PROMPT, Phase.DECODE) or request.slot != chunk.slot:
                continue  # ended, or preempted since
            valid = len(chunk.tokens) - chunk.drafts + taken_of.get(id(chunk), 0)
            nexts = request.token_slice(chunk.past + 1, chunk.past + valid + 1)
            if len(nexts) < valid or min(nexts, default=0) < 0:
                continue  # the token after its last row is not known: nothing for the head to read
            last = chunk.past + valid - 1
            guesses = self.scheduler.spec_tokens(request) if chunk.samples else 0
            if guesses and not self.scheduler.pool.grow(request.blocks, last + guesses):
                guesses = min(guesses, len(request.blocks) * size - last)
            if len(request.blocks) * size <= last:
                continue
            spans.append(MtpSpan(chunk.slot, chunk.past, list(rows[:valid]), nexts, request.blocks, guesses))
            guessed.append(request)
        on_device = self.pipeline is None and not any(r.params.penalised for r in guessed)
        guesses_of, source = self.mtp.guess(launched.kept, spans, on_device)
        if source is not None:
            self._guessed = source
            self.runner.guesses = source.flat
        for request, guesses in zip(guessed, guesses_of, strict=True):
            if guesses:
                assert isinstance(request.drafter, MtpGuesses)
                request.drafter.offer(request.length, guesses, source)

    def _drafting(self) -> bool:
        """Whether a decoding request drafts (`--spec`, or its own `spec_tokens`)."""
        return any(
            self.scheduler.spec_tokens(r) > 0
            for r in self.scheduler.running
            if r.phase is Phase.DECODE and r.params.grammar is None
        )

    def _needs_history(self, window: Window) -> bool:
        """Whether a row the window samples for applies penalties to a generated token not yet read, or (on
        a layer split, whose windows draw their tokens as they come back) follows a grammar that has not
        seen it; elsewhere a grammar's row waits for its masks after its forward pass is queued."""
        grammar_waits = self.pipeline is not None
        return any(
            c.samples
            and (c.request.params.penalised or (grammar_waits and c.request.matcher is not None))
            and c.request.output
            and c.request.output[-1] < 0
            for c in window.chunks
        )

    def _expert_usage(self, idle: bool = False) -> ExpertUsage | None:
        """Routing counts since the last report, at most every EXPERT_REPORT_S seconds (one device sync),
        and whenever the engine falls idle (so a burst's counts are all reported when it ends); on a layer
        split with the other stages' latest reports joined in (theirs come on their own period)."""
        now = time.monotonic()
        if not self.experts.layers or (now - self._experts_reported < EXPERT_REPORT_S and not idle):
            return None
        seconds, self._experts_reported = now - self._experts_reported, now
        usage = self.experts.take(seconds)
        assert usage is not None
        if self.pipeline is None:
            return usage
        others, self._stage_reports = self._stage_reports, []
        return joined(usage, others, self._stage_layers)

    @property
    def expert_swaps(self) -> int:
        """Experts the tiers moved onto the device since the last expert report (stage 0's)."""
        return self.experts.swaps

    def _emit(self, drawn: _Drawn) -> RequestOutput:
        """The output of one drawn token; ends its request when the token is its last."""
        request, index = drawn.request, drawn.index
        token = request.output[index]
        stream = self.streams[request.request_id]
        output = RequestOutput(request.request_id, token_ids=[token], text=stream.add([token]))
        if drawn.logprobs is not None:
            output.logprobs = [drawn.logprobs]
        reason = self._finish_reason(request, index, token, stream)
        if reason is None:
            return output
        if not stream.stopped:
            output.text += stream.finish()
        # a token a later window is drawing (or drew as a draft) is never read
        del request.output[index + 1 :]
        self.scheduler.cut(request)
        self._park(request)
        self.scheduler.finish(request, reason)
        del self.streams[request.request_id]
        return self._final(request, output)

    def _finish_reason(self, request: Request, index: int, token: int, stream: TextStream) -> str | None:
        """Why the request ends at its generated token number `index` (from 0), or None."""
        params = request.params
        if stream.stopped or token in params.stop_token_ids:
            return "stop"
        if request.matcher is not None and Grammars.complete(request.matcher):
            return "stop"  # the grammar's output is whole
        if token in self.loaded.eos_token_ids and not params.ignore_eos:
            return "stop"
        if index + 1 >= params.max_tokens or len(request.prompt) + index + 1 >= self.max_model_len:
            return "length"
        return None

    def _park(self, request: Request) -> None:
        """Park what a request that is ending holds (the state of its first `computed` tokens) and, with an
        expert tier, the experts it routed to (its slot's counts, cleared for the next request)."""
        slot = self.scheduler.state_slot(request)
        routed = None
        if self.tiers and self.tiers[0].slot_heat is not None and request.slot is not None:
            routed = RoutedBefore.take(self.tiers, request.slot)
        if self.park is not None and slot is not None and request.computed > 0:
            self.park.park(request.tokens[: request.computed], request.blocks, slot, routed)

    def _bring_back(self, routed: object) -> None:
        """Make the experts a parked conversation routed to most resident again before its first window (an
        adapting tier only: a frozen one stays as it is)."""
        if not isinstance(routed, RoutedBefore):
            return
        for tier, hot in zip(self.tiers, routed.hot(), strict=True):
            self.experts.swaps += tier.bring(hot)

    @staticmethod
    def _final(request: Request, output: RequestOutput) -> RequestOutput:
        output.finished = True
        output.finish_reason = request.finish_reason
        output.prompt_tokens = len(request.prompt)
        output.output_tokens = len(request.output)
        return output

    @staticmethod
    def _slot_stats(request: Request, fed: int) -> SlotStats:
        return SlotStats(
            slot=request.slot,
            request_id=request.request_id,
            phase="decode" if request.phase is Phase.DECODE else "prompt",
            prompt_tokens=min(request.computed, len(request.prompt)),
            prompt_total=len(request.prompt),
            output_tokens=len(request.output),
            context_tokens=request.computed,
            window_tokens=fed,
            grammar=request.params.grammar is not None,
        )
