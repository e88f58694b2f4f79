"""The park's index: short keys, the longest parked conversation a request continues, oldest out first."""

from __future__ import annotations

import random

from app.engine.park_index import ParkIndex, ParkKey, longest_prefix

BLOCK = 4


def _index(*conversations: list[int]) -> ParkIndex[str]:
    index: ParkIndex[str] = ParkIndex()
    for tokens in conversations:
        index.add(ParkKey.of(tokens, BLOCK), f"{len(tokens)}")
    return index


def _naive(tokens: list[int], limit: int, conversations: list[list[int]]) -> int | None:
    """The length of the longest conversation `tokens[:limit]` starts with (the definition)."""
    fits = [len(c) for c in conversations if len(c) <= limit and tokens[: len(c)] == c]
    return max(fits, default=None)


def test_the_longest_conversation_a_request_continues_is_found_within_its_limit() -> None:
    first = [5, 6, 7, 8, 9, 10]  # one block and two tokens
    longer = [*first, 11, 12, 13, 14, 15]  # two blocks and three
    other = [5, 6, 7, 8, 1]
    ram, disk = _index(first), _index(longer, other)
    request = [*longer, 16, 17]
    assert longest_prefix(request, len(request) - 1, BLOCK, (ram, disk)) == ParkKey.of(longer, BLOCK)
    assert longest_prefix(request, 10, BLOCK, (ram, disk)) == ParkKey.of(first, BLOCK)  # longer: 11 tokens
    assert longest_prefix(request, 5, BLOCK, (ram, disk)) is None
    assert longest_prefix([5, 6, 7, 8, 9, 99, 1], 6, BLOCK, (ram, disk)) is None  # tail differs
    assert longest_prefix([*first, 0], 6, BLOCK, (ram,)) == ParkKey.of(first, BLOCK)
    exact_blocks = [1, 2, 3, 4, 5, 6, 7, 8]
    assert longest_prefix([*exact_blocks, 9], 8, BLOCK, (_index(exact_blocks),)) == ParkKey.of(
        exact_blocks, BLOCK
    )


def test_lookups_agree_with_comparing_every_conversation() -> None:
    rng = random.Random(0)
    base = [rng.randrange(3) for _ in range(40)]
    conversations = [base[:n] + [rng.randrange(3) for _ in range(rng.randrange(3))] for n in range(1, 40, 3)]
    index = _index(*conversations)
    for _ in range(200):
        tokens = base[: rng.randrange(1, 41)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
        limit = rng.randrange(1, len(tokens) + 1)
        found = longest_prefix(tokens, limit, BLOCK, (index,))
        assert (found.length if found else None) == _naive(tokens, limit, conversations)


def test_a_key_holds_less_than_a_block_of_tokens_however_long_the_conversation() -> None:
    short, long = ParkKey.of(list(range(7)), BLOCK), ParkKey.of(list(range(100_003)), BLOCK)
    assert len(long.tail) == len(short.tail) == 3 * 8 and len(long.chain) == 16
    assert long.length == 100_003


def test_the_least_recently_used_goes_first_and_removed_keys_are_not_found() -> None:
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8]
    index = _index(a, b, c)
    index.touch(ParkKey.of(a, BLOCK))
    assert index.pop_oldest() == (ParkKey.of(b, BLOCK), "5")
    assert longest_prefix([*b, 0], 5, BLOCK, (index,)) is None
    assert longest_prefix([*a, 0], 5, BLOCK, (index,)) == ParkKey.of(a, BLOCK)
    assert index.pop(ParkKey.of(a, BLOCK)) == "5"
    assert list(index) == [ParkKey.of(c, BLOCK)] and len(index) == 1
