"""Where a request can start instead of position 0: cached KV blocks and saved recurrent states. No torch.

Attention-only models continue from any run of cached full blocks (`BlockPool.match`). Models with Gated
DeltaNet layers also need the conv and recurrent state at that position, so they continue only where a
`Checkpoint` was saved: at prompt pieces that end on a chunk multiple, and at the end of every request (prompt
plus generated tokens), where a follow-up turn continues. A checkpoint at a position inside a block holds that
block too (its keys and values up to the position); the request that continues copies it into a block of its
own, since it writes the rest of it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from app.engine.blocks import ROOT, BlockPool


@dataclass(frozen=True)
class Checkpoint:
    """A saved state at `position` of a token sequence, in checkpoint slot `slot` of the state pools.

    `parent` is the chain hash of the full blocks before `position`; `tail` the tokens after them (empty
    when `position` ends a block), whose keys and values `tail_block` holds.
    """

    parent: bytes
    tail: tuple[int, ...]
    position: int
    slot: int
    tail_block: int | None


@dataclass(frozen=True)
class PrefixHit:
    """Where a request continues: the cached blocks it takes and, on hybrid models, the checkpoint."""

    blocks: list[int]
    position: int
    checkpoint: Checkpoint | None = None


class StateCheckpoints:
    """A fixed number of checkpoint slots, least recently used evicted first."""

    def __init__(self, pool: BlockPool, slots: list[int]) -> None:
        self.pool = pool
        self._free = list(reversed(slots))
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], Checkpoint] = OrderedDict()
        self._by_parent: dict[bytes, list[Checkpoint]] = {}
        pool.reclaim = self._reclaim

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, tokens: list[int], position: int, table: list[int]) -> Checkpoint | None:
        """Reserve a slot for the state after `tokens[:position]` (the caller copies it there).

        `table` is the sequence's block table; a block that `position` ends inside is held by the checkpoint.
        None when there is no slot at all, or the same state is saved already.
        """
        size = self.pool.block_size
        full = position // size
        keys = self.pool.prefix_keys(tokens, full)
        parent = keys[-1] if keys else ROOT
        tail = tuple(tokens[full * size : position])
        if (parent, tail) in self._entries:
            self._entries.move_to_end((parent, tail))
            return None
        if not self._free and not self._entries:
            return None
        if not self._free:
            self._drop(next(iter(self._entries)))
        tail_block = None
        if tail:
            tail_block = table[full]
            self.pool.pin(tail_block)
        checkpoint = Checkpoint(parent, tail, position, self._free.pop(), tail_block)
        self._entries[(parent, tail)] = checkpoint
        self._by_parent.setdefault(parent, []).append(checkpoint)
        return checkpoint

    def find(self, tokens: list[int], limit: int) -> PrefixHit | None:
        """The furthest checkpoint within `tokens[:limit]` whose full blocks are all cached, or None."""
        size = self.pool.block_size
        cached = self.pool.match(tokens, limit)
        keys = [self.pool.key_of(block) for block in cached]
        for full in range(len(cached), -1, -1):
            parent = keys[full - 1] if full else ROOT
            best = None
            for checkpoint in self._by_parent.get(parent, []):
                end = full * size + len(checkpoint.tail)
                if end <= limit and tuple(tokens[full * size : end]) == checkpoint.tail:
                    best = checkpoint if best is None or end > best.position else best
            if best is not None:
                self._entries.move_to_end((best.parent, best.tail))
                return PrefixHit(blocks=cached[:full], position=best.position, checkpoint=best)
        return None

    def _drop(self, key: tuple[bytes, tuple[int, ...]]) -> None:
        checkpoint = self._entries.pop(key)
        siblings = self._by_parent[checkpoint.parent]
        siblings.remove(checkpoint)
        if not siblings:
            del self._by_parent[checkpoint.parent]
        if checkpoint.tail_block is not None:
            self.pool.unpin(checkpoint.tail_block)
        self._free.append(checkpoint.slot)

    def _reclaim(self) -> bool:
        """Drop the least recently used checkpoint that holds a block; False when none does."""
        for key, checkpoint in self._entries.items():
            if checkpoint.tail_block is not None:
                self._drop(key)
                return True
        return False
