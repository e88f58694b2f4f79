"""The expert tier of one MoE layer: some experts in device memory, the others in host RAM.

A layer built with a tier keeps `resident` experts in device memory and the others in host memory (pinned
on a GPU machine, so copies to the device run at full speed); each expert lives in exactly one of the two,
so a model needs host RAM only for what the device does not hold. Each forward computes a routed entry
where its expert lives: the entries of resident experts with the backends' experts kernel on the device;
each missed expert (one in host RAM) either on the CPU from host RAM (the CPU pool's native kernel,
app/kernels/cpu_experts.py) or copied over PCIe into a staging slot and run there by the same kernel, split
per window by the machine's measured costs (app/models/expert_costs.py); the sums are added. With the
device itself the CPU, every entry is computed in expert order with the reference's arithmetic, so the tier
gives the all-resident model's outputs exactly wherever the experts live.
The resident experts are the first `resident` ones at load; `adapt` (every `--adapt-every` windows, the
engine calls it) makes the most routed ones resident, exchanging them with the coldest: the incoming
expert's weights go to the device, the outgoing one's back to host RAM.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from app.kernels.interface import ExpertsFn, HostExpertsFn, HostFinishFn, HostStepFactory, TierLinkFns
from app.models.expert_costs import GATE_UP_SHARE, CopyTimes, MissCosts, measure
from app.models.host_copies import PinnedCopies
from app.models.moe import RoutedExperts, SparseMoE, expert_parts
from app.models.pieces import Finish, Pieces
from app.models.tier_step import NativeSmallStep, native_small_step

ADAPT_DECAY = 0.5  # the least share of the earlier routing counts kept when the tier adapts again
# The counts remember about this many counts (`count`: a window routing to the expert) per expert of a
# layer: at each adaptation the older counts are scaled by 1 - (counts since the last one) / (ADAPT_MEMORY *
# experts), by ADAPT_DECAY at least. Batch-1 decode routes 16 windows' 128 entries between two adaptations
# of q30's 128-expert layers, and halving the counts each time kept so few that the tier chased noise; a
# window of 8 rows or more counts enough to keep halving them. `python benchmarks/tier_adaptation.py` (32 of
# 128 resident, Zipf routing, batch 1, 20,000 tokens): 0.017 swaps a token a layer against 0.125, 68.9% of
# entries on the device against 67.4% (the best 32 would hold 69.5%); uniform routing 0.095 swaps against
# 0.336; a routing moved to other experts is followed more slowly (60.9% held over the next 400 tokens
# against 65.3%); batch 8 unchanged (counted by entries then: `count`).
ADAPT_MEMORY = 8
# An incoming expert takes an outgoing one's place only where its count beats the other's by this many
# standard deviations of their difference (counts as Poisson: sqrt of their sum). `python
# benchmarks/tier_adaptation.py` (q30's 128 experts a layer, 32 resident, adapting every 16 windows): Zipf
# routing at batch 1 made 0.48 swaps a token a layer without it and 0.13 with it, uniform routing 1.09 and
# 0.34, each an expert copied over PCIe for nothing but noise, while the share held on the device rose a
# little (0.655 to 0.674 on Zipf) and after the routing moved it came back as fast at batch 1 (a margin of 2
# swapped less still but followed such a move more slowly).
SWAP_MARGIN = 1.0
VRAM, CPU, PCIE = range(3)  # where a routed entry was served (the order of protocol.EXPERT_SOURCES)
HOST_READ_ENTRIES = 1024  # up to so many routed entries a window's routing is read whole to the host
STREAM_COVERAGE = 0.5  # a large window streams whole layers when its first layer misses this share of hosts
STREAM_AT_ONCE = 8  # a window of this many routed entries an expert streams from its first tiered layer on
STREAM_HEADROOM = 2 << 30  # device bytes left free beside a stream's second staging area and the KV pool
SPLIT_ALIGN = 64  # a missed expert shared by the CPU pool and a copy is split at a multiple of these channels


def _beyond_noise(hot: float, cold: float) -> bool:
    """Whether an incoming expert's count `hot` beats an outgoing one's `cold` by more than SWAP_MARGIN
    standard deviations of their difference."""
    return hot - cold > SWAP_MARGIN * math.sqrt(hot + cold)


@dataclass
class TierCounts:
    """What a tier did since its counts were last taken: routed entries served from VRAM / CPU / PCIe, bytes
    copied to the device (staged misses and swapped-in experts), and seconds windows waited for swaps."""

    served: list[int]
    pcie_bytes: int
    adapt_wait_s: float


@dataclass
class SwapRound:
    """Asynchronous swaps under way: (incoming, outgoing) experts, the spare slots being filled, and the
    event that marks the copies done (None where the copies ran at once: a CPU device)."""

    swaps: list[tuple[int, int]]
    targets: list[int]
    event: torch.cuda.Event | None


@dataclass
class RoutedBefore:
    """A conversation's routed entries per tier (in the engine's order) and expert, copied off the device
    when it was parked (`counts` [tiers, experts], on the host once `copied` has passed), so that its
    follow-up can bring its hot experts back (`TieredExperts.bring`)."""

    counts: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def take(cls, tiers: list[TieredExperts], slot: int) -> RoutedBefore:
        """The counts of `slot` in every tier, queued off the device; each tier's row is then cleared for the
        slot's next request (after the windows queued so far)."""
        rows = []
        for tier in tiers:
            assert tier.slot_heat is not None
            rows.append(tier.slot_heat[slot].clone())
            tier.slot_heat[slot].zero_()
        counts = torch.stack(rows)
        copied = None
        if counts.device.type == "cuda":
            counts = counts.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return cls(counts, copied)

    def hot(self) -> list[list[int]]:
        """Each tier's experts the conversation routed to, most entries first (ties in expert order)."""
        if self.copied is not None:
            self.copied.synchronize()
        hot = []
        for row in self.counts.tolist():
            hot.append(sorted((e for e, n in enumerate(row) if n > 0), key=lambda e: (-row[e], e)))
        return hot


class ExpertStaging:
    """Device slots a window's missed experts are copied into over PCIe, shared by every tiered layer of a
    model: the layers run one after another on one stream, so a layer's copies are queued behind the previous
    layer's kernel, which has read the slots by then."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.zeroed = 0  # the leading gate rows of the last slot known to be zero (`load_rest`)
        self.copies = PinnedCopies(torch.device("cpu"))  # the device's, once allocated

    def allocate(self, gate_up: torch.Tensor, down: torch.Tensor, device: torch.device) -> None:
        """Room for `slots` experts shaped like gate_up / down [experts, ...] on `device` (once), zeroed: a
        slot holds finite weights only, ever."""
        if self.gate_up is None:
            self.gate_up = torch.zeros((self.slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
            self.down = torch.zeros((self.slots, *down.shape[1:]), dtype=down.dtype, device=device)
            self.zeroed = gate_up.shape[1] // 2
            self.copies = PinnedCopies(device)

    def load_rest(self, host_slot: int, channels: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """Queue the copy of the expert at `host_slot` of the host's gate_up / down into the last staging slot
        (returned) from intermediate channel `channels` on: those gate and up rows and the whole down matrix
        (its columns are not contiguous in host RAM), its first `channels` gate rows zero, so that the slot's
        expert sums the other channels alone (silu(0) times the finite up rows left there adds nothing); the
        CPU pool sums the first. The zero rows stay from one split to the next where they reach far enough."""
        assert self.gate_up is not None and self.down is not None
        inter, slot = gate_up.shape[1] // 2, self.slots - 1
        self.zero_gate_rows(channels)
        row, count = gate_up.shape[2], (inter - channels) * gate_up.shape[2]
        expert, host_expert = slot * 2 * inter * row, host_slot * 2 * inter * row
        kept = [
            (expert + (first + channels) * row, host_expert + (first + channels) * row, count)
            for first in (0, inter)
        ]
        whole = down.stride(0)  # an expert's elements (contiguous), without making a view of one
        self.copies.queue(
            (self.gate_up, gate_up, kept), (self.down, down, [(slot * whole, host_slot * whole, whole)])
        )
        return slot

    def zero_gate_rows(self, channels: int) -> None:
        """Queue zeroing the last slot's first `channels` gate rows where they are not zero yet (the split
        expert's channels that `load_rest` leaves to the CPU pool)."""
        assert self.gate_up is not None
        if self.zeroed < channels:
            self.gate_up[self.slots - 1, self.zeroed : channels].zero_()
        self.zeroed = channels

    def load(
        self, experts: list[int], host_slots: list[int], gate_up: torch.Tensor, down: torch.Tensor
    ) -> dict[int, int]:
        """Queue the copies of `experts` (at most `slots`), held at `host_slots` of the host's gate_up / down,
        into the staging slots (a run of consecutive host slots as one copy); returns each one's slot."""
        assert self.gate_up is not None and self.down is not None
        order = sorted(range(len(experts)), key=lambda i: host_slots[i])
        ordered = [host_slots[i] for i in order]
        runs, start = [], 0  # (first slot, first host slot, experts)
        while start < len(ordered):
            end = start + 1
            while end < len(ordered) and ordered[end] == ordered[end - 1] + 1:
                end += 1
            runs.append((start, ordered[start], end - start))
            start = end
        jobs = []
        for target, source in ((self.gate_up, gate_up), (self.down, down)):
            size = source.stride(0)
            jobs.append((target, source, [(at * size, first * size, n * size) for at, first, n in runs]))
        self.copies.queue(*jobs)
        self.written(len(experts))
        return {experts[i]: slot for slot, i in enumerate(order)}

    def written(self, slots: int) -> None:
        """Slots 0 to `slots` - 1 were given whole experts (here, or by a `LayerStream` using this area as its
        first buffer): where the last slot is among them, its zero gate rows are gone."""
        if slots >= self.slots:
            self.zeroed = 0


class HostLink:
    """Pinned host buffers through which a small window's tiered layers and the host step at each layer's
    cut talk, so the step itself issues no device work. The graph before the cut writes the layer's routing
    (padding rows' entries pointing past the experts), routing weights and input, all as fp32, into `down`
    (one kernel, `pack`) and records `ready`; the step waits for that (`wait`, `read`), plans, queues the
    staging copies and runs the CPU pool into the sums of `up`, after each expert's staging slot (-1 for
    none); the graph after the cut reads `up` where it lies (`stage_map`, `sums`; app/kernels/triton_tier.py).
    Where the kernels can (`fns.waits`) and the pool runs in the background, the step returns while the pool
    runs: the next graph is launched at once and waits on the device for the pool's `done` word before it
    reads the sums.
    One link serves every layer of a model: the layers run one after another and each step waits for its
    layer's `ready`, by when the reads of the layer before it have run."""

    def __init__(self, entries: int, hidden: int, experts: int, fns: TierLinkFns) -> None:
        self.entries, self.hidden, self.experts = entries, hidden, experts
        self.fns = fns  # the device's side: the graphs' kernels around the cut
        self.down = torch.empty(entries * (2 + hidden), dtype=torch.float32, pin_memory=True)
        self.up = torch.zeros(experts + entries * hidden, dtype=torch.float32, pin_memory=True)
        self.up[:experts] = -1
        self._stage_of = self.up[:experts].numpy()  # written item by item without torch's per-call cost
        # 1 once the CPU pool's sums of the step are in `up`; a background run started with it sets it to 0
        # until then, and the graph after the cut waits on the device for it where `fns.waits`
        self.done = torch.ones(1, dtype=torch.int32, pin_memory=True)
        self.ready = torch.cuda.Event(external=True)
        self.summed_rows = 0  # rows of the sums the last step wrote (zeroed before the next one)
        self._picks_at, self._sums_at = self.down.data_ptr(), self.up.data_ptr() + 4 * experts  # `addresses`
        self.staged: list[int] = []  # experts the staging map names now

    def pack(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        x: torch.Tensor,
        live: torch.Tensor | None,
        slot_of: torch.Tensor,
    ) -> torch.Tensor:
        """(Captured) write a layer's routing ids / weights [rows, k] (padding rows' ids: the number of
        experts) and input x [rows, hidden] to `down`; returns each entry's device slot (`slot_of`, -1 for
        a host expert or on a padding row) on the device."""
        slots = self.fns.pack(ids, weights, x, live, slot_of, self.down)
        self.ready.record()
        return slots

    def wait(self) -> None:
        """Wait until the device has written the layer's routing and input here (`ready`)."""
        self.ready.synchronize()

    def read(self, rows: int, width: int) -> tuple[list[float], list[float], torch.Tensor, torch.Tensor]:
        """What `pack` wrote for `rows` rows of `width` picks: ids and weights as lists, x [rows, hidden]
        (pinned, fp32), and the sums [rows, hidden] the CPU pool adds into (zero: what the last step's pool
        added is cleared here)."""
        entries = rows * width
        picks = self.down[: 2 * entries].tolist()
        x = self.down[2 * entries : 2 * entries + rows * self.hidden].view(rows, self.hidden)
        if self.summed_rows:
            self.up[self.experts : self.experts + self.summed_rows * self.hidden].zero_()
            self.summed_rows = 0
        sums = self.up[self.experts : self.experts + rows * self.hidden].view(rows, self.hidden)
        return picks[:entries], picks[entries:], x, sums

    def addresses(self, rows: int, width: int) -> tuple[int, int, int, int, int, int]:
        """What `read` gives, where it lies, for the native step (`NativeSmallStep.serve`): the picks'
        address, `rows` and `width`, x's and the sums' addresses, and the rows of the sums to zero first."""
        picks = self._picks_at
        return picks, rows, width, picks + 8 * rows * width, self._sums_at, self.summed_rows

    def name_staged(self, staged: dict[int, int]) -> None:
        """The staging map names the experts of `staged` (expert -> staging slot) and no others."""
        for expert in self.staged:
            self._stage_of[expert] = -1
        for expert, slot in staged.items():
            self._stage_of[expert] = slot
        self.staged = list(staged)

    def stage_map(self) -> torch.Tensor:
        """Each expert's staging slot as the step left it (fp32, -1 for none), in pinned memory."""
        return self.up[: self.experts]

    def sums(self, rows: int) -> torch.Tensor:
        """The CPU pool's sums [rows, hidden] as the step left them (fp32, zero where it ran none), pinned."""
        return self.up[self.experts : self.experts + rows * self.hidden].view(rows, self.hidden)


class PoolArgs:
    """Host buffers for the CPU pool's call of a small window: its experts' host slots, their bounds among
    the entries, each entry's row and weight, written through numpy views and handed over as slices (four
    new tensors a tiered layer's step cost more than the step's planning)."""

    def __init__(self, entries: int, experts: int) -> None:
        self.experts = experts
        self._indices = torch.zeros(2 * experts + 1 + entries, dtype=torch.int64)
        self._weights = torch.zeros(entries, dtype=torch.float32)
        self._channels = torch.zeros(experts, dtype=torch.int64)
        self._index_view, self._weight_view = self._indices.numpy(), self._weights.numpy()
        self._channel_view = self._channels.numpy()

    def fill(
        self, hosts: list[int], offsets: list[int], rows: list[int], weights: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four arguments (host slots, offsets, rows, weights) as slices of the buffers."""
        count, entries, at = len(hosts), len(rows), self.experts
        view = self._index_view
        view[:count] = hosts
        view[at : at + count + 1] = offsets
        view[2 * at + 1 : 2 * at + 1 + entries] = rows
        self._weight_view[:entries] = weights
        indices = self._indices
        return (
            indices[:count],
            indices[at : at + count + 1],
            indices[2 * at + 1 : 2 * at + 1 + entries],
            self._weights[:entries],
        )

    def channels(self, counts: list[int]) -> torch.Tensor:
        """Each expert's intermediate channels the pool sums (the kernel's `channels`), as a slice."""
        self._channel_view[: len(counts)] = counts
        return self._channels[: len(counts)]


class LayerStream:
    """The host parts of a model's tiered layers copied to the device a layer ahead of their compute, for
    windows so large that they miss most host experts of every layer (long prompts): each layer's copy runs
    on a side stream into one of two buffers in turn while the device computes the layer before, so the
    link never waits for a layer's routing. A window of at least STREAM_AT_ONCE routed entries an expert
    (a long prompt's chunk, which misses nearly every host expert of every layer) streams from its first
    tiered layer on, without reading its routing (`start`); a smaller one when its first tiered layer misses
    at least STREAM_COVERAGE of that layer's host experts (`begin`), from the next layer on. Every streamed
    layer computes each missed entry from the copy of its host part (`take`)."""

    def __init__(self, tiers: list[TieredExperts], staging: ExpertStaging) -> None:
        """`staging`'s area is the first of the two buffers (a streamed window stages nothing else)."""
        assert staging.gate_up is not None and staging.down is not None
        self.tiers = tiers
        self.staging = staging
        first = (staging.gate_up, staging.down)
        self.buffers = [first, (torch.empty_like(first[0]), torch.empty_like(first[1]))]
        self.copies = torch.cuda.Stream(first[0].device)
        self.ready: dict[int, torch.cuda.Event] = {}
        self.active = False

    def start(self) -> None:
        """Stream this window from the first tiered layer on: its copy is queued now."""
        self.ready.clear()
        self.active = True
        self.prefetch(0)

    def begin(self, coverage: float) -> None:
        """The first tiered layer of a large window missed `coverage` of its host experts: stream the window
        from the next layer on if that is at least STREAM_COVERAGE."""
        self.ready.clear()
        self.active = coverage >= STREAM_COVERAGE
        if self.active:
            self.prefetch(1)

    def prefetch(self, position: int) -> None:
        """Queue the copy of tier `position`'s host part (every host slot up to the last expert held) into
        its buffer, on the side stream, after the device work queued so far (which includes every read of
        that buffer by the layer two before)."""
        if position >= len(self.tiers):
            return
        tier = self.tiers[position]
        slots = max(tier.host_of) + 1
        gate_up, down = self.buffers[position % 2]
        if position % 2 == 0:
            self.staging.written(slots)
        queued = torch.cuda.Event()
        queued.record()
        self.copies.wait_event(queued)
        with torch.cuda.stream(self.copies):
            gate_up[:slots].copy_(tier.host_gate_up[:slots], non_blocking=True)
            down[:slots].copy_(tier.host_down[:slots], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.ready[position] = done
        tier.pcie_bytes += slots * tier.expert_bytes()

    def take(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tier `position`'s host part on the device (gate_up, down by host slot), once its copy is done:
        the current stream waits for it, the host does not."""
        torch.cuda.current_stream().wait_event(self.ready.pop(position))
        return self.buffers[position % 2]


class TieredExperts(nn.Module):
    """Routed experts of one layer, `resident` of them on the device.

    `gate_up` [resident + spare, 2 * intermediate, hidden] / `down` [resident + spare, hidden, intermediate]
    on the device hold the resident experts (loaded there straight from the checkpoint) and `spare` free
    slots for asynchronous swaps; `host_gate_up` / `host_down` [experts - resident + 1, ...] in host memory
    hold the others (loaded straight to host memory: experts beyond the device budget never touch the device)
    and one free slot that exchanges pass through. `slots` / `slot_of` give each expert's device slot and
    `host_of` its host slot, -1 where it is not; `place(device)` pins the host part and builds the maps.
    """

    HOST_PARAMETERS = ("host_gate_up", "host_down")

    def __init__(
        self,
        experts: int,
        hidden: int,
        intermediate: int,
        kernel: ExpertsFn,
        resident: int,
        host_kernel: HostExpertsFn,
        spare: int = 0,
        host_finish: HostFinishFn | None = None,
        host_step: HostStepFactory | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= resident < experts:
            raise ValueError(f"resident experts must be in [0, {experts}), got {resident}")
        self.experts = experts
        self.spare = spare if resident else 0
        self.kernel = kernel
        self.host_kernel = host_kernel
        self.host_finish = host_finish  # where given, a small window's pool runs while its copies are queued
        self.host_step = host_step  # where given, a small window's host step is native (tier_step.py)
        self._small_step: NativeSmallStep | None = None  # made at the first capture after `place`
        self.intermediate = intermediate
        self.resident = resident
        host = experts - resident + 1
        self.host_gate_up = nn.Parameter(torch.empty(host, 2 * intermediate, hidden))
        self.host_down = nn.Parameter(torch.empty(host, hidden, intermediate))
        self.gate_up: nn.Parameter | None = None
        self.down: nn.Parameter | None = None
        if resident:
            self.gate_up = nn.Parameter(torch.empty(resident + self.spare, 2 * intermediate, hidden))
            self.down = nn.Parameter(torch.empty(resident + self.spare, hidden, intermediate))
        self.slot_of: torch.Tensor | None = None
        self.slots = [e if e < resident else -1 for e in range(experts)]  # device slot (host copy of slot_of)
        self.host_of = [e - resident if e >= resident else -1 for e in range(experts)]  # host slot
        self.free_host = [experts - resident]  # host slots holding no expert
        # `slots` and `host_of` as tensors in host memory (the native host step reads them)
        self.slot_table = torch.tensor(self.slots, dtype=torch.long)
        self.host_table = torch.tensor(self.host_of, dtype=torch.long)
        self.heat: torch.Tensor | None = None  # windows routed to each expert (`count`), decayed
        self._ones = torch.ones(experts)  # `count`'s addend for a window of one row (on the device: `place`)
        self._remembered = 0.0  # what the heat held after its last decay
        self.slot_heat: torch.Tensor | None = None  # [slots, experts]: routed entries per state slot
        self.staging: ExpertStaging | None = None  # with `costs`: misses may go over PCIe (`use_staging`)
        self.stream: LayerStream | None = None  # large windows' layer-ahead copies (`use_staging`)
        self.position = 0  # this tier's place among the stream's layers
        self.host_slot_of: torch.Tensor | None = None  # [experts + 1] on the device: host slot, -1 for none
        self._streamed: torch.Tensor | None = None  # streamed layers' entries from VRAM / PCIe, not yet read
        self.link: HostLink | None = None  # pinned buffers small captured windows' host steps use
        self.costs: MissCosts | None = None
        self.copy_times: CopyTimes | None = None  # on a GPU: the staging copies timed into `costs`
        self.pcie_frac: float | None = None  # forces this share of a window's missed experts over PCIe
        self.served = [0, 0, 0]  # routed entries served from VRAM / CPU / PCIe since `take_counts`
        self.pcie_bytes = 0  # bytes copied to the device (staging and swaps) since `take_counts`
        self.adapt_wait_s = 0.0  # time windows waited for blocking swaps, measured so far
        self._swap_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # not yet read
        self.spare_slots: list[int] = []  # device slots holding no resident expert (asynchronous swaps)
        self._round: SwapRound | None = None  # the asynchronous swaps under way
        self._freed: torch.cuda.Event | None = None  # when the windows that used the spare slots are done
        self._stream: torch.cuda.Stream | None = None
        self.pieces: Pieces | None = None  # set while a piecewise CUDA graph is captured (cuda_graphs.py)
        self._pool_args: PoolArgs | None = None  # a small window's CPU pool call's index and weight buffers

    def checkpoint_parts(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint tensor name -> (parameter name, index into it), for every expert's projections: a
        resident expert's into the device slots, the others' into the host slots."""

        def where(expert: int) -> tuple[str, str, int]:
            if expert < self.resident:
                return "gate_up", "down", expert
            return "host_gate_up", "host_down", expert - self.resident

        return expert_parts(prefix, self.experts, self.intermediate, where)

    @torch.no_grad()
    def fill(self, gate_up: torch.Tensor, down: torch.Tensor, device: torch.device) -> None:
        """Set every expert from stacked weights [experts, ...] (tests and benchmarks, where no checkpoint
        is loaded): the resident ones into device slots on `device`, the others into host slots; then
        `place`."""
        host, pin = (self.host_gate_up.shape[0], *gate_up.shape[1:]), device.type == "cuda"
        self.host_gate_up = nn.Parameter(
            torch.empty(host, dtype=gate_up.dtype, pin_memory=pin), requires_grad=False
        )
        self.host_down = nn.Parameter(
            torch.empty((host[0], *down.shape[1:]), dtype=down.dtype, pin_memory=pin), requires_grad=False
        )
        self.host_gate_up[:-1].copy_(gate_up[self.resident :])
        self.host_down[:-1].copy_(down[self.resident :])
        if self.resident:
            slots = self.resident + self.spare
            self.gate_up = nn.Parameter(
                torch.empty((slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device),
                requires_grad=False,
            )
            self.down = nn.Parameter(
                torch.empty((slots, *down.shape[1:]), dtype=down.dtype, device=device), requires_grad=False
            )
            self.gate_up[: self.resident].copy_(gate_up[: self.resident])
            self.down[: self.resident].copy_(down[: self.resident])
        self.place(device)

    @torch.no_grad()
    def place(self, device: torch.device) -> None:
        """Pin the host part on a GPU machine and build the maps of where each expert lives on `device`."""
        if device.type == "cuda" and not self.host_gate_up.is_pinned():
            self.host_gate_up = nn.Parameter(self.host_gate_up.data.pin_memory(), requires_grad=False)
            self.host_down = nn.Parameter(self.host_down.data.pin_memory(), requires_grad=False)
        self.spare_slots = list(range(self.resident, self.resident + self.spare))
        self._round, self._freed = None, None
        self.slot_of = torch.tensor(self.slots, dtype=torch.long).to(device)
        self.slot_table = torch.tensor(self.slots, dtype=torch.long)
        self.host_table = torch.tensor(self.host_of, dtype=torch.long)
        self._small_step = None  # its tables and weights may have moved
        self.host_slot_of = torch.tensor([*self.host_of, -1], dtype=torch.long).to(device)
        self.heat = torch.zeros(self.experts, dtype=torch.float32, device=device)
        self._ones = torch.ones(self.experts, dtype=torch.float32, device=device)
        self._remembered = 0.0

    def take_counts(self) -> TierCounts:
        """What the tier did since the last call (`TierCounts`); swaps whose copies are still queued count
        their wait at a later call."""
        if self._streamed is not None:
            vram, pcie = self._streamed.tolist()
            self.served[VRAM] += vram
            self.served[PCIE] += pcie
            self._streamed = None
        waited, timings = self.adapt_wait_s, []
        for begin, end in self._swap_timings:
            if end.query():
                waited += begin.elapsed_time(end) / 1000
            else:
                timings.append((begin, end))
        counts = TierCounts(self.served, self.pcie_bytes, waited)
        self.served, self.pcie_bytes, self.adapt_wait_s, self._swap_timings = [0, 0, 0], 0, 0.0, timings
        return counts

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights."""
        gate_up, down = self.host_gate_up, self.host_down
        return (gate_up.shape[1] * gate_up.shape[2] * gate_up.element_size()) + (
            down.shape[1] * down.shape[2] * down.element_size()
        )

    def locations(self) -> list[int]:
        """Where each expert is computed: 0 on the device, 1 in host RAM (the Monitor's residency grid)."""
        return [0 if slot >= 0 else 1 for slot in self.slots]

    @torch.no_grad()
    def adapt(self, decay: float | None = None) -> int:
        """Make the experts routed most since the last adaptation (the older counts decayed: by `decay`, by
        default as `ADAPT_MEMORY` says) the resident ones: the hottest experts in host RAM take the places of
        the coldest resident ones, which go back to host RAM, where the difference of their counts is beyond
        noise (`SWAP_MARGIN`). Returns how many swaps began. On a frozen tier (never adapted) nothing moves.

        Without spare slots each exchange is queued behind the windows already launched (a window runs with
        the experts it was planned with; the next waits for the copies): the outgoing expert to a free host
        slot, the incoming one into its device slot, whose host slot is then the free one. With spare slots
        (`--adapt-async`) the incoming experts are copied into them on a side stream while windows run, as
        many swaps as there are spare slots at a time, and land (`land`) between windows once copied.
        """
        assert self.heat is not None
        heat = self.heat.tolist()
        counted = sum(heat)
        if decay is None:
            decay = max(ADAPT_DECAY, 1 - (counted - self._remembered) / (ADAPT_MEMORY * self.experts))
        self.heat.mul_(decay)
        self._remembered = counted * decay
        if not self.resident or self._round is not None:
            return 0
        assert self.gate_up is not None and self.down is not None and self.slot_of is not None
        resident = [e for e, slot in enumerate(self.slots) if slot >= 0]
        # residents win ties, so equally hot experts do not move back and forth
        ranked = sorted(range(len(heat)), key=lambda e: (heat[e], self.slots[e] >= 0), reverse=True)
        wanted = set(ranked[: self.resident])
        incoming = [e for e in ranked[: self.resident] if self.slots[e] < 0]
        outgoing = sorted((e for e in resident if e not in wanted), key=lambda e: heat[e])
        # the hottest incoming against the coldest outgoing first: the pairs after one within noise are closer
        pairs = zip(incoming, outgoing, strict=True)
        swaps = list(itertools.takewhile(lambda pair: _beyond_noise(heat[pair[0]], heat[pair[1]]), pairs))
        if self.spare:
            return self._begin(swaps[: len(self.spare_slots)])
        return self._exchange([new for new, _ in swaps], [old for _, old in swaps])

    def keep_slot_heat(self, slots: int) -> None:
        """Count the routing per state slot too (of `slots`, the scratch slot included), so that a parked
        conversation's follow-up can bring back the experts it used (`RoutedBefore`, `bring`)."""
        assert self.heat is not None
        self.slot_heat = torch.zeros(slots, self.experts, dtype=torch.float32, device=self.heat.device)

    @torch.no_grad()
    def bring(self, hot: list[int]) -> int:
        """Make the first of the experts `hot` (most wanted first; a resumed conversation's) resident, as
        many as the device holds, in place of the resident ones routed least since the last adaptation
        (not among them); the copies are queued before the next window, which waits for them. Returns how
        many experts moved in (none while asynchronous swaps are under way). Reads the heat: waits for the
        windows queued so far."""
        if not self.resident or self._round is not None or self.heat is None:
            return 0
        wanted = hot[: self.resident]
        incoming = [e for e in wanted if self.slots[e] < 0]
        if not incoming:
            return 0
        heat = self.heat.tolist()
        keep = set(wanted)
        resident = [e for e, slot in enumerate(self.slots) if slot >= 0 and e not in keep]
        outgoing = sorted(resident, key=lambda e: (heat[e], e))[: len(incoming)]
        return self._exchange(incoming, outgoing)

    def _exchange(self, incoming: list[int], outgoing: list[int]) -> int:
        """Queue the exchanges of each incoming expert (host RAM) with its outgoing one (on the device)."""
        assert self.gate_up is not None and self.down is not None
        if not incoming:
            return 0
        self.pcie_bytes += self.expert_bytes() * len(incoming)
        on_gpu = self.gate_up.device.type == "cuda"
        began = time.perf_counter()
        if on_gpu:  # the copies' time on the device: what the next window waits for
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        for new, old in zip(incoming, outgoing, strict=True):
            slot, free = self.slots[old], self.free_host.pop()
            self._evict(slot, free)
            self.gate_up[slot].copy_(self.host_gate_up[self.host_of[new]], non_blocking=True)
            self.down[slot].copy_(self.host_down[self.host_of[new]], non_blocking=True)
            # the incoming expert's host slot is free once that copy ran: later copies into it queue behind
            self.free_host.append(self.host_of[new])
            self.slots[new], self.slots[old] = slot, -1
            self.host_of[new], self.host_of[old] = -1, free
        self._moved()
        if on_gpu:
            timing[1].record()
            self._swap_timings.append(timing)
        else:
            self.adapt_wait_s += time.perf_counter() - began
        return len(incoming)

    def _moved(self) -> None:
        """Experts changed places: the device's map and the host's tables follow the lists."""
        assert self.slot_of is not None and self.host_slot_of is not None
        self.slot_table = torch.tensor(self.slots, dtype=torch.long)
        self.host_table = torch.tensor(self.host_of, dtype=torch.long)
        self.slot_of.copy_(self.slot_table)
        self.host_slot_of.copy_(torch.tensor([*self.host_of, -1], dtype=torch.long))

    def _evict(self, slot: int, host_slot: int) -> None:
        """Queue the copy of the expert in device `slot` back to `host_slot` (after the windows queued so
        far, which may read it; the host reads a host slot only after waiting for the device's work)."""
        assert self.gate_up is not None and self.down is not None
        self.host_gate_up[host_slot].copy_(self.gate_up[slot], non_blocking=True)
        self.host_down[host_slot].copy_(self.down[slot], non_blocking=True)

    def _begin(self, swaps: list[tuple[int, int]]) -> int:
        """Copy the incoming experts of `swaps` (incoming, outgoing) into spare slots, on a side stream that
        first waits until no window still reads those slots; `land` puts them in place once copied."""
        assert self.gate_up is not None and self.down is not None
        if not swaps:
            return 0
        targets = self.spare_slots[: len(swaps)]
        self.pcie_bytes += self.expert_bytes() * len(swaps)
        event = None
        if self.gate_up.device.type == "cuda":
            self._stream = self._stream or torch.cuda.Stream(self.gate_up.device)
            if self._freed is not None:
                self._stream.wait_event(self._freed)
            with torch.cuda.stream(self._stream):
                self._copy_in(swaps, targets)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            self._copy_in(swaps, targets)
        self._round = SwapRound(swaps, targets, event)
        return len(swaps)

    def _copy_in(self, swaps: list[tuple[int, int]], targets: list[int]) -> None:
        assert self.gate_up is not None and self.down is not None
        for (new, _), slot in zip(swaps, targets, strict=True):
            self.gate_up[slot].copy_(self.host_gate_up[self.host_of[new]], non_blocking=True)
            self.down[slot].copy_(self.host_down[self.host_of[new]], non_blocking=True)

    def land(self) -> None:
        """Put the copied experts of the round under way in place, if their copies are done: each takes its
        spare slot, the outgoing expert goes back to the incoming one's host slot, and the outgoing expert's
        device slot becomes spare (free once that copy and the windows queued so far ran). The engine calls
        it between windows, so every layer of a window computes with one map of slots."""
        swaps = self._round
        if swaps is None or (swaps.event is not None and not swaps.event.query()):
            return
        assert self.slot_of is not None
        freed = []
        for (new, old), slot in zip(swaps.swaps, swaps.targets, strict=True):
            host_slot = self.host_of[new]
            self._evict(self.slots[old], host_slot)
            freed.append(self.slots[old])
            self.slots[new], self.slots[old] = slot, -1
            self.host_of[new], self.host_of[old] = -1, host_slot
        self.spare_slots = [s for s in self.spare_slots if s not in swaps.targets] + freed
        self._moved()
        if swaps.event is not None:
            self._freed = torch.cuda.Event()
            self._freed.record()
        self._round = None

    def forward(
        self,
        x: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        live: torch.Tensor | None = None,
        row_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [tokens, hidden], top_ids / top_weights [tokens, k] -> the weighted sum of expert outputs;
        `live` [tokens] is 0 on padding rows (whose misses are not computed); `row_slots` [tokens], each row's
        state slot, counts the routing per slot where the tier keeps that (`keep_slot_heat`)."""
        if self.slot_of is None or self.heat is None:
            raise RuntimeError("TieredExperts.place() must run before the first forward")
        if not self._streams(top_ids.numel()):
            # a streamed layer copies its whole host part whichever experts are resident: its routing says
            # nothing about which should be (a long prompt's would crowd out the decoding slots')
            self.count(top_ids, live)
        if self.slot_heat is not None and row_slots is not None:
            picks = row_slots[:, None] * self.experts + top_ids
            counted = torch.ones_like(top_ids, dtype=torch.float32) if live is None else live[:, None].float()
            self.slot_heat.view(-1).index_add_(0, picks.flatten(), counted.expand_as(top_ids).flatten())
        if x.device.type == "cpu":
            missed = int((self.slot_of[top_ids] < 0).sum())
            self.served[VRAM] += top_ids.numel() - missed
            self.served[CPU] += missed
            return self._in_order(x, top_ids, top_weights)
        if self.pieces is not None:
            return self._captured(x, top_ids, top_weights, live)
        return self._split(x, top_ids, top_weights, live)

    def count(self, top_ids: torch.Tensor, live: torch.Tensor | None = None) -> None:
        """Add a window's routing to the heat: one for each expert a live row routed to, however many rows
        did. A missed expert costs a window one read of its weights from host RAM (the CPU pool's few rows
        are bound by that read) or one copy over PCIe, whatever its rows, so the experts worth holding are
        those routed in the most windows; counted by entries, a prompt chunk's hundreds of rows spread over
        every expert outweighed a decoding slot's eight a window and moved its experts out while it was
        read. Padding rows (`live` 0) count nothing."""
        assert self.heat is not None
        picks = top_ids.flatten()
        if top_ids.shape[0] == 1:  # a window's one row is never padding (one launch: no ones to make)
            self.heat.index_add_(0, picks, self._ones[: picks.numel()])
            return
        counted = torch.ones_like(top_ids, dtype=torch.float32) if live is None else live[:, None].float()
        touched = torch.zeros(self.experts, dtype=torch.float32, device=self.heat.device)
        touched.scatter_reduce_(0, picks, counted.expand_as(top_ids).flatten(), reduce="amax")
        self.heat.add_(touched)

    def _weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert's gate_up and down where it is computed: its device slot, or host RAM."""
        slot = self.slots[expert]
        if slot >= 0:
            assert self.gate_up is not None and self.down is not None
            return self.gate_up[slot], self.down[slot]
        return self.host_gate_up[self.host_of[expert]], self.host_down[self.host_of[expert]]

    def _in_order(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """Every entry on the CPU through the layer's experts kernel, over every expert's weights gathered
        from where each lives: the all-resident layer's computation exactly, whatever the kernel (so a frozen
        tier gives the all-resident model's outputs exactly). Copies the layer's experts: tests, not speed."""
        gate_up, down = zip(*(self._weights(e) for e in range(self.experts)), strict=True)
        return self.kernel(x, top_ids, top_weights, torch.stack(gate_up), torch.stack(down))

    def _split(
        self,
        x: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Resident experts' entries with the experts kernel on the device (the others skipped there), the
        missed ones where the costs send them; the sums added on the device. A small window's routing is
        read whole to the host (`_serve_small`), a large one's counted per expert on the device
        (`_serve_large`)."""
        ids = self._masked(top_ids, live)
        stream = self.stream
        if stream is not None and self._streams(ids.numel()):
            if self.position == 0:
                stream.start()
            return self._from_stream(stream, x, ids, top_ids, top_weights)
        host: tuple[torch.Tensor | None, torch.Tensor] | None = None
        if ids.numel() <= HOST_READ_ENTRIES:
            read_ids, read_x, read_weights = self._to_host(ids, x.float(), top_weights.float())
            sums = torch.zeros(read_x.shape, dtype=torch.float32)
            staged, pooled, _ = self._serve_small(
                read_ids.flatten().tolist(), ids.shape[1], read_x, read_weights.flatten().tolist(), sums
            )
            host = (None, sums) if pooled else None
        else:
            first = stream if self.position == 0 else None
            staged, host = self._serve_large(x, ids, top_ids, top_weights, first)
        out = self._resident(x, top_ids, top_weights)
        if staged:
            stage_of = torch.full((len(self.slots),), -1, dtype=torch.long)
            stage_of[list(staged)] = torch.tensor(list(staged.values()))
            out = out + self._staged(x, stage_of.to(x.device, non_blocking=True)[top_ids], top_weights, live)
        if host is not None:
            rows, sums = host
            sums = sums.to(x.device, dtype=x.dtype, non_blocking=True)
            out = out + sums if rows is None else out.index_add(0, rows, sums)
        return out

    def _streams(self, entries: int) -> bool:
        """Whether an eager window of `entries` routed entries (padding rows' too) computes this layer from
        its whole host part streamed ahead (`LayerStream`): from the first tiered layer on for a window of
        STREAM_AT_ONCE entries an expert, from a later one where the first layer started the stream."""
        stream = self.stream
        if stream is None or self.pieces is not None:
            return False
        if self.position == 0:
            return entries >= max(STREAM_AT_ONCE * self.experts, HOST_READ_ENTRIES + 1)
        return stream.active and entries > HOST_READ_ENTRIES

    def _from_stream(
        self,
        stream: LayerStream,
        x: torch.Tensor,
        ids: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
    ) -> torch.Tensor:
        """A streamed window's layer (`LayerStream`): the next layer's copy queued, then every missed entry
        computed from this layer's whole host part on the device; the host reads nothing (the counts of
        entries served stay on the device until `take_counts`)."""
        assert self.host_slot_of is not None
        stream.prefetch(self.position + 1)
        gate_up, down = stream.take(self.position)
        slots = self.host_slot_of[ids]
        misses = (slots >= 0).sum()
        counted = torch.stack([(ids < self.experts).sum() - misses, misses])
        self._streamed = counted if self._streamed is None else self._streamed + counted
        out = self._resident(x, top_ids, top_weights)
        return out + self.kernel(x, slots, top_weights, gate_up, down)

    def _masked(self, top_ids: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """The routing with padding rows' entries (`live` 0) pointing past the experts."""
        return top_ids if live is None else top_ids.masked_fill(live[:, None] == 0, len(self.slots))

    def _captured(
        self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor, live: torch.Tensor | None
    ) -> torch.Tensor:
        """Under a piecewise capture (`pieces`): the resident experts' sum in the graph being captured, then a
        cut. The host step at the cut plans the misses, queues the staging copies and hands the next graph
        each expert's staging slot (the entries of staged experts run there) and the CPU pool's sum. A small
        window talks to its step through the pinned `HostLink` alone (the step launches nothing on the
        device, and waits only for the routing written to the host, not for the resident experts)."""
        assert self.pieces is not None and self.slot_of is not None
        link = self.link
        if link is None or top_ids.numel() > min(HOST_READ_ENTRIES, link.entries):
            return self._captured_large(x, self._masked(top_ids, live), top_ids, top_weights, live)
        rows, width = top_ids.shape
        slots = link.pack(top_ids, top_weights, x, live, self.slot_of)
        out = self._resident(x, top_ids, top_weights, slots)

        done = link.done if link.fns.waits and self.host_finish is not None else None
        if self._small_step is None:
            self._small_step = native_small_step(self, self.host_step, link.entries, SPLIT_ALIGN)
        native = self._small_step

        def step() -> Finish | None:
            link.wait()
            if native is not None:
                staged, pooled, finish = native.serve(*link.addresses(rows, width), done)
            else:
                picks, weights, x_host, sums = link.read(rows, width)
                staged, pooled, finish = self._serve_small(picks, width, x_host, weights, sums, done)
            link.name_staged(staged)
            link.summed_rows = rows if pooled else 0
            return finish

        self.pieces.cut(step)
        staged = None
        if self.staging is not None:
            assert self.staging.gate_up is not None and self.staging.down is not None
            at = link.fns.staged_slots(top_ids, live, link.stage_map())
            staged = self.kernel(x, at, top_weights, self.staging.gate_up, self.staging.down)
        return link.fns.add_parts(out, staged, link.sums(rows), done)

    def _resident(
        self,
        x: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The resident experts' entries through the experts kernel (the others' slot -1: the kernel skips
        them; `slots`: each entry's slot where already looked up); device work only, so a CUDA graph can hold
        it."""
        if not self.resident:
            return torch.zeros_like(x)
        assert self.slot_of is not None and self.gate_up is not None and self.down is not None
        slots = self.slot_of[top_ids] if slots is None else slots
        return self.kernel(x, slots, top_weights, self.gate_up, self.down)

    def _staged(
        self, x: torch.Tensor, staged: torch.Tensor, top_weights: torch.Tensor, live: torch.Tensor | None
    ) -> torch.Tensor:
        """The entries whose experts were copied into staging slots (`staged`: each entry's slot, -1 for the
        others and on padding rows, which the kernel skips) through the experts kernel."""
        assert self.staging is not None and self.staging.gate_up is not None and self.staging.down is not None
        if live is not None:
            staged = staged.masked_fill(live[:, None] == 0, -1)
        return self.kernel(x, staged, top_weights, self.staging.gate_up, self.staging.down)

    def _captured_large(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        live: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_captured` for a window too large to read its routing whole (`_serve_large`): the step fills two
        buffers of the graphs' pool, each expert's staging slot and the CPU pool's sum."""
        assert self.pieces is not None and self.slot_of is not None
        out = self._resident(x, top_ids, top_weights)
        # in the graphs' pool, kept by the step: the same memory at every replay
        stage_of = torch.full_like(self.slot_of, -1)
        host_sum = torch.zeros_like(x)
        cleared = [True, True]  # whether each buffer holds nothing yet (so a step need not clear it again)

        def step() -> None:
            staged, host = self._serve_large(x, ids, top_ids, top_weights)
            if staged or not cleared[0]:
                stage_of.fill_(-1)
            if staged:
                slots = torch.tensor(list(staged.values()))
                stage_of[list(staged)] = slots.to(x.device, non_blocking=True)
            if host is not None or not cleared[1]:
                host_sum.zero_()
            if host is not None:
                rows, sums = host
                host_sum.index_copy_(0, rows, sums.to(x.device, dtype=x.dtype, non_blocking=True))
            cleared[:] = [not staged, host is None]

        self.pieces.cut(step)
        if self.staging is not None:
            out = out + self._staged(x, stage_of[top_ids], top_weights, live)
        return out + host_sum

    def _serve_small(
        self,
        ids: list,
        width: int,
        x: torch.Tensor,
        weights: list[float],
        sums: torch.Tensor,
        done: torch.Tensor | None = None,
    ) -> tuple[dict[int, int], bool, Finish | None]:
        """A small window's misses from its routing read to the host: `ids` its entries row by row (`width`
        a row; integers, or floats holding them), padding rows' entries pointing past the experts, and their
        `weights`; x [rows, hidden] fp32 on the host. The experts with most rows are copied into staging
        slots (queued here) as the costs say (`MissCosts.plan`), the others run now by the CPU pool, their
        sums added into `sums` [rows, hidden] (fp32, host). Returns the staged experts' slots, whether the
        CPU pool ran, and what finishes its run where it still runs (with `done`, the link's word the run
        sets once its sums are in: a background run is then left running), else None; counts where every
        entry was served."""
        experts, slots = len(self.slots), self.slots
        picked: dict[int, list[int]] = {}
        on_device = 0
        for entry, pick in enumerate(ids):
            expert = int(pick)
            if expert >= experts:
                continue
            if slots[expert] >= 0:
                on_device += 1
            else:
                picked.setdefault(expert, []).append(entry)
        self.served[VRAM] += on_device
        if not picked:
            return {}, False, None
        missed = sorted(picked, key=lambda e: (-len(picked[e]), e))  # most rows first, ties in expert order
        counts = [len(picked[e]) for e in missed]
        whole, split = self._copy_plan(counts, share=True)
        on_cpu = sorted(missed[whole:])  # the split expert's first channels among them
        if not on_cpu:
            return self._stage(missed, counts, whole, split), False, None
        entries = [entry for expert in on_cpu for entry in picked[expert]]
        offsets = [0]
        for expert in on_cpu:
            offsets.append(offsets[-1] + len(picked[expert]))
        self.served[CPU] += len(entries)
        if self._pool_args is None:  # a small window has at most HOST_READ_ENTRIES entries
            self._pool_args = PoolArgs(HOST_READ_ENTRIES, len(self.slots))
        hosts, bounds, rows, row_weights = self._pool_args.fill(
            [self.host_of[e] for e in on_cpu],
            offsets,
            [entry // width for entry in entries],
            [weights[entry] for entry in entries],
        )
        read, shared = float(len(on_cpu)), {}
        if split is not None:  # the pool sums the split expert's first channels, the device the others
            expert, channels = missed[split[0]], split[1]
            kept = [channels if e == expert else self.intermediate for e in on_cpu]
            shared = {"channels": self._pool_args.channels(kept)}
            read -= 1 - channels / self.intermediate
        pool_args = (x, hosts, bounds, rows, row_weights, self.host_gate_up, self.host_down)
        host_finish = self.host_finish
        if host_finish is None:  # the copies queued first, to cross PCIe while the pool runs
            staged = self._stage(missed, counts, whole, split)
            began = time.perf_counter()
            self.host_kernel(*pool_args, out=sums, **shared)
            self.observe_pool(read, len(entries), time.perf_counter() - began)
            return staged, True, None
        # the pool started first on its own thread, the copies queued while it runs
        if done is not None:
            shared["done"] = done
        self.host_kernel(*pool_args, out=sums, background=True, **shared)
        try:
            staged = self._stage(missed, counts, whole, split)
        except BaseException:
            host_finish()
            raise

        def finish() -> None:
            self.observe_pool(read, len(entries), host_finish())

        if done is not None:
            return staged, True, finish
        finish()
        return staged, True, None

    def count_served(self, vram: int, cpu: int, pcie: int) -> None:
        """Count routed entries served from VRAM, by the CPU pool and over PCIe (`take_counts`)."""
        self.served[VRAM] += vram
        self.served[CPU] += cpu
        self.served[PCIE] += pcie

    def observe_pool(self, experts: float, entries: int, seconds: float) -> None:
        """Fold a CPU pool run of `experts` experts over `entries` entries that took `seconds` into the
        costs."""
        if self.costs is not None:
            self.costs.observe_cpu(experts, entries, seconds)

    def _copy_plan(self, rows: list[int], share: bool = False) -> tuple[int, tuple[int, int] | None]:
        """How many of a window's missed experts (most rows first, `rows` each) the costs send over PCIe into
        staging slots whole, the first ones; with `share`, also whether the next one is split between the two
        sides (`MissCosts.share`): (its index, the channels the CPU pool sums), else None."""
        if self.staging is None or self.costs is None:
            return 0, None
        copied = min(self.costs.plan(rows, self.pcie_frac), self.staging.slots)
        split = self._split_at(rows, copied) if share else None
        return (copied if split is None else split[0]), split

    def _stage(
        self, missed: list[int], rows: list[int], whole: int, split: tuple[int, int] | None
    ) -> dict[int, int]:
        """Queue the copies `_copy_plan` chose for the `missed` experts (`rows` each): the first `whole` into
        staging slots, and the split one's later channels (`ExpertStaging.load_rest`) where `split` names
        it; returns the slots (expert -> slot) and counts them."""
        if not whole and split is None:
            return {}
        assert self.staging is not None
        hosts = [self.host_of[e] for e in missed[:whole]]
        self.served[PCIE] += sum(rows[:whole])
        events = self.copy_times.start() if self.copy_times is not None else None
        staged = self.staging.load(missed[:whole], hosts, self.host_gate_up, self.host_down) if whole else {}
        copies = float(whole)
        if split is not None:
            expert, channels = missed[split[0]], split[1]
            staged[expert] = self.staging.load_rest(
                self.host_of[expert], channels, self.host_gate_up, self.host_down
            )
            copies += 1 - GATE_UP_SHARE * channels / self.intermediate
        self.pcie_bytes += round(copies * self.expert_bytes())
        if events is not None and self.copy_times is not None:
            self.copy_times.stop(events, copies)
        return staged

    def _split_at(self, rows: list[int], copied: int) -> tuple[int, int] | None:
        """Where `MissCosts.share` splits one of the missed experts (`rows` each, most first) when `plan`
        copies `copied` whole: (its index, the channels the CPU pool sums, a multiple of SPLIT_ALIGN), or
        None. Only plain weights are split (a GGUF block row holds no channel range to zero) and never while a
        share of copies is forced (`pcie_frac`)."""
        if (
            self.costs is None
            or self.staging is None
            or self.pcie_frac is not None
            or self.host_gate_up.dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        shared = self.costs.share(rows, copied)
        if shared is None or shared[0] >= self.staging.slots:  # the whole copies leave the last slot free
            return None
        channels = round(shared[1] * self.intermediate / SPLIT_ALIGN) * SPLIT_ALIGN
        return (shared[0], channels) if 0 < channels < self.intermediate else None

    def _serve_large(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        top_ids: torch.Tensor,
        top_weights: torch.Tensor,
        stream: LayerStream | None = None,
    ) -> tuple[dict[int, int], tuple[torch.Tensor, torch.Tensor] | None]:
        """A large window's misses (`ids`: its routing, padding rows' entries pointing past the experts): its
        entries per expert are counted on the device and only those counts read, then the rows and entries
        the CPU pool computes (its routing is far larger than what the host needs). Split as in
        `_serve_small`; returns the staged experts' slots and the rows the CPU pool computed (on the device)
        with their sums (fp32, on the host), None where the pool had nothing. With `stream` (the first tiered
        layer of an eager window) the stream learns, before any copy, how many host experts missed."""
        experts = len(self.slots)
        counts = torch.zeros(experts + 1, dtype=torch.int64, device=x.device)
        counts.index_add_(0, ids.flatten(), torch.ones_like(ids).flatten())
        on_device, by_rows = 0, []
        for expert, count in enumerate(self._to_host(counts[:experts])[0].tolist()):
            if count and self.slots[expert] >= 0:
                on_device += count
            elif count:
                by_rows.append((count, expert))
        self.served[VRAM] += on_device
        if stream is not None:
            stream.begin(len(by_rows) / (experts - self.resident))
        if not by_rows:
            return {}, None
        by_rows.sort(key=lambda pair: -pair[0])  # most rows first; stable, so ties in expert order
        rows, missed = [count for count, _ in by_rows], [expert for _, expert in by_rows]
        copied = self._copy_plan(rows)[0]
        if copied == len(missed):
            return self._stage(missed, rows, copied, None), None
        # the CPU pool's entries read to the host before the copies are queued (a read waits for every copy
        # queued before it), so that the pool's run overlaps them
        self.served[CPU] += sum(rows[copied:])
        on_cpu = torch.zeros(experts + 1, dtype=torch.bool)
        on_cpu[missed[copied:]] = True
        entries = on_cpu.to(x.device, non_blocking=True)[ids].nonzero()
        rows_needed, local = entries[:, 0].unique(return_inverse=True)
        picked = (entries[:, 0], entries[:, 1])
        x_host, local, entry_ids, entry_weights = self._to_host(
            x[rows_needed], local, top_ids[picked], top_weights[picked]
        )
        staged = self._stage(missed, rows, copied, None)
        return staged, (rows_needed, self._pool(x_host, local, entry_ids, entry_weights))

    @staticmethod
    def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
        """The tensors on the host, after one wait for the device's work so far."""
        copies = [t.to("cpu", non_blocking=True) for t in tensors]
        if tensors[0].device.type == "cuda":
            torch.cuda.current_stream(tensors[0].device).synchronize()
        return copies

    def _pool(
        self, x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Entries (a row of x, an expert in host RAM, a weight) through the CPU pool's kernel (`host_kernel`:
        app/kernels/cpu_experts.py) in one call: their weighted sums per row of x, fp32."""
        order = experts.argsort(stable=True)
        experts, counts = experts[order].unique_consecutive(return_counts=True)
        offsets = torch.zeros(experts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        hosts = self.host_table[experts]
        return self.host_kernel(
            x, hosts, offsets, rows[order], weights[order], self.host_gate_up, self.host_down
        )


def use_expert_tier(
    model: nn.Module,
    resident: int | list[int],
    host_kernel: HostExpertsFn,
    spare: int = 0,
    host_finish: HostFinishFn | None = None,
    host_step: HostStepFactory | None = None,
) -> None:
    """Give the MoE layers of a model built on the meta device (not loaded yet) expert tiers with the first
    `resident` experts on the device (one count for every layer, or one per MoE layer in model order: a
    layer given all its experts keeps them all on the device, untiered), `spare` device slots for
    asynchronous swaps, and `host_kernel` for the others (with `host_finish`, started in the background
    where a window's staging copies are queued meanwhile; with `host_step`, a small window's host step in
    one native call). Call it under the meta device."""
    layers = _routed_layers(model)
    counts = resident if isinstance(resident, list) else [resident] * len(layers)
    if len(counts) != len(layers):
        raise ValueError(f"{len(counts)} resident counts for {len(layers)} MoE layers")
    for module, count in zip(layers, counts, strict=True):
        routed = module.experts
        experts, _, hidden = routed.gate_up.shape
        if count < experts:
            module.experts = TieredExperts(
                experts,
                hidden,
                routed.intermediate,
                routed.kernel,
                count,
                host_kernel,
                spare,
                host_finish,
                host_step,
            )


def _routed_layers(model: nn.Module) -> list[SparseMoE]:
    """The MoE layers whose routed experts have no tier yet, MTP layers included, in model order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE) and isinstance(m.experts, RoutedExperts)]


def moe_layers(model: nn.Module) -> int:
    """How many MoE layers (of routed experts) a model has, MTP layers included."""
    return len(_routed_layers(model))


def decoder_tiers(model: nn.Module) -> list[TieredExperts]:
    """The tiers of a CausalLM's decoder layers, in the order a forward runs them (the MTP head's apart)."""
    return [m for m in model.model.modules() if isinstance(m, TieredExperts)]


def use_staging(
    tiers: list[TieredExperts],
    pcie_frac: float | None = None,
    layers: list[TieredExperts] | None = None,
    keep_free: int = 0,
    link: TierLinkFns | None = None,
) -> MissCosts | None:
    """On a GPU: one staging area for the tiers' missed experts (as many slots as a layer has host slots)
    and this machine's costs (measured now) to split each window's misses between it and the CPU pool.
    `link`: the backends' kernels through which captured small windows hand their routing to the host step
    (`HostLink`; without them such windows take the large windows' way).
    `pcie_frac` forces that share of the missed experts over PCIe. `layers`: the tiers of the decoder's
    layers in the order a forward runs them (default: `tiers`); where the device has room for a second
    staging area beside the first and `keep_free` bytes still to be allocated (the KV pool), large windows
    stream through them (`LayerStream`), unless `pcie_frac` forces a share below 1. Returns the costs (None on
    a CPU: misses run there)."""
    if not tiers or tiers[0].slot_of is None or tiers[0].slot_of.device.type != "cuda":
        return None
    first = min(tiers, key=lambda t: t.resident)  # the one with most experts in host RAM
    device = first.slot_of.device
    staging = ExpertStaging(first.host_gate_up.shape[0])
    staging.allocate(first.host_gate_up, first.host_down, device)
    held = first.experts - first.resident  # host slots with an expert in them (the last one is free)
    costs = measure(first.host_kernel, first.host_gate_up[:held], first.host_down[:held], device)
    host_link = None
    if link is not None:  # rows: hidden, held or not
        host_link = HostLink(HOST_READ_ENTRIES, first.host_down.shape[1], first.experts, link)
    copy_times = CopyTimes(costs)
    for tier in tiers:
        tier.staging, tier.costs, tier.pcie_frac, tier.link = staging, costs, pcie_frac, host_link
        tier.copy_times = copy_times
    layers = tiers if layers is None else layers
    assert staging.gate_up is not None and staging.down is not None
    area = staging.gate_up.nbytes + staging.down.nbytes
    room = torch.cuda.mem_get_info(device)[0] > area + STREAM_HEADROOM + keep_free
    if (pcie_frac is None or pcie_frac >= 1.0) and len(layers) > 1 and room:
        stream = LayerStream(layers, staging)
        for position, tier in enumerate(layers):
            tier.stream, tier.position = stream, position
    return costs
