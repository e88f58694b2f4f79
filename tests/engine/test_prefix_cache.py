"""The prefix cache's bookkeeping: KV blocks cached by chain hash, recurrent-state checkpoints."""

from __future__ import annotations

import pytest

from app.engine import blocks as blocks_module
from app.engine.blocks import BlockPool
from app.engine.prefix_cache import StateCheckpoints


def _pool_with(tokens: list[int], total: int = 8) -> tuple[BlockPool, list[int]]:
    """A caching pool of 4-token blocks where one request read `tokens` and let go of its blocks."""
    pool = BlockPool(total, 4, caching=True)
    table: list[int] = []
    assert pool.grow(table, len(tokens))
    pool.commit(table, tokens, len(tokens), 0, blocks_module.ROOT)
    held = list(table)
    pool.release(table)
    return pool, held


def test_full_blocks_of_a_read_prefix_are_found_again_and_held() -> None:
    tokens = list(range(100, 110))  # two full blocks and two tokens
    pool, held = _pool_with(tokens)
    assert pool.cached == 2 and pool.used == 0 and pool.free == 8
    found = pool.match([*tokens[:8], 1, 2, 3], limit=11)
    assert found == held[:2]
    assert pool.match([100, 101, 102, 999, *tokens[4:]], limit=10) == []  # the first block differs
    assert pool.match(tokens, limit=7) == held[:1]  # only whole blocks within the limit
    table: list[int] = []
    pool.take(table, found)
    assert pool.used == 2 and pool.free == 6


def test_a_hash_match_with_other_tokens_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, _ = _pool_with(list(range(8)))
    monkeypatch.setattr(blocks_module, "chain_hash", lambda parent, tokens: b"same for every block")
    assert pool.match([9, 9, 9, 9, 9, 9, 9, 9], limit=8) == []


def test_cached_blocks_are_evicted_least_recently_released_first_and_last_blocks_first() -> None:
    pool = BlockPool(4, 2, caching=True)
    first: list[int] = []
    pool.grow(first, 4)
    pool.commit(first, [1, 2, 3, 4], 4, 0, blocks_module.ROOT)
    pool.release(first)
    other: list[int] = []
    pool.grow(other, 4)  # the two never-cached blocks
    pool.grow(other, 6)  # evicts the tail block of [1, 2, 3, 4] first
    assert pool.match([1, 2, 3, 4], limit=4) != [] and pool.cached == 1
    pool.grow(other, 8)
    assert pool.match([1, 2, 3, 4], limit=4) == [] and pool.cached == 0


def test_a_prefix_read_twice_at_once_stays_cached_once() -> None:
    pool = BlockPool(8, 2, caching=True)
    a: list[int] = []
    b: list[int] = []
    pool.grow(a, 4)
    pool.grow(b, 4)
    pool.commit(a, [5, 6, 7, 8], 4, 0, blocks_module.ROOT)
    assert pool.commit(b, [5, 6, 7, 8], 4, 0, blocks_module.ROOT) == (0, blocks_module.ROOT)
    assert pool.cached == 2
    pool.release(b)
    assert pool.free == 6 and pool.cached == 2


def test_checkpoints_continue_from_the_furthest_saved_position() -> None:
    pool = BlockPool(16, 4, caching=True)
    checkpoints = StateCheckpoints(pool, [20, 21])
    tokens = list(range(30))
    table: list[int] = []
    pool.grow(table, 30)
    pool.commit(table, tokens, 30, 0, blocks_module.ROOT)
    assert checkpoints.save(tokens, 8, table).slot == 20
    tail = checkpoints.save(tokens, 14, table)  # inside block 3: the checkpoint holds that block
    assert tail.slot == 21 and tail.tail_block == table[3]
    held = list(table)
    pool.release(table)
    assert pool.used == 0 and pool.free == 15  # the tail block is pinned, not used
    hit = checkpoints.find([*tokens[:20], 99], limit=20)
    assert hit.position == 14 and hit.blocks == held[:3] and hit.checkpoint.tail_block == held[3]
    hit = checkpoints.find([*tokens[:12], 98, 97, 96], limit=15)  # differs inside the tail
    assert hit.position == 8 and hit.blocks == held[:2]
    # A third checkpoint evicts the least recently used one (position 8 was used last) and its block.
    assert checkpoints.save(tokens, 4, held[:1]).slot == 21
    assert checkpoints.find(tokens, limit=20).position == 8
    assert pool.free == 16


def test_checkpoint_blocks_are_given_back_when_the_pool_runs_short() -> None:
    pool = BlockPool(3, 4, caching=True)
    checkpoints = StateCheckpoints(pool, [9])
    table: list[int] = []
    pool.grow(table, 6)
    checkpoints.save(list(range(6)), 6, table)
    pool.release(table)
    assert pool.free == 2 and len(checkpoints) == 1
    assert pool.grow(table, 12) and len(checkpoints) == 0


def test_every_change_to_a_table_gives_it_a_stamp_never_given_before() -> None:
    pool = BlockPool(total=8, block_size=4, caching=True)
    pool.on_device = 4  # blocks 4..7 live in host RAM
    table: list[int] = []
    assert pool.stamp_of(table) == 0
    assert pool.grow(table, 8)  # blocks 0 and 1
    stamps = [pool.stamp_of(table)]
    assert pool.grow(table, 8) and pool.stamp_of(table) == stamps[-1]  # nothing to grow: no change
    other: list[int] = []
    assert pool.grow(other, 8)  # blocks 2 and 3: another table's change leaves this one's stamp alone
    assert pool.stamp_of(table) == stamps[-1] and pool.stamp_of(other) not in stamps
    assert pool.grow(table, 12) and table[-1] >= pool.on_device  # a third block, in host RAM
    stamps.append(pool.stamp_of(table))
    pool.release(other)
    assert pool.place(table, 3, 8, [])[0] == 1 and table[-1] < pool.on_device  # moved onto the device
    stamps.append(pool.stamp_of(table))
    pool.release(table)
    assert pool.stamp_of(table) == 0 and not table
    pool.take(table, [])
    assert pool.stamp_of(table) == 0  # taking nothing changes nothing
    assert pool.grow(table, 4)
    stamps.append(pool.stamp_of(table))
    assert len(set(stamps)) == len(stamps) and 0 not in stamps
