"""KV blocks beyond a VRAM budget (`--kv-resident TOKENS`): kept in host RAM, streamed in for attention.

The pool's blocks are numbered as the scheduler numbers them. The first `resident` live on the device, the
rest in (pinned) host RAM, each in one place. The device holds, in one flat tensor of blocks, every attention
layer's resident blocks and the scratch block (layer after layer), then two staging areas of one layer each.
A layer's cache is the flat tensor from its own blocks on, so that its staging areas lie inside it, at a
distance that depends on the layer: a batch's block table and slot mapping name a host block by its place in
the staging area (`place`, as a negative number), and `shifted` turns that into the layer's index.

Attention layers run in order; when layer i asks for its cache (`StreamedKV.ready`), the host blocks the batch
reads are copied into staging area i % 2 for layer i + 1 (a layer ahead, on a side stream on a GPU), after the
blocks layer i - 1 wrote there (its new rows) went back to their homes. Layer i waits only for its own copy.
`settle` sends the last layer's writes home; whatever reads or writes host blocks from the host side settles
first. A batch that reads no host block has no plan and runs as if the pool were all on the device (CUDA
graphs included).

A layer's copies are one copy of keys and one of values a run of consecutive blocks; on a GPU, where a plan's
blocks make more than `RUNS_PER_KERNEL` runs, one kernel a layer copies them all instead, reading and writing
pinned host RAM in place (app/kernels/triton_blocks.py; `STRATA_KV_GATHER=0` keeps the copies, to compare).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from app.engine.transfer import device_tensor

RUNS_PER_KERNEL = 4  # a plan's blocks in more runs than this are copied by a kernel a layer on a GPU


@dataclass(eq=False)
class StreamPlan:
    """One batch's host blocks: `homes` their places in host RAM (sorted; staged in this order, so staging
    place j holds homes[j]) and `written` the staging places of those its rows write into."""

    homes: torch.Tensor
    written: torch.Tensor
    started: bool = False
    # worked out once for all the layers: the runs of the copies in and back, or the ids of the kernel's pairs
    copied: dict[str, object] = field(default_factory=dict)


def _runs(sources: torch.Tensor, targets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(source, target, count) runs in which both indices go up by one, covering the pairs in order."""
    if sources.numel() == 0:
        return []
    breaks = ((sources[1:] - sources[:-1] != 1) | (targets[1:] - targets[:-1] != 1)).nonzero().flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], sources.numel()]
    firsts, seconds = sources[starts].tolist(), targets[starts].tolist()
    return [(a, b, end - start) for a, b, start, end in zip(firsts, seconds, starts, ends, strict=True)]


class StreamedKV:
    """Keys and values of `layers` attention layers over `blocks` blocks, of which the first `resident` (and
    the scratch block, numbered `resident` on the device) live on `device` and the others in host RAM."""

    def __init__(
        self,
        layers: int,
        blocks: int,
        resident: int,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.resident = resident
        self.span = resident + 1  # a layer's blocks on the device: the resident ones and the scratch block
        self.staging = blocks - resident  # each area holds every host block, the most a batch reads
        self.device = device
        flat = (layers * self.span + 2 * self.staging, *row_shape)
        self.flat = [torch.zeros(flat, dtype=dtype, device=device) for _ in range(2)]
        self.on_device = [f[: layers * self.span].view(layers, self.span, *row_shape) for f in self.flat]
        gpu = device.type == "cuda"
        self.homes = [
            torch.zeros((layers, self.staging, *row_shape), dtype=dtype, pin_memory=gpu) for _ in range(2)
        ]
        self.copies = torch.cuda.Stream(device) if gpu else None
        self._fetched: list[torch.cuda.Event | None] = [None] * layers
        self._open: StreamPlan | None = None
        self._last = -1  # the last layer of the open plan that asked for its cache

    @property
    def host_bytes(self) -> int:
        """Host RAM the blocks beyond the device take."""
        return sum(h.nbytes for h in self.homes)

    # Placing a batch ---------------------------------------------------------------------------------

    def place(self, tables: torch.Tensor) -> tuple[torch.Tensor, StreamPlan | None]:
        """A batch's block tables [seqs, width] in the scheduler's block numbers (-1: padding) as the device
        reads them: resident blocks as they are, padding as the scratch block, a host block as -1 - its
        staging place (`shifted`); with the batch's plan, or None when it reads no host block."""
        placed = tables.numpy().copy()  # numpy: one sort, several times faster than torch's at this size
        host = placed >= self.resident
        placed[placed < 0] = self.resident
        if not host.any():
            return torch.from_numpy(placed), None
        homes, places = np.unique(placed[host], return_inverse=True)
        placed[host] = -1 - places
        return torch.from_numpy(placed), StreamPlan(torch.from_numpy(homes - self.resident), torch.empty(0))

    def place_slots(self, slots: torch.Tensor, block_size: int, plan: StreamPlan | None) -> torch.Tensor:
        """A batch's slot mapping [rows] in the scheduler's block numbers (a negative block: the scratch
        block) as the device writes it: a row of a host block as -1 - (staging place * block_size + offset);
        the plan learns which staging places are written."""
        blocks = slots.div(block_size, rounding_mode="floor")
        offsets = slots - blocks * block_size
        slots = torch.where(blocks < 0, self.resident * block_size + offsets, slots)
        host = blocks >= self.resident
        if plan is None or not bool(host.any()):
            return slots
        places = torch.searchsorted(plan.homes, blocks[host] - self.resident)
        slots[host] = -1 - (places * block_size + offsets[host])
        plan.written = torch.unique(places)
        return slots

    # Running a batch ---------------------------------------------------------------------------------

    def ready(self, layer: int, plan: StreamPlan) -> int:
        """Make `layer`'s staging area hold the plan's host blocks (and start the next layer's copy); the
        shift that turns a staging place into an index of the layer's cache (`cache`)."""
        if plan is self._open and layer == self._last:  # asked again (a fused step that declined)
            return self._area(layer) - layer * self.span
        if plan is not self._open:
            self.settle()
            self._open, self._last = plan, -1
            self._fetch(plan, layer)
        if layer != self._last + 1 and self._last >= 0:
            raise RuntimeError(f"attention layer {layer} asked for its cache after layer {self._last}")
        self._after_compute()
        if self._last >= 0:
            self._write_home(plan, self._last)
        if layer + 1 < self.layers:
            self._fetch(plan, layer + 1)
        self._last = layer
        event = self._fetched[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return self._area(layer) - layer * self.span

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values: the flat tensors from its resident blocks on (staging included)."""
        start = layer * self.span
        return self.flat[0][start:], self.flat[1][start:]

    def settle(self) -> None:
        """Send the open plan's last written blocks home; nothing is left in flight to a host block."""
        plan = self._open
        if plan is None:
            return
        self._after_compute()
        if self._last >= 0:
            self._write_home(plan, self._last)
        self._open = None

    def host_side(self) -> None:
        """Settle and wait for every copy to and from host RAM and for the device (before host blocks are
        read or written outside a batch, by the host too)."""
        self.settle()
        if self.copies is not None:
            self.copies.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks (the scheduler's numbers) over others in order, in every layer. Copies between the
        device and host RAM are queued in the device's order, after what it was asked to do before (streamed
        batches' copies included) and before what comes next: each stretch of pairs going the same way one
        copy a layer a run of consecutive pairs, or on a GPU one block-copy kernel a layer where the runs are
        many (`by_kernel`); a copy within host RAM is made by the host once the device is done."""
        if not pairs:
            return
        self.settle()
        if self.copies is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copies)
        sources, targets = torch.tensor(pairs).T
        way = 2 * (sources >= self.resident) + (targets >= self.resident)  # 1: to host, 2: to the device
        start = 0
        for end in [*(way[1:] != way[:-1]).nonzero().flatten().add(1).tolist(), len(pairs)]:
            if int(way[start]) in (1, 2):  # a stretch one way across: no block in it is both read and written
                self._across(sources[start:end], targets[start:end], to_host=int(way[start]) == 1)
            else:  # within one place: one block at a time, in order
                for source, target in pairs[start:end]:
                    if source >= self.resident:
                        self.host_side()
                    self._copy_run(source, target, 1)
            start = end

    def _across(self, sources: torch.Tensor, targets: torch.Tensor, to_host: bool) -> None:
        """Copy blocks from the device to host RAM (`to_host`) or back: a copy a layer a run, or the
        kernel."""
        runs = _runs(sources, targets)
        if not by_kernel(self.device, len(runs)):
            for first, second, count in runs:
                self._copy_run(first, second, count)
            return
        from app.kernels.triton_blocks import copy_blocks  # triton: only where a GPU is

        on_host = (targets if to_host else sources) - self.resident
        ids = (sources, on_host) if to_host else (on_host, targets)
        source_ids, target_ids = (device_tensor(t.tolist(), torch.int32, self.device) for t in ids)
        for layer in range(self.layers):
            device = tuple(t[layer] for t in self.on_device)
            host = tuple(t[layer] for t in self.homes)
            ends = (device, host) if to_host else (host, device)
            copy_blocks(*ends, source_ids, target_ids)

    def _blocks(self, kind: int, layer: int, block: int, count: int) -> torch.Tensor:
        """`count` blocks of one layer's keys (kind 0) or values (1) from `block` on, where they live."""
        if block < self.resident:
            return self.on_device[kind][layer, block : block + count]
        home = block - self.resident
        return self.homes[kind][layer, home : home + count]

    def _copy_run(self, source: int, target: int, count: int) -> None:
        for layer in range(self.layers):
            for kind in (0, 1):
                to, of = self._blocks(kind, layer, target, count), self._blocks(kind, layer, source, count)
                to.copy_(of, non_blocking=True)

    def _area(self, layer: int) -> int:
        """The flat index of the staging area `layer` uses."""
        return self.layers * self.span + (layer % 2) * self.staging

    def _after_compute(self) -> None:
        """Order the copies after what the device has been asked to compute so far."""
        if self.copies is not None:
            self.copies.wait_stream(torch.cuda.current_stream(self.device))

    def _fetch(self, plan: StreamPlan, layer: int) -> None:
        """Copy the plan's host blocks of `layer` into its staging area (on the side stream on a GPU)."""
        area = self._area(layer)
        if not plan.started:  # the batches before may still read the staging areas
            self._after_compute()
        with torch.cuda.stream(self.copies) if self.copies is not None else nullcontext():
            self._copy(plan, "in", layer, plan.homes, torch.arange(plan.homes.numel()), area, home_side=True)
            if self.copies is not None:
                event = torch.cuda.Event()
                event.record(self.copies)
                self._fetched[layer] = event
        plan.started = True

    def _write_home(self, plan: StreamPlan, layer: int) -> None:
        """Copy the staging places `layer` wrote back to their homes."""
        if plan.written.numel() == 0:
            return
        area = self._area(layer)
        with torch.cuda.stream(self.copies) if self.copies is not None else nullcontext():
            self._copy(plan, "back", layer, plan.written, plan.homes[plan.written], area, home_side=False)

    def _copy(
        self,
        plan: StreamPlan,
        way: str,
        layer: int,
        sources: torch.Tensor,
        targets: torch.Tensor,
        area: int,
        home_side: bool,
    ) -> None:
        """Copy one layer's blocks, keys and values: homes `sources` to staging places `targets` of the area
        at flat index `area` (`home_side`), or staging places to homes."""
        copied = plan.copied.get(way)
        if copied is None:
            copied = _runs(sources, targets)
            if by_kernel(self.device, len(copied)):
                copied = tuple(
                    device_tensor(t.tolist(), torch.int32, self.device) for t in (sources, targets)
                )
            plan.copied[way] = copied
        staging = [f[area : area + self.staging] for f in self.flat]
        homes = [h[layer] for h in self.homes]
        ends = (homes, staging) if home_side else (staging, homes)
        if isinstance(copied, tuple):
            from app.kernels.triton_blocks import copy_blocks  # triton: only where a GPU is

            copy_blocks(tuple(ends[0]), tuple(ends[1]), *copied)
            return
        for first, second, count in copied:
            for source, target in zip(*ends, strict=True):
                target[second : second + count].copy_(source[first : first + count], non_blocking=True)


def by_kernel(device: torch.device, runs: int) -> bool:
    """Whether a layer's blocks in `runs` runs are copied by the block-copy kernel: on a GPU, beyond
    `RUNS_PER_KERNEL` runs (`STRATA_KV_GATHER=0`: never)."""
    gathers = os.environ.get("STRATA_KV_GATHER", "1") != "0"
    return runs > RUNS_PER_KERNEL and device.type == "cuda" and gathers


def shifted(index: torch.Tensor, shift: int) -> torch.Tensor:
    """A placed table or slot mapping (`StreamedKV.place`) with its host entries (-1 - place) made indices
    `shift` on (for a slot mapping, `shift` in rows)."""
    return torch.where(index < 0, shift - 1 - index, index)
