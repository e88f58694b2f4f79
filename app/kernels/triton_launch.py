"""Programmatic dependent launch: a Triton kernel's programs are placed on the SMs while the kernel before
it on the stream is still finishing, instead of after it has drained.

On Hopper and later (compute capability 9+) the kernels of the Triton set are launched with CUDA's
programmatic stream serialisation (`launch_pdl`), inside CUDA graphs too. Such a launch may begin before its
predecessor ends, so each kernel's first statement is `follow_previous`: it waits (`griddepcontrol.wait`)
until the kernel before it on the stream has finished and its writes are visible, and only then reads or
writes memory; it then lets the kernel after it be placed. A kernel therefore never overlaps the memory work
of the one before it, and ordering stays transitive: every kernel waits for its predecessor's end, which
came after that one's own wait. What is saved is the gap between kernels: the launch of the next kernel's
programs, hidden behind the tail of the current one. Kernels of other libraries (cuBLAS, torch) are launched
as usual and wait for everything before them.

Only grids of up to WAVES programs per SM launch so: the kernels of a long prompt last long enough that no
gap is worth hiding, and on an H200 an 8K prompt of q30-half read at 79,600-82,900 tok/s with every grid
dependent, 84,800 with none and 87,700 with this limit (decode windows keep their gain). `STRATA_PDL=0` turns
it off (for measurements); the interpreter and older GPUs never use it.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def follow_previous(PDL: tl.constexpr):
    """Wait for the kernel before this one on the stream to finish (its writes visible), then let the next
    kernel's programs be placed. The first statement of every kernel launched with `pdl`."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


WAVES = 8  # the most programs per SM of a grid launched dependently


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch dependently: Hopper or later, unless `STRATA_PDL=0`."""
    if device.type != "cuda" or os.environ.get("STRATA_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _dependent_programs(device: torch.device) -> int:
    """The most programs a grid on `device` may have to launch dependently (0: never)."""
    if not dependent_launch(device):
        return 0
    return WAVES * torch.cuda.get_device_properties(device).multi_processor_count


def pdl(device: torch.device, grid: tuple[int, ...]) -> dict[str, bool]:
    """The launch arguments of a kernel that starts with `follow_previous`, for tensors on `device`."""
    on = math.prod(grid) <= _dependent_programs(device)
    return {"PDL": on, "launch_pdl": on}
