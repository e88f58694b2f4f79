"""How the park finds its conversations again: short keys, and the longest one a request's tokens continue.

A parked conversation is named by the chain hash of its full blocks (as the prefix cache names blocks) and
the few tokens after them, not by all its tokens: the park's index of files on disk may hold tens of
thousands of conversations, and its memory must not grow with their length. A request's tokens are hashed
block by block once per lookup, and only conversations that end in one of its chains are compared.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.engine.blocks import ROOT, prefix_keys

V = TypeVar("V")


def _packed(tokens: list[int] | tuple[int, ...]) -> bytes:
    return array("q", tokens).tobytes()


@dataclass(frozen=True, slots=True)
class ParkKey:
    """A parked conversation's tokens: the chain hash of its full blocks (ROOT if none), the tokens after
    them (packed, fewer than a block), and how many tokens it has in all."""

    chain: bytes
    tail: bytes
    length: int

    @classmethod
    def of(cls, tokens: list[int], block_size: int, chains: list[bytes] | None = None) -> ParkKey:
        """The key of `tokens`; `chains` are their full blocks' chain hashes when already known."""
        full = len(tokens) // block_size
        chains = prefix_keys(tokens, full, block_size) if chains is None else chains
        return cls(chains[-1] if full else ROOT, _packed(tokens[full * block_size :]), len(tokens))


class ParkIndex(Generic[V]):
    """Values by ParkKey, least recently used first, with the keys that end at each chain hash."""

    def __init__(self) -> None:
        self._entries: OrderedDict[ParkKey, V] = OrderedDict()
        self._by_chain: dict[bytes, list[ParkKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: ParkKey) -> V:
        return self._entries[key]

    def __iter__(self) -> Iterator[ParkKey]:
        return iter(self._entries)

    def values(self) -> Iterable[V]:
        return self._entries.values()

    def add(self, key: ParkKey, value: V) -> None:
        """Add or replace `key`'s value; it becomes the most recently used."""
        if key not in self._entries:
            self._by_chain.setdefault(key.chain, []).append(key)
        self._entries[key] = value
        self._entries.move_to_end(key)

    def touch(self, key: ParkKey) -> None:
        """Make `key` the most recently used."""
        self._entries.move_to_end(key)

    def pop(self, key: ParkKey) -> V:
        """Remove `key`; returns its value."""
        keys = self._by_chain[key.chain]
        keys.remove(key)
        if not keys:
            del self._by_chain[key.chain]
        return self._entries.pop(key)

    def pop_oldest(self) -> tuple[ParkKey, V]:
        """Remove the least recently used key; returns it and its value."""
        key = next(iter(self._entries))
        return key, self.pop(key)

    def ending_at(self, chain: bytes) -> list[ParkKey]:
        """The keys whose full blocks end at `chain`."""
        return self._by_chain.get(chain, [])


def longest_prefix(
    tokens: list[int], limit: int, block_size: int, indexes: Iterable[ParkIndex]
) -> ParkKey | None:
    """The longest key in `indexes` whose tokens `tokens[:limit]` start with, or None."""
    indexes = list(indexes)
    chains = prefix_keys(tokens, limit // block_size, block_size)
    for full in range(len(chains), -1, -1):
        chain = chains[full - 1] if full else ROOT
        start = full * block_size
        best: ParkKey | None = None
        for index in indexes:
            for key in index.ending_at(chain):
                longer = best is None or key.length > best.length
                if key.length <= limit and longer and _packed(tokens[start : key.length]) == key.tail:
                    best = key
        if best is not None:  # a longer key would end at a later chain
            return best
    return None
