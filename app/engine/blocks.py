"""The KV block pool's bookkeeping: which fixed-size blocks are free, which belong to which request."""

from __future__ import annotations


class BlockPool:
    """A free list of `total` KV blocks of `block_size` tokens each (the tensors live in the runner)."""

    def __init__(self, total: int, block_size: int) -> None:
        self.total = total
        self.block_size = block_size
        self._free = list(range(total - 1, -1, -1))

    @property
    def free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks held by requests."""
        return self.total - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """How many blocks hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend a block table to hold `tokens` tokens; False (and no change) when the pool is short."""
        needed = self.blocks_for(tokens) - len(table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(needed))
        return True

    def release(self, table: list[int]) -> None:
        """Return a table's blocks to the pool and empty it."""
        self._free.extend(reversed(table))
        table.clear()
