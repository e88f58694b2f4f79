"""The KV block pool's bookkeeping: which fixed-size blocks are free, which belong to which request, and the
prefix cache: full blocks remembered by the chain of tokens that filled them, so that a later request with
the same prefix takes them instead of reading those tokens again.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT = b""  # the chain hash before the first block


def chain_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """The hash of a full block: its parent's chain hash and its token ids (stable across runs)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_keys(tokens: list[int], blocks: int, block_size: int) -> list[bytes]:
    """The chain hashes of the first `blocks` full blocks of `block_size` tokens of `tokens`."""
    keys, parent = [], ROOT
    for start in range(0, blocks * block_size, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class _Cached:
    """What a cached block holds: its chain hash, its parent's, and its tokens (re-compared on a hit)."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass
class Donor:
    """A table whose device blocks `BlockPool.place` may lend to another table (a prompt being read lends to
    a decoding request, whose every window reads its blocks): its first `content` blocks hold keys and
    values; its blocks before `start` hold none it could lend (where the next look begins, moved on as
    blocks are lent and looked past)."""

    table: list[int]
    content: int
    start: int = 0


class BlockPool:
    """`total` KV blocks of `block_size` tokens each (the tensors live in the runner).

    Free blocks are handed out lowest first: with `--kv-resident` the lowest live on the device, which so
    fills first, and a sequence's blocks come in runs of consecutive numbers where they can (one copy a run).
    Blocks numbered from `on_device` on live in host RAM; `place` moves a table's blocks there onto the device
    where a block there is free or only cached (its contents then go to host RAM, still cached), or where a
    donor's table lends one (its contents go to host RAM, in the donor's table).

    A block is held by every request whose table lists it (a reference count). With `caching`, a full block
    whose contents are computed is registered under its chain hash (`commit`); when no request holds it any
    more it stays cached, evictable, until a new block is needed and it is the least recently released one.
    Only full, committed blocks are ever shared, and nobody writes into a full block, so sharing is safe.

    Every change the pool makes to a table gives it a new stamp (`stamp_of`), never given before: a layer
    split sends a table down its stages only when its stamp moved since it last sent it.
    """

    def __init__(self, total: int, block_size: int, caching: bool = False) -> None:
        self.total = total
        self.block_size = block_size
        self.caching = caching
        self._free = list(range(total))  # blocks holding nothing worth keeping: a heap, lowest first
        self._refs = [0] * total
        self._cached: dict[bytes, int] = {}
        self._meta: dict[int, _Cached] = {}
        self.on_device = total  # blocks numbered below this live on the device, the rest in host RAM
        # chain hashes of the cached blocks no one holds, least recently released first (a block moved
        # between the device and host RAM keeps its place), and those blocks that live on the device
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._idle_on_device: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}  # holds on blocks that are not requests' (saved states' tails)
        self.reclaim: Callable[[], bool] | None = None  # drops one pin when blocks run short; False: none
        self._stamps: dict[int, int] = {}  # id of a non-empty table -> the stamp of its latest change
        self._stamp = 0

    def stamp_of(self, table: list[int]) -> int:
        """The stamp of the pool's latest change to `table` (0: none since it was last emptied)."""
        return self._stamps.get(id(table), 0)

    def _changed(self, table: list[int]) -> None:
        self._stamp += 1
        self._stamps[id(table)] = self._stamp

    @property
    def free(self) -> int:
        """Blocks no request holds (cached ones included: they are given out when nothing else is left)."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks held by requests."""
        pinned_only = sum(1 for block, pins in self._pins.items() if self._refs[block] == pins)
        return self.total - self.free - pinned_only

    @property
    def cached(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._meta)

    def blocks_for(self, tokens: int) -> int:
        """How many blocks hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend a block table to hold `tokens` tokens; False (and no change) when the pool is short."""
        needed = self.blocks_for(tokens) - len(table)
        if needed <= 0:
            return True
        while needed > self.free and self.reclaim is not None and self.reclaim():
            pass
        if needed > self.free:
            return False
        for _ in range(needed):
            block = heapq.heappop(self._free) if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        self._changed(table)
        return True

    def release(self, table: list[int]) -> None:
        """Drop a table's hold on its blocks and empty it; its last blocks are the first to be evicted."""
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._meta:
                    self._evictable[self._meta[block].key] = None
                    if block < self.on_device:
                        self._idle_on_device[block] = None
                else:
                    heapq.heappush(self._free, block)
        table.clear()
        self._stamps.pop(id(table), None)

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The cached blocks holding the longest prefix of `tokens` of at most `limit` tokens, in order.

        Each block's tokens and parent are compared, not only its hash. Nothing is taken yet (`take`).
        """
        if not self.caching:
            return []
        found: list[int] = []
        parent = ROOT
        size = self.block_size
        for start in range(0, limit - size + 1, size):
            block_tokens = tuple(tokens[start : start + size])
            key = chain_hash(parent, block_tokens)
            block = self._cached.get(key)
            if block is None:
                break
            meta = self._meta[block]
            if meta.parent != parent or meta.tokens != block_tokens:
                break
            found.append(block)
            parent = key
        return found

    def key_of(self, block: int) -> bytes:
        """The chain hash a cached block is registered under."""
        return self._meta[block].key

    def prefix_keys(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The chain hashes of the first `blocks` full blocks of `tokens`."""
        return prefix_keys(tokens, blocks, self.block_size)

    def take(self, table: list[int], blocks: list[int]) -> None:
        """Append cached `blocks` (from `match`) to an empty or matching table and hold them."""
        for block in blocks:
            self._hold(block)
            table.append(block)
        if blocks:
            self._changed(table)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[self._meta[block].key]
            self._idle_on_device.pop(block, None)
        self._refs[block] += 1

    def pin(self, block: int) -> None:
        """Hold a block for something other than a request (it does not count as used)."""
        self._hold(block)
        self._pins[block] = self._pins.get(block, 0) + 1

    def unpin(self, block: int) -> None:
        """Drop a `pin`."""
        self._pins[block] -= 1
        if not self._pins[block]:
            del self._pins[block]
        self.release([block])

    def commit(
        self, table: list[int], tokens: list[int], computed: int, done: int, parent: bytes
    ) -> tuple[int, bytes]:
        """Register the table's full blocks among its first `computed` tokens, once their contents exist.

        `done` blocks of the table are registered already, the last under `parent`; `tokens` are the
        sequence's tokens from block `done` on (not the whole sequence, which a decoding request would copy
        every window); returns the new pair. A block whose chain hash is already cached (another request
        read the same prefix at the same time) stays private, and registering stops there.
        """
        if not self.caching:
            return done, parent
        size, first = self.block_size, done
        for index in range(done, min(computed // size, len(table))):
            block = table[index]
            block_tokens = tuple(tokens[(index - first) * size : (index - first + 1) * size])
            key = chain_hash(parent, block_tokens)
            if key in self._cached:
                if self._cached[key] != block:
                    return index, parent
            else:
                self._cached[key] = block
                self._meta[block] = _Cached(key, parent, block_tokens)
            done, parent = index + 1, key
        return done, parent

    def place(
        self,
        table: list[int],
        content: int,
        most: int,
        copies: list[tuple[int, int]],
        start: int = 0,
        donors: Sequence[Donor] = (),
    ) -> tuple[int, int]:
        """Move the table's blocks from `start` on that live in host RAM and that only it holds onto the
        device, in order, while a block there is free or only cached, or a donor lends one (`_lend`); (block
        copies that took, at most `most`; the first index still to look at next time: the table's length when
        nothing was left).

        The table's first `content` blocks hold keys and values, which go with them; a cached block keeps its
        registration. A cached block the device gives up goes to a free block in host RAM, still cached, or
        when none is free is forgotten. The copies, (source, target) in the order they must be made before
        anything reads or writes these blocks again, are appended to `copies`: those of lent blocks as they
        are lent, those of the cached blocks, then the table's. With no device block free or only cached and
        no donor, nothing is looked at (a window of long conversations on a full device pays nothing).
        """
        if not (self._free and self._free[0] < self.on_device) and not self._idle_on_device and not donors:
            return 0, start
        made, chosen, spares, given_up = 0, [], [], []
        index, pending = start, None
        while index < len(table):
            block, moved = table[index], int(index < content)
            if block < self.on_device or self._refs[block] != 1:  # on the device, or shared: left
                index += 1
                continue
            if made + moved > most:  # no copy left in the budget: only fresh blocks may still move
                pending = index if pending is None else pending
                index = max(index + 1, content)
                continue
            if self._free and self._free[0] < self.on_device:
                spare = heapq.heappop(self._free)
            elif self._idle_on_device:  # every free block left lives in host RAM
                spare, _ = self._idle_on_device.popitem(last=False)
                if made + moved < most and len(given_up) < len(self._free):
                    given_up.append(spare)
                    made += 1
                else:
                    self._forget(spare)
            elif (lent := self._lend(donors, most - made - moved, len(given_up), copies)) is not None:
                spare, cost = lent
                made += cost
            else:
                pending = index if pending is None else pending
                break
            made += moved
            chosen.append(index)
            spares.append(spare)
            index += 1
        # blocks paired in ascending order on both sides, so that consecutive ones make runs (a copy a layer)
        for block in sorted(given_up):
            home = heapq.heappop(self._free)
            copies.append((block, home))
            self._rename(block, home)
        emptied = [table[index] for index in chosen]
        for index, block, spare in zip(chosen, emptied, sorted(spares), strict=True):
            if index < content:
                copies.append((block, spare))
            self._rename(block, spare)
            self._refs[block], self._refs[spare] = 0, 1
            table[index] = spare
        if chosen:
            self._changed(table)
        for block in emptied:  # free only now: no block is copied from after it was copied to
            heapq.heappush(self._free, block)
        return made, len(table) if pending is None else pending

    def _lend(
        self, donors: Sequence[Donor], budget: int, reserved: int, copies: list[tuple[int, int]]
    ) -> tuple[int, int] | None:
        """A device block taken out of a donor's table, the first from its `start` that only the donor holds:
        a free block in host RAM takes its place, its keys and values copied there (appended to `copies`)
        where it holds any; (the block, copies made), or None when no donor has such a block, fewer than
        `reserved` + 1 host blocks are free, or its copy would pass `budget`."""
        if len(self._free) <= reserved:
            return None
        for donor in donors:
            table = donor.table
            while donor.start < len(table) and not self._lendable(table[donor.start]):
                donor.start += 1
            if donor.start == len(table):
                continue
            index, block = donor.start, table[donor.start]
            cost = int(index < donor.content)
            if cost > budget:
                return None
            donor.start += 1
            home = heapq.heappop(self._free)
            if cost:
                copies.append((block, home))
            self._rename(block, home)
            self._refs[block], self._refs[home] = 0, 1
            table[index] = home
            self._changed(table)
            return block, cost
        return None

    def _lendable(self, block: int) -> bool:
        """Whether a table's block lives on the device and only that table holds it."""
        return block < self.on_device and self._refs[block] == 1

    def _rename(self, block: int, to: int) -> None:
        """A cached block's registration (if any) now names `to`, which holds its contents."""
        meta = self._meta.pop(block, None)
        if meta is not None:
            self._meta[to] = meta
            self._cached[meta.key] = to

    def _forget(self, block: int) -> None:
        """Drop an unheld cached block from the cache."""
        key = self._meta.pop(block).key
        del self._cached[key], self._evictable[key]
        self._idle_on_device.pop(block, None)

    def _evict(self) -> int:
        """Forget the least recently released cached block and give it out."""
        block = self._cached[next(iter(self._evictable))]
        self._forget(block)
        return block
