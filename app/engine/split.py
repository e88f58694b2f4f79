"""The layer split: the model's decoder layers cut into stages, one process each, over torch.distributed.

The engine process is stage 0: it holds the scheduler, the embedding, the LM head and its own first layers,
and samples. Stage workers 1..N-1 (`stage_worker.py`, spawned here, or started on other hosts with `strata
stage`) each hold their layers and their share of the paged state. A window travels down the stages as one
message (`StageWork`: the spans, block tables and state copies every stage applies to its own state)
followed by the residual stream and the last layer's output; the last stage norms the rows that sample and
sends their final hidden states back to stage 0. Objects go over gloo, tensors over the default group (NCCL
between GPUs, gloo on a CPU), so the same code runs on the cards of one host or on one CPU (`--device cpu
--layer-split 2`, the tests' case).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from app.engine.config import EngineConfig
from app.engine.cuda_graphs import Bucket, GraphSizes
from app.engine.paged_state import StateCopies
from app.engine.park_index import ParkKey
from app.engine.parking import Forgotten, Kept, Unlinked
from app.engine.protocol import ExpertUsage, StageTimes
from app.errors import StrataError
from app.kernels.cpu_experts import threads
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM, ModelPart

log = logging.getLogger("strata.engine")
TIMEOUT = timedelta(minutes=30)  # how long a stage waits for its peer (a long prompt's window included)
OBJECT_BYTES = 8192  # the first message of an object between stages: its length and its start
CARD_SHARE = 0.85  # `auto`: the share of a card's memory the weights may take before the model is split


def split_layers(spec: str, layers: int) -> list[ModelPart]:
    """The stages of `--layer-split`: a stage count ("2": layers as even as they go, the later stages taking
    the odd ones, since the first also holds the embedding and LM head) or each stage's layer count
    ("20,28", adding up to the model's layers)."""
    counts: list[int]
    try:
        numbers = [int(n) for n in spec.split(",")]
    except ValueError:
        raise StrataError(
            f"--layer-split {spec}: give auto, a stage count or each stage's layers (e.g. 20,28)"
        ) from None
    if len(numbers) == 1:
        stages = numbers[0]
        if not 1 <= stages <= layers:
            raise StrataError(f"--layer-split {spec}: the model has {layers} layers, so 1 to {layers} stages")
        base, odd = divmod(layers, stages)
        counts = [base + (i >= stages - odd) for i in range(stages)]
    else:
        counts = numbers
        if min(counts) < 1 or sum(counts) != layers:
            raise StrataError(
                f"--layer-split {spec}: each stage needs a layer and together the model's {layers}"
            )
    parts, start = [], 0
    for i, count in enumerate(counts):
        parts.append(ModelPart(range(start, start + count), first=i == 0, last=i == len(counts) - 1))
        start += count
    return parts


def stages_for(weight_bytes: int, cards: list[int]) -> int:
    """`--layer-split auto`: the fewest of the cards (their memory in bytes, in order) whose memory holds
    the weights at CARD_SHARE each, or all of them; one stage on a CPU (no cards)."""
    for stages in range(1, len(cards) + 1):
        if weight_bytes <= CARD_SHARE * sum(cards[:stages]):
            return stages
    return max(1, len(cards))


Unpark = tuple[ParkKey, list[int], int, list[int]]  # a conversation restored: key, tokens, slot, block table


@dataclass(frozen=True)
class StageStart:
    """Sent to every worker once the stages have met: the engine's settings (the model path among them) and
    the stages' parts."""

    config: bytes
    parts: list[ModelPart]
    threads: int | None  # on a CPU: the threads this stage computes with


@dataclass(frozen=True)
class StageSetup:
    """Sent to every worker once stage 0 has sized the paged state: the KV blocks and checkpoint slots, the
    sizes of the window graphs every stage captures (None: windows run eagerly), and a window's token
    budget."""

    blocks: int
    checkpoints: int
    graphs: GraphSizes | None = None
    window_tokens: int = 0


@dataclass(frozen=True)
class StageLoaded:
    """A worker's answer once its part is loaded: None, or why it could not be; whether its expert tier has
    a staging area for copies over PCIe (`EngineConfig.window_tokens`)."""

    error: str | None = None
    staged: bool = False


@dataclass(frozen=True)
class StageAnswer:
    """The last stage's answer to a window: each worker's (busy, wait) seconds for it, in stage order; the
    final hidden states of the rows that sample follow when there are any."""

    stages: list[tuple[float, float]]
    experts: list[ExpertUsage] = field(default_factory=list)  # the workers' routing reports, if any are due


@dataclass
class StageWork:
    """One window for the stages after the first: each chunk's (slot, rows, past), the checkpoints spans
    leave (slot -> (position, checkpoint slot)), the chunks' block tables that changed since stage 0 last
    sent them (each stage keeps every slot's latest: a long conversation's table is not sent every window),
    the state copies before the
    forward, the rows whose final hidden states the last stage sends back, and the slots whose rows the
    recurrent layers read one at a time, to their row saves (`SequenceSpan.stepwise`); with parking, the
    changes stage 0's park made since the last window (before the copies) and the conversations it restores
    in this one (`Unpark`s, after them); the window graphs' bucket stage 0 replayed (None: it ran eagerly),
    which a stage replays too where it holds it. `stop` ends the workers."""

    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)
    copies: StateCopies = field(default_factory=StateCopies)
    rows: list[int] = field(default_factory=list)
    stepwise: dict[int, tuple[int, ...]] = field(default_factory=dict)
    parks: list[Kept | Forgotten | Unlinked] = field(default_factory=list)
    unparks: list[Unpark] = field(default_factory=list)
    bucket: Bucket | None = None
    stop: bool = False
    stages: list[tuple[float, float]] = field(default_factory=list)  # (busy, wait) of the workers so far
    experts: list[ExpertUsage] = field(default_factory=list)  # routing reports of the workers so far

    @property
    def tokens(self) -> int:
        return sum(rows for _, rows, _ in self.chunks)


class StageLink:
    """Messages between the stages: pickled objects over gloo, tensors over the default group (NCCL between
    GPUs; with `through_host`, where stages share a card, gloo from host memory).

    Sends do not wait for their receiver (a gloo send of a tensor waits until the peer posts its receive):
    stage 0 sends the next group's window while the last stage sends it the answer of the one before, and
    blocking sends would wait for each other round the ring of stages. Each send's buffers are kept until
    it has completed.
    """

    def __init__(self, device: torch.device, through_host: bool = False) -> None:
        self.device = device
        self.through_host = through_host and device.type == "cuda"
        nccl = default_backend(device, through_host) == "nccl"
        self.objects = dist.new_group(backend="gloo") if nccl else None
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, tensor: torch.Tensor, to: int, group: dist.ProcessGroup | None = None) -> None:
        self._sending = [(work, t) for work, t in self._sending if not work.is_completed()]
        work = dist.isend(tensor, to, group=group)
        assert work is not None
        self._sending.append((work, tensor))

    def flush(self) -> None:
        """Wait until every message sent has been received."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()

    def send_object(self, value: object, to: int) -> None:
        """One message of OBJECT_BYTES: the pickled object's length and as much of it as fits; the rest, if
        any, in a second message."""
        data = pickle.dumps(value)
        head = bytearray(OBJECT_BYTES)
        head[:8] = len(data).to_bytes(8, "little")
        first = min(len(data), OBJECT_BYTES - 8)
        head[8 : 8 + first] = data[:first]
        self._send(torch.frombuffer(head, dtype=torch.uint8), to, self.objects)
        if first < len(data):
            self._send(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), to, self.objects)

    def recv_object(self, source: int) -> object:
        head = torch.empty(OBJECT_BYTES, dtype=torch.uint8)
        dist.recv(head, source, group=self.objects)
        raw = head.numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        data = raw[8 : 8 + size]
        if size > OBJECT_BYTES - 8:
            rest = torch.empty(size - (OBJECT_BYTES - 8), dtype=torch.uint8)
            dist.recv(rest, source, group=self.objects)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def send_tensors(self, tensors: list[torch.Tensor], to: int) -> None:
        for tensor in tensors:
            self._send(tensor.cpu() if self.through_host else tensor.contiguous(), to)

    def recv_tensors(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, source: int
    ) -> list[torch.Tensor]:
        where = "cpu" if self.through_host else self.device
        tensors = [torch.empty(shape, dtype=dtype, device=where) for shape in shapes]
        for tensor in tensors:
            dist.recv(tensor, source)
        return [tensor.to(self.device) for tensor in tensors] if self.through_host else tensors


class BusyClock:
    """The seconds a stage worked on each window, oldest first: host time on a CPU; on a GPU the time
    between two CUDA events queued around the window's work, read once they have completed, so that timing a
    window never waits for the device (a window whose events are not done yet counts with a later one)."""

    Mark = float | torch.cuda.Event

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: deque[tuple[BusyClock.Mark, BusyClock.Mark]] = deque()
        self._unread: list[tuple[BusyClock.Mark, BusyClock.Mark]] = []

    def mark(self) -> Mark:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, start: Mark) -> None:
        """A window's work from `start` to now."""
        self._spans.append((start, self.mark()))

    def oldest(self) -> float:
        """The seconds of the oldest window not yet read, with those of earlier ones that have completed
        since."""
        self._unread.append(self._spans.popleft())
        seconds, still = 0.0, []
        for start, end in self._unread:
            if isinstance(start, float) and isinstance(end, float):
                seconds += end - start
            elif isinstance(end, torch.cuda.Event) and end.query():
                seconds += start.elapsed_time(end) / 1000  # type: ignore[union-attr]
            else:
                still.append((start, end))
        self._unread = still
        return seconds


def thread_shares(stages: int) -> list[int]:
    """On a CPU, the threads each stage computes with: this process's cores shared out among the stages
    (at least one each), so that stages working at once do not oversubscribe them. Not pinned: gloo's own
    threads answer a message far sooner when the scheduler may run them on any core."""
    cores = len(os.sched_getaffinity(0))
    return [max(1, cores // stages + (stage < cores % stages)) for stage in range(stages)]


def use_threads(count: int) -> None:
    """Compute with `count` threads in this process: torch's and the native kernels'."""
    os.environ["STRATA_CPU_THREADS"] = str(count)
    torch.set_num_threads(count)
    threads.cache_clear()


def default_backend(device: torch.device, through_host: bool) -> str:
    """The split's default process group: NCCL between GPUs, gloo on a CPU or where stages share a card
    (NCCL takes one rank a GPU)."""
    return "nccl" if device.type == "cuda" and not through_host else "gloo"


def stage_gpus(config: EngineConfig, stages: int) -> tuple[int, ...]:
    """Each stage's GPU on this host (`--stage-gpus`, by default stage k on GPU k), checked."""
    gpus = config.stage_gpus or tuple(range(stages))
    if len(gpus) != stages:
        raise StrataError(f"--stage-gpus names {len(gpus)} GPUs for {stages} stages")
    if gpus[0] != 0:
        raise StrataError("--stage-gpus: stage 0 runs on GPU 0 (choose the cards with CUDA_VISIBLE_DEVICES)")
    return gpus


def stage_device(device: str, gpu: int) -> torch.device:
    """A stage's device: GPU `gpu` of this host (stage k of a split on one host runs on the k-th), or the
    CPU."""
    if device != "cuda":
        return torch.device("cpu")
    if gpu >= torch.cuda.device_count():
        visible = torch.cuda.device_count()
        raise StrataError(f"--layer-split: a stage needs GPU {gpu}, and {visible} are visible")
    return torch.device("cuda", gpu)


def _stage_context(device: torch.device) -> BaseContext:
    """How local stage workers start: spawned (a fresh interpreter) beside a GPU, where CUDA must not have
    been initialised in a process that forks; on the CPU forked from a server process that imported the
    worker's modules once (`forkserver`), so that every split after the first starts without the seconds a
    fresh interpreter takes to import them."""
    if device.type != "cpu":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["app.engine.stage_worker"])
    return context


class StagePipeline:
    """Stage 0's side of a layer split: starts the workers, sends each window down the stages, reads back
    the final hidden states of the rows that sample."""

    def __init__(self, config: EngineConfig, path: Path, parts: list[ModelPart], device: str) -> None:
        """Spawn one worker per stage after the first (but those of `config.remote_stages`, which join from
        elsewhere at `config.split_rendezvous`), join their process group and start them; each loads its
        part meanwhile (`wait_loaded`)."""
        self.parts = parts
        self.device = stage_device(device, 0)
        remote = set(config.remote_stages)
        if remote - set(range(1, len(parts))):
            raise StrataError(f"--remote-stages: the stages after the first are 1 to {len(parts) - 1}")
        if remote and config.split_rendezvous is None:
            raise StrataError("--remote-stages join elsewhere: give --split-rendezvous tcp://HOST:PORT")
        local = [stage for stage in range(1, len(parts)) if stage not in remote]
        if config.stage_gpus and self.device.type != "cuda":
            raise StrataError("--stage-gpus places the stages on GPUs; this engine runs on the CPU")
        gpus = stage_gpus(config, len(parts)) if self.device.type == "cuda" else None
        through_host = gpus is not None and len(set(gpus)) < len(gpus)
        if through_host and remote:
            raise StrataError("stages sharing a card (--stage-gpus) cannot be joined by --remote-stages")
        for stage in local:
            stage_device(device, gpus[stage] if gpus else stage)
        self._rendezvous = tempfile.TemporaryDirectory(prefix="strata-split-")
        init = config.split_rendezvous or f"file://{self._rendezvous.name}/rendezvous"
        context = _stage_context(self.device)
        self._local = local
        self.workers: list[BaseProcess] = []  # the processes of the stages of `_local`, in order
        shares = thread_shares(len(parts) - len(remote)) if self.device.type == "cpu" else None
        from app.engine.stage_worker import run_stage

        for stage in local:
            worker = context.Process(
                target=run_stage,
                args=(stage, len(parts), init, gpus[stage] if gpus else None, None, through_host),
                name=f"strata-stage-{stage}",
                daemon=True,
            )
            worker.start()
            self.workers.append(worker)
        backend = default_backend(self.device, through_host)
        dist.init_process_group(backend, init_method=init, rank=0, world_size=len(parts), timeout=TIMEOUT)
        self.link = StageLink(self.device, through_host)
        config_bytes = msgspec.msgpack.encode(msgspec.structs.replace(config, model=str(path)))
        threads = iter(shares[1:] if shares else [])
        for stage in range(1, len(parts)):
            share = None if stage in remote else next(threads, None)
            self.link.send_object(StageStart(config_bytes, parts, share), stage)
        if shares:
            use_threads(shares[0])
        self.model: CausalLM | None = None
        self._dtype = torch.float32  # of the stream, as stage 0's layers leave it
        self._busy = BusyClock(self.device)  # stage 0's work on each window sent
        self._closed = False

    @property
    def part(self) -> ModelPart:
        """Stage 0's part of the model."""
        return self.parts[0]

    def wait_loaded(self, model: CausalLM) -> bool:
        """Once stage 0 holds `model` (its part): wait for every worker's part; whether any worker's expert
        tier has a staging area for copies over PCIe. A worker that could not load its part is a one-line
        error."""
        self.model = model
        staged = False
        for stage in range(1, len(self.parts)):
            loaded = self.link.recv_object(stage)
            assert isinstance(loaded, StageLoaded)
            if loaded.error is not None:
                raise StrataError(f"stage {stage} of the layer split: {loaded.error}")
            staged = staged or loaded.staged
        return staged

    def set_up(self, blocks: int, checkpoints: int, graphs: GraphSizes | None, window_tokens: int) -> None:
        """Give every worker the state's size (`blocks`, `checkpoints`), the window graphs' (`graphs`, None:
        eager windows) and a window's token budget."""
        for stage in range(1, len(self.parts)):
            self.link.send_object(StageSetup(blocks, checkpoints, graphs, window_tokens), stage)
        layers = [f"{p.layers.start}-{p.layers.stop - 1}" for p in self.parts]
        log.info("layer split: %d stages, layers %s", len(self.parts), ", ".join(layers))

    def send(self, rows: list[int], work: StageWork, layers: Callable[[], torch.Tensor]) -> None:
        """Start a window down the stages: stage 0's layers here (`layers()`: the stream and their last
        output, [2, rows, hidden]), then to the next stage with `work`; the last stage answers with the
        final hidden states of `rows` (`receive`, in the order sent)."""
        began = self._busy.mark()
        out = layers()
        work.rows = rows
        self._dtype = out.dtype
        try:
            self.link.send_object(work, 1)
            self.link.send_tensors([out[0], out[1]], 1)
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        self._busy.span(began)

    def first_layers(self, batch: ForwardBatch) -> torch.Tensor:
        """Stage 0's layers run eagerly over `batch`: [2, rows, hidden], the stream and the last one's
        output."""
        assert self.model is not None
        decoder = self.model.model
        x, pending = decoder.run_layers(batch, self.part.layers, decoder.embed_tokens(batch.input_ids), None)
        assert pending is not None  # every stage holds a layer
        return torch.stack((x, pending))

    def receive(self, rows: int) -> tuple[torch.Tensor | None, list[StageTimes], list[ExpertUsage]]:
        """The last stage's answer to the oldest window sent: the final hidden states [rows, hidden] of its
        rows that sample (None without any), every stage's times for it, and the workers' routing reports
        that came with it."""
        assert self.model is not None
        began = time.perf_counter()
        last = len(self.parts) - 1
        try:
            answer = self.link.recv_object(last)
            assert isinstance(answer, StageAnswer)
            hidden = None
            if rows:
                shape = (rows, self.model.config.hidden_size)
                hidden = self.link.recv_tensors([shape], self._dtype, last)[0]
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        times = [StageTimes(self._busy.oldest(), time.perf_counter() - began)]
        return hidden, times + [StageTimes(busy, wait) for busy, wait in answer.stages], answer.experts

    def _lost(self, exc: RuntimeError) -> Exception:
        """The error to raise when talking to the stages failed: which stage ended, if one did."""
        for stage, worker in zip(self._local, self.workers, strict=True):
            worker.join(timeout=1)
            if not worker.is_alive():
                return StrataError(f"stage {stage} of the layer split stopped (exit code {worker.exitcode})")
        return exc

    def close(self, parks: list[Kept | Forgotten | Unlinked] | None = None) -> None:
        """Stop the workers (after they make `parks`, stage 0's park's last changes) and leave the process
        group."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # a worker already gone
            self.link.send_object(StageWork(stop=True, parks=parks or []), 1)
            self.link.flush()
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
        dist.destroy_process_group()
        self._rendezvous.cleanup()
