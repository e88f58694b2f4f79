"""Host-to-device copies queued through the CUDA driver: the expert tier's staging copies, a few a layer in
every decode window, where torch's own work a copy took about a fifth of a tiered layer's host step."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence

import torch


class PinnedCopies:
    """Copies of runs of elements from a contiguous host tensor (pinned, so they run at the link's full
    speed) into a contiguous device tensor, queued on the current stream straight through the CUDA driver
    (`cuMemcpyHtoDAsync`): a few microseconds a copy, where torch's `copy_` between two slices takes about
    ten (its slicing, dispatch and pinned-memory lookup). On the CPU, where the driver's entry point is not
    found, or with STRATA_DRIVER_COPIES=0, torch copies them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copy = _driver_copy() if device.type == "cuda" else None

    def address(self) -> int | None:
        """The address of the driver's copy function these copies go through (a native caller queues its own
        through it), or None where torch copies them."""
        return None if self._copy is None else ctypes.cast(self._copy, ctypes.c_void_p).value

    def queue(self, *jobs: tuple[torch.Tensor, torch.Tensor, Sequence[tuple[int, int, int]]]) -> None:
        """For each job (target, source, runs), each run (target offset, source offset, elements) copies
        those elements of `source` (flattened) to `target` (flattened), in order, behind the work queued."""
        if self._copy is None:
            for target, source, runs in jobs:
                flat_target, flat_source = target.view(-1), source.view(-1)
                for at, start, count in runs:
                    flat_target[at : at + count].copy_(flat_source[start : start + count], non_blocking=True)
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for target, source, runs in jobs:
            size = target.element_size()
            if not (target.is_contiguous() and source.is_contiguous()) or source.element_size() != size:
                raise ValueError("pinned copies need contiguous tensors of one element size")
            if source.is_cuda or not target.is_cuda:
                raise ValueError("pinned copies go from host memory to the device")
            to, start_of = target.data_ptr(), source.data_ptr()
            room, held = target.numel(), source.numel()
            for at, start, count in runs:
                if at < 0 or start < 0 or count < 0 or at + count > room or start + count > held:
                    raise ValueError(f"a copy of {count} elements from {start} to {at} leaves its tensors")
                result = self._copy(to + at * size, start_of + start * size, count * size, stream)
                if result:
                    raise RuntimeError(f"queueing a host-to-device copy failed (CUDA driver error {result})")


def _driver_copy() -> Callable[[int, int, int, int], int] | None:
    """The driver's cuMemcpyHtoDAsync (destination, host source, bytes, stream) through ctypes, or None (also
    with STRATA_DRIVER_COPIES=0: torch's copies, as before the driver's were used)."""
    if os.environ.get("STRATA_DRIVER_COPIES", "1") == "0":
        return None
    try:
        from torch.cuda._utils import _get_gpu_runtime_library

        function = _get_gpu_runtime_library().cuMemcpyHtoDAsync_v2
    except (ImportError, AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function
