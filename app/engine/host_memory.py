"""Handing the C heap's free memory back to the operating system.

Parked conversations live in host RAM for minutes while windows allocate and free short-lived tensors around
them; when a parked block is evicted, the free space it leaves sits between live allocations, and glibc's
allocator keeps such pages (only the heap's top is returned by itself). `malloc_trim(0)` returns every free
page. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_EVERY_S = 5.0  # at most this often: a trim walks the whole heap (a few ms for a large one)


def _trim_function() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


class HeapTrimmer:
    """Returns the heap's free pages to the OS when asked, at most once every TRIM_EVERY_S seconds."""

    def __init__(self) -> None:
        self._trim = _trim_function()
        self._last = 0.0
        self.trims = 0

    def after_frees(self) -> None:
        """Call after freeing long-lived memory (evicted parked conversations)."""
        now = time.monotonic()
        if self._trim is None or now - self._last < TRIM_EVERY_S:
            return
        self._last = now
        self._trim(0)
        self.trims += 1
