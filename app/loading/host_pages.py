"""Host memory that the loader's threads fill first and CUDA pins after: the expert tier's experts in RAM.

Pinning before filling costs twice: torch's pinned allocator rounds a tensor up to a power of two and touches
or page-locks every page from one call, so on the H200 machine 11 GiB of experts took 4.5 s to allocate before
a byte was read. Here the memory is an anonymous mapping (huge pages asked for) that nobody touches until the
loader's threads read the file into it, faulting its pages in in parallel as part of the read; `pin` then
registers the filled pages with CUDA (`cudaHostRegister`), which takes a fraction of that, and unregisters
them when the memory goes away.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

PIN_THREADS = 4


class _Mapping(mmap.mmap):
    """An anonymous mapping that weak references can follow (its unregistering waits on its end)."""


class HostPages:
    """`tensor`: host memory of `shape` and `dtype` in a mapping of its own, unpinned and untouched until
    filled; `pin` page-locks it for asynchronous copies to a GPU."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        self._mapping = _Mapping(-1, max(nbytes, 1))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self.nbytes = nbytes
        if nbytes:
            raw = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            self.tensor = raw.view(dtype).view(*shape)
        else:
            self.tensor = torch.empty(tuple(shape), dtype=dtype)
        self.pinned = False

    def pin(self) -> None:
        """Register the pages with CUDA (once); they are unregistered when the mapping is freed, after the
        last tensor viewing it."""
        if self.pinned or not self.nbytes:
            return
        cudart = torch.cuda.cudart()
        pointer = self.tensor.data_ptr()
        error = cudart.cudaHostRegister(pointer, self.nbytes, 0)
        if error != cudart.cudaError.success:
            raise RuntimeError(f"pinning {self.nbytes} bytes of host memory failed: {error}")
        weakref.finalize(self._mapping, cudart.cudaHostUnregister, pointer)
        self.pinned = True


def pin_all(pages: Sequence[HostPages], threads: int = PIN_THREADS) -> None:
    """Pin every one of `pages`, several at a time."""
    if len(pages) <= 1:
        for page in pages:
            page.pin()
        return
    with ThreadPoolExecutor(min(threads, len(pages))) as pool:
        list(pool.map(HostPages.pin, pages))
