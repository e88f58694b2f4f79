"""The Triton paged attention (in Triton's interpreter on CPU) against the per-sequence torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.kernels.reference import causal_attention
from app.kernels.triton_attention import (
    TileConfig,
    _paged_attention,
    paged_attention,
    tile_config,
    write_kv,
)
from app.models.batch import PagedLayout

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL = TileConfig(block_m=16, block_kv=16, dec_kv=16, splits=4, warps=4, stages=1)


@dataclasses.dataclass
class Case:
    """A flat batch over a paged cache: rows q, the caches holding every key, and the layout."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    layout: PagedLayout
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def make_case(
    spans: list[tuple[int, int]],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> Case:
    """Sequences of (past, length) on shuffled blocks of a NaN-filled cache; keys written by `write_kv`.

    `sequences`, when given, holds each sequence's (q, keys, values) to reuse instead of random ones.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(past + length) // block_size) for past, length in spans]
    blocks = sum(needed) + 3
    order = torch.randperm(blocks, generator=gen).tolist()
    width = max(needed)
    table = torch.zeros(len(spans), width, dtype=torch.int32)
    shape = (blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    qs, keys, values, slots, starts, lens = [], [], [], [], [0], []
    for i, (past, length) in enumerate(spans):
        own, order = order[: needed[i]], order[needed[i] :]
        table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        total = past + length
        if sequences is None:
            q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
            k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        else:
            q, k, v = sequences[i]
        positions = torch.arange(total)
        flat = table[i, positions // block_size].long() * block_size + positions % block_size
        write_kv(key_cache, value_cache, k, v, flat)
        qs.append(q)
        keys.append(k)
        values.append(v)
        slots.append(flat[past:])
        starts.append(starts[-1] + length)
        lens.append(total)
    layout = PagedLayout(
        query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat(slots),
        state_slots=torch.arange(len(spans)),
        max_query_len=max(length for _, length in spans),
    )
    return Case(torch.cat(qs), key_cache, value_cache, layout, keys, values)


def reference(case: Case, scale: float) -> torch.Tensor:
    """`causal_attention` of each sequence in fp32 on its own keys, rows back to back."""
    starts = case.layout.query_start.tolist()
    outs = []
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[starts[i] : starts[i + 1]]
        outs.append(causal_attention(q.float(), k.float(), v.float(), scale))
    return torch.cat(outs)


def check(case: Case, config: TileConfig | None = None) -> torch.Tensor:
    """Run the kernel (default or given tiles) and compare with the reference; return its output."""
    head_dim = case.q.shape[-1]
    scale = head_dim**-0.5
    if config is None:
        got = paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale)
    else:
        got = _paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale, config)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(got.float(), reference(case, scale), atol=tol, rtol=tol)
    return got


# Decode rows with and without much past, prompt chunks with and without past, one across many blocks.
MIXED = [(20, 1), (0, 7), (37, 5), (0, 1), (130, 1), (3, 18)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        (2, 2, 32, 16, torch.float32),
        (4, 2, 16, 32, torch.float32),
        (8, 1, 64, 16, torch.float32),
        (4, 2, 32, 16, torch.float16),
        (16, 2, 16, 32, torch.float16),
    ],
)
def test_mixed_batch_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    case = make_case(
        MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    check(case)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_tiles_cover_many_tiles_and_partitions(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    # 16-row tiles, 16-key steps and 4 decode partitions: chunks span several tiles, each with a maskless
    # walk and a masked tail, and decode rows wrap around their partitions several times.
    spans = [(150, 1), (33, 40), (0, 23), (5, 1), (64, 1), (17, 2)]
    case = make_case(spans, heads=heads, kv_heads=kv_heads, head_dim=16, dtype=dtype, seed=1)
    check(case, SMALL)


def test_long_context_over_many_blocks() -> None:
    # 40 blocks of 16 keys: a decode row uses every partition, a chunk with long past walks them all.
    case = make_case([(639, 1), (600, 24)], heads=4, kv_heads=1, head_dim=16, seed=2)
    check(case)


def test_partitions_with_default_tiles() -> None:
    # Past 32 partitions of the default tile: some partitions take two key tiles.
    config = tile_config(16, 2, 4)
    keys = config.splits * config.dec_kv + 3 * config.dec_kv + 5
    case = make_case([(keys - 1, 1), (2, 3)], heads=2, kv_heads=1, head_dim=16, block_size=64, seed=3)
    check(case)


def test_block_size_one_key_per_tile_step() -> None:
    # Blocks larger than a key tile: one block feeds several steps of the walk.
    case = make_case([(70, 1), (10, 30)], heads=4, kv_heads=2, head_dim=32, block_size=128, seed=4)
    check(case, SMALL)


def test_zero_length_sequence_is_skipped() -> None:
    case = make_case([(9, 1), (4, 3)], seed=5)
    layout = dataclasses.replace(
        case.layout,
        query_start=torch.tensor([0, 1, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([10, 4, 7], dtype=torch.int32),
        block_table=torch.cat((case.layout.block_table[:1], case.layout.block_table)),
    )
    got = paged_attention(case.q, case.key_cache, case.value_cache, layout, 32**-0.5)
    torch.testing.assert_close(got, reference(case, 32**-0.5), atol=1e-5, rtol=1e-5)


def test_non_contiguous_q() -> None:
    case = make_case([(12, 1), (0, 9)], heads=4, kv_heads=2, head_dim=32, seed=6)
    wide = torch.randn(case.q.shape[0], 4, 64)
    wide[..., :32] = case.q
    case.q = wide[..., :32]
    assert not case.q.is_contiguous()
    check(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_output_gate_is_applied_in_the_same_launch(dtype: torch.dtype) -> None:
    """Prompt tiles and decode rows alike: the gated output is the plain one times the sigmoid of a strided
    gate (a head's gate beside its q, as a gated layer's projection lays them), rounded the same way."""
    case = make_case(
        [(12, 1), (0, 9), (30, 1), (5, 20)], heads=4, kv_heads=2, head_dim=32, dtype=dtype, seed=8
    )
    beside = torch.randn(case.q.shape[0], 4, 64).to(dtype)
    gate = beside[..., 32:]
    scale = 32**-0.5
    plain = _paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale, SMALL)
    gated = _paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale, SMALL, gate)
    torch.testing.assert_close(
        gated, plain * torch.sigmoid(gate), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    with pytest.raises(ValueError, match="the gate must be"):
        paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale, gate.float()[:, :2])


def test_write_kv_stores_rows_at_flat_slots() -> None:
    blocks, block_size, kv_heads, head_dim = 5, 16, 2, 8
    key_cache = torch.zeros(blocks, block_size, kv_heads, head_dim)
    value_cache = torch.zeros(blocks, block_size, kv_heads, head_dim)
    k = torch.randn(6, kv_heads, head_dim)
    v = torch.randn(6, kv_heads, head_dim)
    slots = torch.tensor([3, 17, 18, 79, 40, 0])
    write_kv(key_cache, value_cache, k, v, slots)
    expected_k = torch.zeros(blocks * block_size, kv_heads, head_dim)
    expected_v = torch.zeros(blocks * block_size, kv_heads, head_dim)
    expected_k[slots] = k
    expected_v[slots] = v
    assert torch.equal(key_cache.view(-1, kv_heads, head_dim), expected_k)
    assert torch.equal(value_cache.view(-1, kv_heads, head_dim), expected_v)
    assert torch.equal(key_cache[4, 15], k[3]) and torch.equal(value_cache[1, 1], v[1])


def test_write_kv_into_a_layer_of_a_stacked_pool() -> None:
    pool = torch.zeros(3, 4, 16, 2, 8, dtype=torch.float16)
    k = torch.randn(2, 2, 8).half()
    write_kv(pool[1], pool[2], k, k + 1, torch.tensor([5, 33]))
    assert torch.equal(pool[1, 0, 5], k[0]) and torch.equal(pool[1, 2, 1], k[1])
    assert torch.equal(pool[2, 2, 1], k[1] + 1)
    assert not pool[0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_are_bit_identical_whatever_shares_the_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = 8, 1, 32

    def sequence(past: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(past + length, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(past + length, kv_heads, head_dim, generator=gen).to(dtype)
        return q, k, v

    decode, chunk = sequence(90, 1), sequence(10, 6)
    others = [sequence(200, 1), sequence(0, 150), sequence(40, 3)]

    def run(spans: list[tuple[int, int]], seqs: list, seed: int) -> tuple[Case, torch.Tensor]:
        case = make_case(
            spans, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=seed, sequences=seqs
        )
        return case, check(case)

    _, alone_decode = run([(90, 1)], [decode], seed=8)
    _, alone_chunk = run([(10, 6)], [chunk], seed=9)
    spans = [(200, 1), (10, 6), (0, 150), (90, 1), (40, 3)]
    case, batched = run(spans, [others[0], chunk, others[1], decode, others[2]], seed=10)
    assert case.layout.max_query_len == 150
    starts = case.layout.query_start.tolist()
    assert torch.equal(batched[starts[1] : starts[2]], alone_chunk)
    assert torch.equal(batched[starts[3] : starts[4]], alone_decode)
