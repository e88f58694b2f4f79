"""Parallel loading: tensors' bytes read from their files by several threads, straight into their places.

Each worker thread takes chunks of the queued tensors and reads them with `pread` (no page faults of a
mapping, the GIL released while the kernel copies from the page cache). A chunk whose place is host memory in
the file's dtype is read into it directly; one bound for a GPU is read into the worker's pinned staging
buffers (two, in turn) and copied to the card on the worker's own stream, so reading the next chunk overlaps
the copy of the last; a chunk that changes dtype is read into staging and converted by the copy.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_BYTES = 16 << 20  # a read: small enough to spread a tensor over the workers, large enough to stream
MAX_WORKERS = 8


@dataclass(frozen=True)
class Extent:
    """Where one tensor's bytes lie: `nbytes` at `offset` in `path`, holding `dtype` values of `shape`."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Chunk:
    extent: Extent
    dest: torch.Tensor  # the whole destination, flat
    first: int  # the chunk's first element
    count: int  # its elements


def worker_count() -> int:
    """Threads to read with: the host's cores, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class ParallelFill:
    """Queue (extent, destination) pairs with `add`, then `run` copies them all with `workers` threads.

    A destination is a contiguous tensor of the extent's shape, on the host (pinned or not) or on a GPU, in
    the extent's dtype or another (the copy converts, as `Tensor.copy_` does).
    """

    def __init__(self, workers: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.workers = workers or worker_count()
        self.chunk_bytes = chunk_bytes
        self._chunks: list[_Chunk] = []
        self.nbytes = 0  # bytes queued

    def add(self, extent: Extent, dest: torch.Tensor) -> None:
        """Queue `dest` to be filled from `extent`."""
        if tuple(dest.shape) != extent.shape or not dest.is_contiguous():
            raise ValueError(f"a fill needs a contiguous destination of shape {extent.shape}")
        item = extent.dtype.itemsize
        per_chunk = max(1, self.chunk_bytes // item)
        flat, total = dest.view(-1), extent.nbytes // item
        for first in range(0, total, per_chunk):
            self._chunks.append(_Chunk(extent, flat, first, min(per_chunk, total - first)))
        self.nbytes += extent.nbytes

    def run(self, advance: Callable[[int], None] | None = None) -> None:
        """Fill every queued destination; `advance(bytes)` is called (from the workers) as chunks land.
        Raises the first error a worker met (an OSError from a read, a short file)."""
        chunks: queue.SimpleQueue[_Chunk] = queue.SimpleQueue()
        for chunk in self._chunks:
            chunks.put(chunk)
        self._chunks = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def report(nbytes: int) -> None:
            if advance is not None:
                with lock:
                    advance(nbytes)

        threads = [
            threading.Thread(
                target=_Worker(self.chunk_bytes).drain, args=(chunks, report, errors), daemon=True
            )
            for _ in range(min(self.workers, chunks.qsize()))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.nbytes = 0
        if errors:
            raise errors[0]


class _Worker:
    """One thread's files, staging buffers and stream."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.files: dict[Path, int] = {}
        self.staging: list[torch.Tensor] = []
        self.landed: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.stream: torch.cuda.Stream | None = None

    def drain(
        self, chunks: queue.SimpleQueue[_Chunk], report: Callable[[int], None], errors: list[BaseException]
    ) -> None:
        """Fill chunks until none is left or another worker failed."""
        try:
            while not errors:
                try:
                    chunk = chunks.get_nowait()
                except queue.Empty:
                    break
                self._fill(chunk)
                report(chunk.count * chunk.extent.dtype.itemsize)
            if self.stream is not None:
                self.stream.synchronize()
        except BaseException as e:  # handed to `run`, which raises it
            errors.append(e)
        finally:
            for fd in self.files.values():
                os.close(fd)

    def _fill(self, chunk: _Chunk) -> None:
        extent, item = chunk.extent, chunk.extent.dtype.itemsize
        offset, nbytes = extent.offset + chunk.first * item, chunk.count * item
        place = chunk.dest[chunk.first : chunk.first + chunk.count]
        if place.device.type == "cpu" and place.dtype == extent.dtype:
            self._read(extent.path, offset, place.view(torch.uint8))
            return
        staging = self._staging(place.device)
        raw = staging[:nbytes]
        self._read(extent.path, offset, raw)
        values = raw.view(extent.dtype)
        if place.device.type == "cpu":
            place.copy_(values)
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            place.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.landed[self.turn] = event
        self.turn ^= 1

    def _staging(self, device: torch.device) -> torch.Tensor:
        """This turn's staging buffer, once its last copy has landed (pinned for a GPU, allocated at first
        use)."""
        if device.type == "cuda" and self.stream is None:  # pinned from the first chunk bound for a GPU
            self.stream = torch.cuda.Stream(device)
            self.staging = []
        if not self.staging:
            pin = self.stream is not None
            self.staging = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)
            ]
        event = self.landed[self.turn]
        if event is not None:
            event.synchronize()
            self.landed[self.turn] = None
        return self.staging[self.turn]

    def _read(self, path: Path, offset: int, into: torch.Tensor) -> None:
        """Read `into.numel()` bytes at `offset` of `path` into `into` (host memory)."""
        fd = self.files.get(path)
        if fd is None:
            fd = self.files[path] = os.open(path, os.O_RDONLY)
        view = memoryview(into.numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"{path} ends before byte {offset + len(view)}")
            done += got
