"""Where a window's missed experts are computed: the CPU pool, or copied over PCIe and run on the device.

An expert the tier holds in host RAM only can be computed where it lies (the CPU pool reads its weights once
and pays per routed row) or copied to a staging slot on the device (its bytes cross PCIe once, however many
rows it serves; the device's compute is small beside the copy). The two run at the same time, so a window's
misses are split between them to make the slower side as fast as it can be: the experts with the most rows
go over PCIe first (their CPU cost grows with rows, their copy does not), the rest stay on the CPU.
`MissCosts` holds the machine's figures, measured at start (`measure`) or described (tests, experiments); the
CPU pool's rate then follows what its runs take while serving (`observe_cpu`), so a figure measured on a busy
host at start corrects itself within a few windows, and so does the link's (`observe_pcie`, the copies timed
on the device by `CopyTimes`): the two read the same host memory at once, and each gets less of it then than
alone, where they were measured at start.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from app.kernels.interface import HostExpertsFn

OBSERVED_WEIGHT = 0.25  # how much one observed CPU pool run moves its rate
GATE_UP_SHARE = 2 / 3  # a SwiGLU expert's bytes in its gate and up rows (2 x inter x hidden of 3)
# A missed expert is split between the two sides only where that makes the slower side faster by this much:
# the split costs a few more copies and two zero fills on the device, and a planning error as large.
SPLIT_GAIN_S = 15e-6
PROBE_EVERY = 64  # plans sending every miss over PCIe before one leaves an expert to the CPU pool, to time it
# Steps of a tier's staging copies a timed one stands for: timing one costs the host step two event records,
# a query and a reading, on the critical path (at one step in four, 17-32 us a tiered layer on average on an
# H100 machine's host: about 60-120 us a timed step), and a decode token has a step at every tiered layer (18
# of q30's 24 at a 25% budget), so the link's rate is still observed about once a token.
TIME_EVERY = 16
CALL_EXPERTS = 8  # experts of the CPU pool call `measure` times beside one expert alone (a token's top-8)


@dataclass
class MissCosts:
    """What one missed expert of `expert_bytes` costs on each side.

    pcie_bytes_s: pinned host-to-device copy rate; cpu_bytes_s: the CPU pool's rate reading an expert's
    weights for one row within a call; cpu_row_s: what each further row adds on the CPU; cpu_call_s: what a
    call of the CPU pool costs whatever its experts (its threads woken, the token vectors read, the sums
    added: on the GPU machine's host one Q4_K expert took 92 us alone and eight 299 us in one call, so a
    rate measured on one expert counted each of eight at three times its cost); cpu_fixed_s: of the CPU
    pool's time for one expert and row within a call, what summing only some of its channels does not shrink
    (each down row's own work however short: `share`).
    """

    expert_bytes: int
    pcie_bytes_s: float
    cpu_bytes_s: float
    cpu_row_s: float
    cpu_fixed_s: float = 0.0
    cpu_call_s: float = 0.0
    unobserved: int = 0  # plans since the CPU pool last ran that sent every missed expert over PCIe

    def observe_cpu(self, experts: float, rows: int, seconds: float) -> None:
        """Fold in a CPU pool call that took `seconds` for `experts` experts over `rows` routed rows in all:
        the rate an expert is read at for one row moves a step towards what the call showed (less its own
        cost, `cpu_call_s`)."""
        if experts <= 0:
            return
        self.unobserved = 0
        per_expert = (seconds - self.cpu_call_s - max(rows - experts, 0) * self.cpu_row_s) / experts
        if per_expert > 0:
            self.cpu_bytes_s += OBSERVED_WEIGHT * (self.expert_bytes / per_expert - self.cpu_bytes_s)

    def observe_pcie(self, experts: float, seconds: float) -> None:
        """Fold in the device time of one step's copies of `experts` experts: the link's rate moves a step
        towards what they showed."""
        if experts > 0 and seconds > 0:
            self.pcie_bytes_s += OBSERVED_WEIGHT * (experts * self.expert_bytes / seconds - self.pcie_bytes_s)

    def pcie_s(self) -> float:
        """Seconds to copy one expert to the device."""
        return self.expert_bytes / self.pcie_bytes_s

    def cpu_s(self, rows: int) -> float:
        """Seconds one expert over `rows` rows adds to a CPU pool call (`cpu_call_s` comes once a call)."""
        return self.expert_bytes / self.cpu_bytes_s + max(rows - 1, 0) * self.cpu_row_s

    def plan(self, rows: list[int], pcie_frac: float | None = None) -> int:
        """How many of the missed experts, taken in order of most rows first, go over PCIe.

        `rows` is each missed expert's routed rows, sorted descending; the split makes max(copy time, CPU
        time) smallest. `pcie_frac` forces that share of the experts (rounded) over PCIe instead. A CPU rate
        measured too low would never be corrected by observed runs, so every PROBE_EVERY-th plan that would
        send everything over PCIe leaves the expert with fewest rows to the CPU pool.
        """
        if pcie_frac is not None:
            return round(pcie_frac * len(rows))
        base, per_row, copy = self.expert_bytes / self.cpu_bytes_s, self.cpu_row_s, self.pcie_s()
        cpu_left = base * len(rows) + per_row * (sum(rows) - len(rows))
        best, best_s = 0, self.cpu_call_s + cpu_left
        for taken, r in enumerate(rows, start=1):
            cpu_left -= base + per_row * (r - 1)
            seconds = max(taken * copy, cpu_left + (self.cpu_call_s if taken < len(rows) else 0.0))
            if seconds < best_s:
                best, best_s = taken, seconds
        if best == len(rows) > 1:
            self.unobserved += 1
            if self.unobserved >= PROBE_EVERY:
                self.unobserved = 0
                return best - 1
        return best

    def share(self, rows: list[int], copied: int) -> tuple[int, float] | None:
        """Whether to split one missed expert between the two sides, given `rows` (each missed expert's
        routed rows, sorted descending) and the `copied` experts `plan` sends over PCIe: (i, f) where the
        experts before i are copied whole, those after it stay with the CPU pool, and expert i's first f of
        its intermediate channels are summed by the CPU pool, the rest on the device from a copy of their
        gate and up rows and the whole down matrix; None where no split beats `plan` by SPLIT_GAIN_S.

        One miss read by one side leaves the other idle (q30's expert: 164 us on the CPU pool, 188 us over
        PCIe, where both together read the host's memory nearly twice as fast), so the expert at the
        boundary is shared: the CPU pool's part costs `cpu_fixed_s` and f of the rest of its time, the copy
        GATE_UP_SHARE x (1 - f) of the gate and up rows plus all of the down matrix (its columns are not
        contiguous in host RAM).
        """
        base, per_row, copy, call = (
            self.expert_bytes / self.cpu_bytes_s,
            self.cpu_row_s,
            self.pcie_s(),
            self.cpu_call_s,
        )
        left = base * (len(rows) - copied) + per_row * (sum(rows[copied:]) - len(rows) + copied)
        best, best_s = None, max(copied * copy, left + (call if copied < len(rows) else 0.0)) - SPLIT_GAIN_S
        # the expert split: the last one copied whole, or the first one left to the CPU pool (which then runs,
        # so its call's cost comes in either way)
        for split in (copied - 1, copied):
            if not 0 <= split < len(rows):
                continue
            own = base + per_row * (rows[split] - 1)
            before, after = split * copy, call + left - (own if split == copied else 0.0)
            fixed = min(self.cpu_fixed_s, own)
            # the two sides even: before + copy * (1 - GATE_UP_SHARE * f) = after + fixed + (own - fixed) * f
            f = (before + copy - after - fixed) / (own - fixed + GATE_UP_SHARE * copy)
            seconds = before + copy * (1 - GATE_UP_SHARE * f)
            if 0 < f < 1 and seconds < best_s:
                best, best_s = (split, f), seconds
        return best


class CopyTimes:
    """The device time of the staging copies of every `every`-th host step, read without waiting for them:
    events on the stream before and after that step's copies (`start`, `stop`), folded into the costs' link
    rate (`MissCosts.observe_pcie`) at a later timed step (`poll`, from `stop`, once that step's copies are
    queued) once the device has run them. At most `most` steps' events wait to be read (the device that far
    behind, the oldest are dropped unread)."""

    def __init__(self, costs: MissCosts, most: int = 8, every: int = TIME_EVERY) -> None:
        self.costs = costs
        self.most = most
        self.every, self._steps = every, 0
        self._pending: deque[tuple[float, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """On a step to time, mark the stream before the step's copies; returns the events to hand to `stop`
        or `cancel` (None on the other steps: nothing recorded)."""
        self._steps += 1
        if self._steps % self.every:
            return None
        events = self._spare.pop() if self._spare else _timing_events()
        events[0].record()
        return events

    def stop(self, events: tuple[torch.cuda.Event, torch.cuda.Event], experts: float) -> None:
        """Mark the stream after a step's copies of `experts` experts' bytes (`events` from `start`), then
        read the copies that have run."""
        events[1].record()
        self._pending.append((experts, *events))
        if len(self._pending) > self.most:
            self._pending.popleft()
        self.poll()

    def cancel(self, events: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        """A step marked by `start` queued no copies after all: its events are kept for another."""
        self._spare.append(events)

    def poll(self) -> None:
        """Fold in every timed step whose copies the device has run, oldest first."""
        while self._pending and self._pending[0][2].query():
            experts, began, ended = self._pending.popleft()
            self.costs.observe_pcie(experts, began.elapsed_time(ended) / 1e3)
            self._spare.append((began, ended))


def _timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def measure(
    host_kernel: HostExpertsFn,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    device: torch.device,
    rows: int = 32,
) -> MissCosts:
    """This machine's costs for experts like `gate_up` [experts, ...] / `down` (pinned, in host RAM): a
    pinned copy of a few experts to `device`, and the CPU pool's kernel over 1 and `rows` rows of one expert
    and over one row of CALL_EXPERTS experts in one call (the best of three, each on experts not touched
    before: their weights come from RAM, not a cache). A few tens of ms."""
    expert_bytes = gate_up[0].nbytes + down[0].nbytes
    experts = gate_up.shape[0]
    count = min(4, experts)
    target = torch.empty((count, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
    target.copy_(gate_up[:count], non_blocking=True)  # first use of the copy path
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    target.copy_(gate_up[:count], non_blocking=True)
    torch.cuda.synchronize(device)
    pcie_bytes_s = gate_up[0].nbytes * count / (time.perf_counter() - began)
    x = torch.randn(rows, down.shape[1])  # down's rows: the hidden size, also of weights held as blocks

    def run(first: int, count: int, experts_run: int = 1, **channels: torch.Tensor) -> float:
        """One call: `experts_run` experts from host slot `first` down, the first over `count` rows, each
        further one over the first row."""
        picked = torch.tensor([(first - e) % experts for e in range(experts_run)])
        offsets = torch.tensor([0] + [count + e for e in range(experts_run)])
        routed = torch.cat([torch.arange(count), torch.zeros(experts_run - 1, dtype=torch.int64)])
        began = time.perf_counter()
        host_kernel(x, picked, offsets, routed, torch.ones(routed.numel()), gate_up, down, **channels)
        return time.perf_counter() - began

    run(experts - 1, 1)  # first use (threads started)
    # one row; `rows` rows; CALL_EXPERTS experts a row each in one call; (plain weights, which the pool can
    # split) one row over half the channels
    runs: list[tuple[int, int, dict[str, torch.Tensor]]] = [(1, 1, {}), (rows, 1, {})]
    runs.append((1, min(CALL_EXPERTS, experts), {}))
    if gate_up.dtype in (torch.float32, torch.bfloat16):
        runs.append((1, 1, {"channels": torch.tensor([down.shape[2] // 2])}))
    timings, first = [], experts - 2
    for count, experts_run, channels in runs:
        # the best of three, each on experts not read before (from RAM)
        tries = []
        for _ in range(3):
            tries.append(run(first, count, experts_run, **channels))
            first -= experts_run
        timings.append(min(tries))
    per_expert, per_row, fixed, call = pool_costs(
        *timings[:3], timings[3] if len(timings) > 3 else None, rows, runs[2][1]
    )
    return MissCosts(
        expert_bytes=expert_bytes,
        pcie_bytes_s=pcie_bytes_s,
        cpu_bytes_s=expert_bytes / per_expert,
        cpu_row_s=per_row,
        cpu_fixed_s=fixed,
        cpu_call_s=call,
    )


def pool_costs(
    one: float, many: float, several: float, half: float | None, rows: int, experts: int
) -> tuple[float, float, float, float]:
    """The CPU pool's costs from its timings (seconds): one expert over one row alone (`one`), over `rows`
    rows (`many`), `experts` experts a row each in one call (`several`), one expert and row over half its
    channels (`half`; None where not timed). Returns what an expert adds to a call, what each further row
    adds, the part of an expert's time half its channels do not shrink, and a call's own cost."""
    # one expert alone costs a call and an expert; each further one in the call, an expert
    per_expert = (several - one) / (experts - 1) if experts > 1 else one
    per_expert = min(max(per_expert, one / 4), one)
    call = one - per_expert
    # half the channels alone: a call, the part that does not shrink, and half the rest
    fixed = min(max(2 * half - one - call, 0.0), per_expert) if half is not None else 0.0
    return per_expert, max(many - one, 0.0) / (rows - 1), fixed, call
