"""The Triton paged attention on a CUDA device: bf16 against the fp32 reference, batch invariance, graphs."""

from __future__ import annotations

import pytest
import torch

from app.kernels.reference import causal_attention
from app.kernels.triton_attention import paged_attention, write_kv
from app.models.batch import PagedLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

Sequence = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # q [length, heads, d], k and v [total, kv_heads, d]

DECODE_PASTS = [0, 17, 100, 511, 512, 1000, 2500, 4097]  # 8 decode rows over short and long contexts
CHUNK = (300, 1000)  # a 1000-token prompt chunk after 300 keys


def random_sequence(
    past: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> Sequence:
    """Random q for `length` new rows and keys and values for all past + length positions."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    return (
        randn(length, heads, head_dim),
        randn(past + length, kv_heads, head_dim),
        randn(past + length, kv_heads, head_dim),
    )


def paged_batch(
    sequences: list[Sequence], block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedLayout]:
    """The sequences' rows back to back and their keys on shuffled blocks of a NaN-filled cache."""
    q0, k0, _ = sequences[0]
    kv_heads, head_dim = k0.shape[1:]
    needed = [-(-k.shape[0] // block_size) for _, k, _ in sequences]
    blocks = sum(needed) + 5
    order = torch.randperm(blocks, generator=gen, device="cuda").cpu().tolist()
    table = torch.zeros(len(sequences), max(needed), dtype=torch.int32)
    shape = (blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=q0.dtype, device="cuda")
    value_cache = torch.full(shape, float("nan"), dtype=q0.dtype, device="cuda")
    starts, lens, slots = [0], [], []
    for i, (q, k, v) in enumerate(sequences):
        own, order = order[: needed[i]], order[needed[i] :]
        table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        positions = torch.arange(k.shape[0])
        flat = (table[i, positions // block_size].long() * block_size + positions % block_size).cuda()
        write_kv(key_cache, value_cache, k, v, flat)
        slots.append(flat[k.shape[0] - q.shape[0] :])
        starts.append(starts[-1] + q.shape[0])
        lens.append(k.shape[0])
    layout = PagedLayout(
        query_start=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_table=table.cuda(),
        slot_mapping=torch.cat(slots),
        state_slots=torch.arange(len(sequences), device="cuda"),
        max_query_len=max(q.shape[0] for q, _, _ in sequences),
    )
    return torch.cat([q for q, _, _ in sequences]), key_cache, value_cache, layout


def reference(sequences: list[Sequence], scale: float) -> torch.Tensor:
    """`causal_attention` of each sequence in fp32, rows back to back."""
    return torch.cat([causal_attention(q.float(), k.float(), v.float(), scale) for q, k, v in sequences])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype", "tol"),
    [
        (32, 4, 128, 16, torch.bfloat16, 2e-2),
        (16, 2, 256, 16, torch.bfloat16, 2e-2),
        (32, 4, 128, 64, torch.bfloat16, 2e-2),
        (32, 4, 128, 16, torch.float16, 5e-3),
        (16, 2, 256, 32, torch.float32, 1e-4),
        (8, 8, 64, 16, torch.float32, 1e-4),
    ],
)
def test_decode_rows_and_prompt_chunk_match_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, tol: float
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    sequences = [random_sequence(p, 1, heads, kv_heads, head_dim, dtype, gen) for p in DECODE_PASTS[:4]]
    sequences.append(random_sequence(*CHUNK, heads, kv_heads, head_dim, dtype, gen))
    sequences += [random_sequence(p, 1, heads, kv_heads, head_dim, dtype, gen) for p in DECODE_PASTS[4:]]
    q, key_cache, value_cache, layout = paged_batch(sequences, block_size, gen)
    scale = head_dim**-0.5
    got = paged_attention(q, key_cache, value_cache, layout, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(sequences, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 4, 128), (16, 2, 256)])
def test_rows_are_bit_identical_whatever_shares_the_batch(heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)

    def make(past: int, length: int) -> Sequence:
        return random_sequence(past, length, heads, kv_heads, head_dim, torch.bfloat16, gen)

    decode, chunk = make(3000, 1), make(40, 70)
    others = [make(p, 1) for p in DECODE_PASTS] + [make(*CHUNK)]
    scale = head_dim**-0.5

    def run(sequences: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        q, key_cache, value_cache, layout = paged_batch(sequences, 16, gen)
        return paged_attention(q, key_cache, value_cache, layout, scale), layout.query_start.tolist()

    alone_decode, _ = run([decode])
    alone_chunk, _ = run([chunk])
    batched, starts = run([*others[:3], chunk, *others[3:6], decode, *others[6:]])
    assert torch.equal(batched[starts[3] : starts[4]], alone_chunk)
    assert torch.equal(batched[starts[7] : starts[8]], alone_decode)
    only_decodes, starts = run([*others[:5], decode])
    assert torch.equal(only_decodes[starts[5] : starts[6]], alone_decode)


def test_replays_in_a_cuda_graph() -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    sequences = [random_sequence(p, 1, 16, 2, 256, torch.bfloat16, gen) for p in (5, 700, 2000)]
    sequences.append(random_sequence(64, 40, 16, 2, 256, torch.bfloat16, gen))
    q, key_cache, value_cache, layout = paged_batch(sequences, 16, gen)
    scale = 256**-0.5
    eager = paged_attention(q, key_cache, value_cache, layout, scale)  # compiles before capture
    static_q = q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(static_q, key_cache, value_cache, layout, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(static_q, key_cache, value_cache, layout, scale)
    static_q.zero_()
    graph.replay()
    assert not torch.equal(captured, eager)
    static_q.copy_(q)
    graph.replay()
    assert torch.equal(captured, eager)
