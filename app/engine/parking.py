"""Parked conversations: a finished turn's KV blocks and recurrent state in pinned host RAM and on disk.

When a request ends, its state (the keys and values of every position it holds, and on hybrid models the
Gated DeltaNet state of its slot) is gathered on the device; the park's worker thread copies it to pinned
host memory and writes its file while windows go on, so that a follow-up turn can continue from it even after
the device's prefix cache has reused those blocks. Full blocks are kept by chain hash and shared between
parked conversations: parking a conversation again copies only its new blocks. RAM holds up to `ram_budget`
bytes, least recently used first out; with a directory, every parked conversation is also written there (one
file each, park_file.py, up to `disk_budget` bytes, least recently used deleted first), and the files are
found again after a restart. A file is read whole and checked on the reader thread (format, model identity,
block size and shapes, token ids, checksum) before anything is copied to the device; a corrupt one is deleted
and one of another model left alone, each with a log line.

On a layer split every stage parks its own layers' part of each conversation, in its own RAM and directory:
stage 0's park decides (what to park, what its budgets evict, what to restore) and records each change
(`mirror`: `Kept`, `Forgotten`, `Unlinked`), which go down the stages with the next window; the other stages
make the same changes to their parks (`apply`, never evicting by themselves) and restore the same
conversations (`restore_key`, reading their own file where the conversation is on disk only), each checking it
holds its part before anything is written. Where all stages share this host, stage 0 checks every stage's
file of a conversation (`peers`) before it plans to restore it, and discards them all if one is bad.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine import park_file
from app.engine.blocks import prefix_keys
from app.engine.config import EngineConfig
from app.engine.host_memory import HeapTrimmer
from app.engine.paged_state import PagedState
from app.engine.park_file import Part
from app.engine.park_index import ParkIndex, ParkKey, longest_prefix
from app.engine.protocol import ParkingStats
from app.models.config import ATTENTION, LINEAR_ATTENTION, ModelConfig

log = logging.getLogger("strata.parking")
PIN_AHEAD = 4 << 30  # the most bytes of parked blocks pinned at start (the rest is pinned as it is parked)


@dataclass
class Parked:
    """One parked conversation: the state after its first `len(tokens)` tokens.

    `block_keys`: chain hashes of its full blocks (their keys and values are in the park's block store);
    `tail` [2, attention layers, rest, kv heads, head dim]: keys and values of the positions after them;
    `conv`, `recurrent`: the Gated DeltaNet state of every such layer (None on attention-only models).
    Until the park's worker has copied them to the host, the tensors (and the store's new blocks) are device
    copies; a restore reads either.
    """

    tokens: list[int]
    block_keys: list[bytes]
    tail: torch.Tensor
    conv: torch.Tensor | None
    recurrent: torch.Tensor | None
    own_bytes: int
    routed: object | None = None  # what the engine kept of its routing (`RoutedBefore`), for its follow-up


@dataclass(frozen=True)
class Kept:
    """A conversation stage 0 parked, for the other stages of a layer split: the state of `slot` holding
    `tokens`, whose keys and values are in `blocks` (the ones it fills)."""

    tokens: list[int]
    blocks: list[int]
    slot: int


@dataclass(frozen=True)
class Forgotten:
    """A conversation stage 0's park let go of (its RAM budget), for the other stages of a layer split."""

    key: ParkKey


@dataclass(frozen=True)
class Unlinked:
    """A conversation whose file stage 0's park deleted (its disk budget, or a bad file of some stage)."""

    key: ParkKey


def stage_directory(config: EngineConfig, stage: int, stages: int) -> Path | None:
    """Where stage `stage` of a layer split of `stages` writes its park files: its own folder of `--park-dir`,
    or None: no files asked for, or stages on other hosts (`--remote-stages`), whose files stage 0 cannot
    check before a restore."""
    if not config.park_dir or config.park_disk <= 0 or config.remote_stages:
        return None
    return Path(config.park_dir) / f"split-{stages}-stage-{stage}"


def layer_counts(config: ModelConfig, layers: range) -> tuple[int, int]:
    """The attention and linear-attention layers among `layers` (the keys and values, and the recurrent state,
    a stage of a layer split holds)."""
    kinds = [config.layer_types[i] for i in layers]
    return kinds.count(ATTENTION), kinds.count(LINEAR_ATTENTION)


def stage_identity(base: str, layers: range, kv_layers: int, gdn_layers: int, kv_dtype: torch.dtype) -> str:
    """The identity a stage of a layer split writes its park files under: the model's, and what fixes the
    shapes of its part (its layers, their keys and values, their recurrent state)."""
    return f"{base}:layers {layers.start}-{layers.stop - 1}:{kv_layers} x {kv_dtype}:{gdn_layers} gdn"


@dataclass
class _Job:
    """What the park's worker does for one parked conversation: copy its device tensors to the host once
    `ready` (an event after the gathers; None for host tensors), then write its file at `path`."""

    parked: Parked
    blocks_new: list[tuple[bytes, torch.Tensor]]
    ready: torch.cuda.Event | None
    path: Path | None
    blocks: list[torch.Tensor]


class ConversationPark:
    """Parks finished turns to host RAM (and a directory) and brings them back for their follow-ups."""

    def __init__(
        self,
        state: PagedState,
        identity: str,
        ram_budget: int,
        directory: Path | None = None,
        disk_budget: int = 0,
        follower: bool = False,
        peers: tuple[tuple[Path, str], ...] = (),
    ) -> None:
        """`follower`: the park of a stage after the first of a layer split, which evicts nothing by itself
        (stage 0's budgets decide, through `apply`). `peers`: on stage 0 of a split whose stages share this
        host, each other stage's park directory and file identity (`stage_identity`)."""
        self.state = state
        self.follower = follower
        self.peers = peers
        self.identity = identity
        self.ram_budget = ram_budget
        self.directory = directory if directory is not None and disk_budget > 0 else None
        self.disk_budget = disk_budget
        self._pinned = state.device.type == "cuda"
        self._ram: ParkIndex[Parked] = ParkIndex()
        self._blocks: dict[bytes, torch.Tensor] = {}  # [2, attention layers, block, kv heads, head dim]
        self._block_refs: dict[bytes, int] = {}
        self._disk: ParkIndex[tuple[str, int]] = ParkIndex()  # (file name, bytes) of each file
        self._ram_total = 0  # bytes of `_ram`'s own tensors and of `_blocks`
        self._disk_total = 0
        self.restores = 0
        self.restore_seconds = 0.0
        self.copied_bytes = 0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-park-reader")
        self._reading: dict[ParkKey, Future] = {}  # files being read
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._lock = threading.Lock()  # `_blocks` is changed by the worker too
        self._heap = HeapTrimmer()
        self._worker: threading.Thread | None = None
        self.mirror: list[Kept | Forgotten | Unlinked] | None = None  # stage 0 of a layer split: changes
        if self.directory is not None:
            try:
                missing = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
                for folder in reversed(missing):  # the owner's alone, the parents made here too
                    folder.mkdir(mode=0o700, exist_ok=True)
            except OSError as e:
                log.warning("not parking conversations on disk: cannot use %s (%s)", self.directory, e)
                self.directory = None
        if self.directory is not None:
            self._index()
        if self.directory is not None or self._pinned:
            self._copy_stream = torch.cuda.Stream(state.device) if self._pinned else None
            self._worker = threading.Thread(target=self._work, name="strata-park-worker", daemon=True)
            self._worker.start()

    # Parking -------------------------------------------------------------------------------------------

    def park(self, tokens: list[int], blocks: list[int], slot: int, routed: object | None = None) -> None:
        """Park the state of `slot` holding `tokens`, whose keys and values are in `blocks` (device ids), and
        `routed` (kept in RAM only, for the follow-up; a conversation parked again keeps the latest)."""
        if not tokens:
            return
        size = self.state.block_size
        full = len(tokens) // size
        block_keys = prefix_keys(tokens, full, size)
        key = ParkKey.of(tokens, size, block_keys)
        if key in self._ram or key in self._disk:
            if routed is not None and key in self._ram:
                self._ram[key].routed = routed
            self._touch(key)
            return
        new = [i for i, k in enumerate(block_keys) if k not in self._blocks]
        gathered: list[tuple[bytes, torch.Tensor]] = []
        if new:
            copied = self.state.gather_blocks([blocks[i] for i in new])
            # Each block its own storage: a view would keep the whole gather alive while any one block of it
            # stays parked (a shared prefix), beyond the bytes the budget counts. A GPU's device copies are
            # replaced by exact host copies on the worker.
            pieces = copied.unbind(0) if self._pinned else [kv.clone() for kv in copied.unbind(0)]
            with self._lock:
                for i, kv in zip(new, pieces, strict=True):
                    self._blocks[block_keys[i]] = kv
                    gathered.append((block_keys[i], kv))
                    self._ram_total += kv.nbytes
                    self.copied_bytes += kv.nbytes
        for k in block_keys:
            self._block_refs[k] = self._block_refs.get(k, 0) + 1
        rest = len(tokens) - full * size
        layers, _, _, heads, dim = self.state.keys.shape
        tail = self.state.keys.new_empty((2, layers, 0, heads, dim))
        if rest:
            tail = self.state.gather_blocks([blocks[full]])[0, :, :, :rest]
            tail = tail if self._pinned else tail.clone()
        conv = recurrent = None
        if self.state.conv.shape[0]:
            conv, recurrent = self.state.conv[:, slot].clone(), self.state.recurrent[:, slot].clone()
        own = tail.nbytes + (
            conv.nbytes + recurrent.nbytes if conv is not None and recurrent is not None else 0
        )
        self.copied_bytes += own
        parked = Parked(list(tokens), block_keys, tail, conv, recurrent, own, routed)
        self._ram.add(key, parked)
        self._ram_total += own
        if self.mirror is not None:
            self.mirror.append(Kept(list(tokens), list(blocks[: full + (1 if rest else 0)]), slot))
        path = self._add_file(key, parked) if self.directory is not None else None
        if self._worker is not None:
            ready = torch.cuda.Event() if self._pinned else None
            if ready is not None:
                ready.record()
            files = [self._blocks[k] for k in block_keys] if path is not None else []
            self._jobs.put(_Job(parked, gathered, ready, path, files))
        self._fit_ram()

    def take_mirror(self) -> list[Kept | Forgotten | Unlinked]:
        """The changes made since the last call, in order, for the other stages of a layer split."""
        assert self.mirror is not None
        changes, self.mirror = self.mirror, []
        return changes

    def apply(self, change: Kept | Forgotten | Unlinked) -> None:
        """Make a change stage 0's park made (on a `follower`)."""
        if isinstance(change, Kept):
            self.park(change.tokens, change.blocks, change.slot)
        elif isinstance(change, Forgotten):
            if change.key in self._ram:
                self._release(change.key, self._ram.pop(change.key))
                self._after_frees()
        elif change.key in self._disk:
            self._unlink(change.key)

    def reserve_pinned(self) -> None:
        """Pin the RAM budget's worth of blocks now (up to PIN_AHEAD bytes) and leave it in torch's cache of
        pinned memory, where the worker's copies find it. Pinning takes the driver's lock: done while
        conversations are parked, it stalls the windows the engine launches meanwhile. The engine calls it
        once its graphs are captured and its kernels warmed up (so that nothing of that takes the blocks from
        the cache); without a GPU it does nothing."""
        if not self._pinned:
            return
        layers, _, size, heads, dim = self.state.keys.shape
        shape, dtype = (2, layers, size, heads, dim), self.state.keys.dtype
        block_bytes = math.prod(shape) * self.state.keys.element_size()
        reserved = [
            torch.empty(shape, dtype=dtype, pin_memory=True)
            for _ in range(min(self.ram_budget, PIN_AHEAD) // block_bytes)
        ]
        del reserved

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in host memory (pinned on a GPU machine, for fast copies back)."""
        if tensor.device.type == "cpu" and not self._pinned:
            return tensor.clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
        host.copy_(tensor, non_blocking=tensor.device.type != "cpu")
        return host

    # Finding and restoring -----------------------------------------------------------------------------

    def ready(self, tokens: list[int], limit: int) -> bool:
        """Whether `find` can answer for `tokens[:limit]` now: False while a parked file that would take the
        request further than anything in RAM is being read and checked (on the reader thread; started here).

        A file read by then is brought into RAM; a bad one is discarded (log, delete) and the next tried.
        """
        while True:
            best = longest_prefix(tokens, limit, self.state.block_size, (self._ram, self._disk))
            if best is None or best in self._ram:
                return True
            reading = self._reading.get(best)
            if reading is None:
                assert self.directory is not None
                path = self.directory / self._disk[best][0]
                self._reading[best] = self._reader.submit(self._read, path, tokens[: best.length])
                return False
            if not reading.done():
                return False
            del self._reading[best]
            self._install(best, reading)

    def wait_reads(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a file being read (an engine with nothing else to run)."""
        if self._reading:
            wait(list(self._reading.values()), timeout, return_when=FIRST_COMPLETED)

    def find(self, tokens: list[int], limit: int) -> tuple[int, Parked] | None:
        """The longest conversation parked in RAM that `tokens[:limit]` continues, or None. Nothing is read
        from disk here: `ready` brings a parked file into RAM first."""
        best = longest_prefix(tokens, limit, self.state.block_size, (self._ram,))
        if best is None or self._ram[best].tokens != tokens[: best.length]:  # the tokens, not only their hash
            return None
        self._touch(best)
        return best.length, self._ram[best]

    def restore(self, parked: Parked, slot: int, blocks: list[int]) -> None:
        """Copy a parked conversation into `blocks` (its positions, in order) and the state of `slot`."""
        started = time.perf_counter()
        device = self.state.device
        full = len(parked.block_keys)
        rest = parked.tail.shape[2]
        if max(blocks[: full + (1 if rest else 0)], default=0) >= self.state.resident:
            self.state.settle()  # blocks in host RAM are written by the host
        for key, block in zip(parked.block_keys, blocks, strict=False):  # straight from pinned memory
            kv = self._blocks[key]
            for cache, part in zip(self.state.block_kv(block), kv, strict=True):
                cache.copy_(part, non_blocking=True)
        if rest:
            tail = parked.tail.to(device, non_blocking=True)
            for cache, part in zip(self.state.block_kv(blocks[full]), tail, strict=True):
                cache[:, :rest].copy_(part)
        if parked.conv is not None and parked.recurrent is not None:
            self.state.conv[:, slot] = parked.conv.to(device, non_blocking=True)
            self.state.recurrent[:, slot] = parked.recurrent.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.restores += 1
        self.restore_seconds += time.perf_counter() - started

    def restore_key(self, key: ParkKey, tokens: list[int], slot: int, blocks: list[int]) -> None:
        """Restore the conversation of `tokens` stage 0 restores (on another stage of a layer split), from RAM
        or else from this stage's file, read and checked here; a stage without its part of it fails before
        anything is written."""
        if key not in self._ram and key in self._disk and self.directory is not None:
            path = self.directory / self._disk[key][0]
            self._install(key, self._reader.submit(self._read, path, tokens))  # waited for: this window
        if key not in self._ram:
            raise RuntimeError(f"this stage holds no part of the parked conversation of {key.length} tokens")
        self.restore(self._ram[key], slot, blocks)

    def key_of(self, parked: Parked) -> ParkKey:
        """The key a parked conversation is held under."""
        return ParkKey.of(parked.tokens, self.state.block_size, parked.block_keys)

    def stats(self) -> ParkingStats:
        """Conversations and bytes in RAM and on disk, restores and their time, bytes copied to the host."""
        return ParkingStats(
            conversations_ram=len(self._ram),
            conversations_disk=len(self._disk),
            bytes_ram=self._ram_total,
            bytes_disk=self._disk_total,
            restores=self.restores,
            restore_seconds=self.restore_seconds,
            copied_bytes=self.copied_bytes,
        )

    def held_bytes(self) -> int:
        """Bytes of memory the parked tensors keep alive, each storage once: `stats().bytes_ram` when the
        park holds nothing beyond what its budget counts (checked by the tests)."""
        with self._lock:
            tensors = list(self._blocks.values())
        for parked in self._ram.values():
            tensors += [t for t in (parked.tail, parked.conv, parked.recurrent) if t is not None]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()
        }
        return sum(storages.values())

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self._worker is not None:
            self._jobs.join()

    # RAM -----------------------------------------------------------------------------------------------

    def _touch(self, key: ParkKey) -> None:
        if key in self._ram:
            self._ram.touch(key)
        if key in self._disk and self.directory is not None:
            self._disk.touch(key)
            with contextlib.suppress(OSError):  # its file may still be waiting for the writer
                os.utime(self.directory / self._disk[key][0])

    def _fit_ram(self) -> None:
        evicted = False
        while self._ram and self._ram_total > self.ram_budget and not self.follower:
            self._release(*self._ram.pop_oldest())
            evicted = True
        if evicted:
            self._after_frees()

    def _release(self, key: ParkKey, parked: Parked) -> None:
        """Let go of a conversation taken out of `_ram`: its own tensors and the blocks no other one holds."""
        self._ram_total -= parked.own_bytes
        for k in parked.block_keys:
            self._block_refs[k] -= 1
            if not self._block_refs[k]:
                del self._block_refs[k]
                with self._lock:
                    self._ram_total -= self._blocks.pop(k).nbytes
        if self.mirror is not None:
            self.mirror.append(Forgotten(key))

    def _after_frees(self) -> None:
        """Give the heap's freed pages back once conversations are let go of (pinned memory is the
        driver's, not the C heap's)."""
        if not self._pinned:
            self._heap.after_frees()

    # Disk ----------------------------------------------------------------------------------------------

    def _add_file(self, key: ParkKey, parked: Parked) -> Path:
        """Index the file a parked conversation will be written to (by the worker); returns its path."""
        assert self.directory is not None
        name = park_file.file_name(parked.tokens)
        size = sum(self._blocks[k].nbytes for k in parked.block_keys) + parked.own_bytes  # and a header
        self._add_disk(key, name, size)
        self._fit_disk()
        return self.directory / name

    def _write_file(self, path: Path, parked: Parked, blocks: list[torch.Tensor]) -> None:
        """A parked conversation's file, from its host tensors (park_file.py)."""
        parts = [
            Part("blocks", [len(blocks), *blocks[0].shape] if blocks else [0], self.state.keys.dtype, blocks)
        ]
        own = {"tail": parked.tail}
        if parked.conv is not None and parked.recurrent is not None:
            own |= {"conv": parked.conv, "recurrent": parked.recurrent}
        parts += [Part(name, list(t.shape), t.dtype, [t]) for name, t in own.items()]
        park_file.write(path, self.identity, self.state.block_size, parked.tokens, parts)

    def _work(self) -> None:
        """The worker thread: each parked conversation's device copies to pinned host memory (on a stream of
        its own, after the gathers that made them), then its file, first under a temporary name so that a
        crash leaves no partial file."""
        while True:
            job = self._jobs.get()
            try:
                copies = self._copy_to_host(job) if job.ready is not None else {}
                if job.path is not None:
                    blocks = [copies[id(b)] if id(b) in copies else self._host_view(b) for b in job.blocks]
                    partial = job.path.with_suffix(park_file.PARTIAL)
                    try:
                        self._write_file(partial, job.parked, blocks)
                        partial.replace(job.path)
                    finally:
                        partial.unlink(missing_ok=True)
            except OSError as e:  # a full disk fails the park (the follow-up reads its prompt), not a request
                log.warning("could not write parked conversation %s: %s", job.path, e)
            finally:
                self._jobs.task_done()

    def _copy_to_host(self, job: _Job) -> dict[int, torch.Tensor]:
        """Replace a job's device copies with host ones (the store's blocks only where still the same);
        returns the host copy of each new block by the id of its device copy."""
        assert self._copy_stream is not None and job.ready is not None
        parked = job.parked
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(job.ready)
            blocks = [(k, kv, self._to_host(kv)) for k, kv in job.blocks_new]
            tail, conv, recurrent = (
                None if t is None else self._to_host(t) for t in (parked.tail, parked.conv, parked.recurrent)
            )
        self._copy_stream.synchronize()
        assert tail is not None
        parked.tail, parked.conv, parked.recurrent = tail, conv, recurrent
        with self._lock:
            for k, kv, host in blocks:
                if self._blocks.get(k) is kv:
                    self._blocks[k] = host
        return {id(kv): host for _, kv, host in blocks}

    @staticmethod
    def _host_view(tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the host: a block an earlier job copied is read from the device again if it was
        captured before that job ran (same stream as the gather: the copy waits for it)."""
        return tensor if tensor.device.type == "cpu" else tensor.cpu()

    def _add_disk(self, key: ParkKey, name: str, size: int) -> None:
        self._disk.add(key, (name, size))
        self._disk_total += size

    def _fit_disk(self) -> None:
        while self._disk and self._disk_total > self.disk_budget and not self.follower:
            self._unlink(next(iter(self._disk)))

    def _unlink(self, key: ParkKey) -> None:
        """Delete a conversation's file (once the writer is done with it)."""
        assert self.directory is not None
        name, size = self._disk.pop(key)
        self._disk_total -= size
        self.flush()
        (self.directory / name).unlink(missing_ok=True)
        if self.mirror is not None:
            self.mirror.append(Unlinked(key))

    def _index(self) -> None:
        """Find the conversations parked in the directory by an earlier run (headers only), oldest first."""
        assert self.directory is not None
        for partial in self.directory.glob(f"*{park_file.PARTIAL}"):  # left by a run that stopped mid-write
            partial.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"*{park_file.SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header = park_file.read_header(path)
            except (OSError, ValueError) as e:
                log.warning("discarding parked conversation %s: %s", path.name, e)
                path.unlink(missing_ok=True)
                continue
            if header["model"] != self.identity:
                log.info("parked conversation %s is of another model; left alone", path.name)
                continue
            if not all((directory / path.name).exists() for directory, _ in self.peers):
                continue  # some stage of the split lacks its part
            key = ParkKey.of(header["tokens"], self.state.block_size)
            self._add_disk(key, path.name, path.stat().st_size)
        self._fit_disk()
        self._sweep_peers()

    def _sweep_peers(self) -> None:
        """Delete the other stages' files of this model and split that this park does not hold (their part of
        a conversation whose other parts were lost, or that the disk budget let go of before the split
        started): nothing would ever restore or delete them."""
        held = {name for name, _ in self._disk.values()}
        for directory, identity in self.peers:
            for path in directory.glob(f"*{park_file.SUFFIX}"):
                if path.name in held:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    if park_file.read_header(path)["model"] == identity:
                        path.unlink()

    def _install(self, key: ParkKey, reading: Future) -> None:
        """Bring a file the reader thread read into RAM; on any fault, discard the file (log, delete)."""
        assert self.directory is not None
        name = self._disk[key][0]
        try:
            parked, blocks = reading.result()
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            log.warning("discarding parked conversation %s: %s", name, e)
            self._unlink(key)
            return
        with self._lock:
            for k, kv in zip(parked.block_keys, blocks, strict=True):
                if k not in self._blocks:
                    self._blocks[k] = kv
                    self._ram_total += kv.nbytes
                self._block_refs[k] = self._block_refs.get(k, 0) + 1
        self._ram.add(key, parked)
        self._ram_total += parked.own_bytes
        # No eviction here: the request waiting for it restores it in this step, before the next park fits the
        # RAM budget (a budget of 0 would evict it at once, and the file would be read again and again).

    def _read(self, path: Path, tokens: list[int]) -> tuple[Parked, list[torch.Tensor]]:
        """The conversation of `tokens` in a file and its full blocks' keys and values, after every check, and
        every check of the `peers`' files of it (on the reader thread: it reads only the files and what never
        changes)."""
        size = self.state.block_size
        full, rest = len(tokens) // size, len(tokens) % size
        layers, _, _, heads, dim = self.state.keys.shape
        kv = self.state.keys.dtype
        expected = {
            "blocks": Part("blocks", [full, 2, layers, size, heads, dim] if full else [0], kv, []),
            "tail": Part("tail", [2, layers, rest, heads, dim], kv, []),
        }
        if self.state.conv.shape[0]:
            expected["conv"] = Part("conv", list(self.state.conv[:, 0].shape), self.state.conv.dtype, [])
            recurrent = self.state.recurrent
            expected["recurrent"] = Part("recurrent", list(recurrent[:, 0].shape), recurrent.dtype, [])
        loaded = {
            name: self._to_host(tensor)
            for name, tensor in park_file.read(path, self.identity, size, tuple(tokens), expected).items()
        }
        for stage, (directory, identity) in enumerate(self.peers, start=1):  # the split's other parts
            try:
                park_file.verify(directory / path.name, identity, size, tuple(tokens))
            except (OSError, ValueError) as e:
                raise ValueError(f"stage {stage}'s part: {e}") from e
        blocks = list(loaded["blocks"].unbind(0)) if full else []
        own = loaded["tail"].nbytes + sum(loaded[n].nbytes for n in ("conv", "recurrent") if n in loaded)
        parked = Parked(
            list(tokens),
            prefix_keys(tokens, full, size),
            loaded["tail"],
            loaded.get("conv"),
            loaded.get("recurrent"),
            own,
        )
        return parked, blocks
