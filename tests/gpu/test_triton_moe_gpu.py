"""The grouped-matmul routed experts on the GPU at Qwen3-30B-A3B's expert shapes, in bf16."""

from __future__ import annotations

import pytest
import torch

from app.kernels.interface import Picks
from app.kernels.reference import experts_reference
from app.kernels.triton_linear import SMALL_WEIGHT_TILES, few_rows_linear, resident_tile_linear
from app.kernels.triton_moe import (
    exact_linear,
    expert_pairs,
    fused_experts,
    route_top_k,
    sum_picks,
    tiled_linear,
)
from app.kernels.triton_moe_block import _arrivals, route_window
from app.kernels.triton_norm import add_rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * 0.02).bfloat16()
    return x, ids, weights.bfloat16(), gate_up, down


@pytest.mark.parametrize("tokens", [1, 8, 32, 300, 2048])
def test_fused_experts_match_the_fp32_reference(tokens: int) -> None:
    x, ids, weights, gate_up, down = _inputs(tokens)
    got = fused_experts(x, ids, weights, gate_up, down).float()
    expected = experts_reference(x.float(), ids, weights.float(), gate_up.float(), down.float())
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 2e-2


@pytest.mark.parametrize("exact", [True, False])
def test_a_row_is_bit_identical_alone_and_batched(exact: bool) -> None:
    x, ids, weights, gate_up, down = _inputs(32)
    batched = fused_experts(x, ids, weights, gate_up, down, exact=exact)
    for rows in (slice(0, 1), slice(13, 15), slice(31, 32)):  # one and two tokens run a tile per pair
        alone = fused_experts(x[rows], ids[rows], weights[rows], gate_up, down, exact=exact)
        assert torch.equal(alone, batched[rows])


def test_exact_rows_do_not_change_inside_a_prompt_sized_batch() -> None:
    x, ids, weights, gate_up, down = _inputs(1000)
    batched = fused_experts(x, ids, weights, gate_up, down, exact=True)
    alone = fused_experts(x[7:8], ids[7:8], weights[7:8], gate_up, down, exact=True)
    assert torch.equal(alone[0], batched[7])


def test_exact_linear_rows_are_bit_identical_alone_and_batched() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, HIDDEN, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(4096, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    batched = exact_linear(x, weight)
    expected = torch.nn.functional.linear(x.float(), weight.float())
    assert ((batched.float() - expected).abs().max() / expected.abs().max()) < 2e-2
    for rows in (slice(0, 1), slice(5, 13), slice(0, 32)):
        assert torch.equal(exact_linear(x[rows], weight), batched[rows])


@pytest.mark.parametrize(
    ("n", "k", "alike"),
    [
        (12288, 2048, 16),  # wide: fixed tiles for every window of up to 16 rows
        (1024, 2048, 16),  # small: resident tiles
        (128, 2048, 16),  # a router
        (2048, 512, 16),  # a short row
        (5120, 2048, 1),  # mid-sized (q30's qkv and o): a lone row on its own, more rows by cuBLAS
        (2048, 4096, 1),
    ],
)
def test_few_rows_linear_matches_fp32_and_a_row_never_depends_on_the_batch(
    n: int, k: int, alike: int
) -> None:
    g = torch.Generator(device="cuda").manual_seed(n)
    weight = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    for count in (1, 4, 16):
        x = torch.randn(count, k, device="cuda", generator=g).bfloat16()
        got = few_rows_linear(x, weight)
        expected = torch.nn.functional.linear(x.float(), weight.float())
        assert ((got.float() - expected).abs().max() / expected.abs().max()) < 1e-2
    x = torch.randn(alike, k, device="cuda", generator=g).bfloat16()
    batched = few_rows_linear(x, weight)
    for rows in (slice(0, 1), slice(alike // 2, alike)):
        assert torch.equal(few_rows_linear(x[rows], weight), batched[rows])


@pytest.mark.parametrize(("n", "k"), [(128, 2048), (1024, 2048), (64, 64), (300, 512)])
def test_resident_tiles_give_the_bits_of_the_fixed_tiles(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(k)
    weight = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    for rows in (1, 5, 16):
        x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        assert torch.equal(
            resident_tile_linear(x, weight, None), tiled_linear(x, weight, None, SMALL_WEIGHT_TILES)
        )


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_a_window_routed_in_one_launch_routes_as_its_pieces(rows: int) -> None:
    """Qwen3-30B-A3B's router (bf16, 128 experts over 2,048): `route_window`'s logits, picks, weights and
    counts are those of `row_linear` and `route_top_k`, bit for bit; and a norm summing the block's picks has
    the bits of the norm after their sum."""
    x, _, _, gate_up, down = _inputs(rows, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    router = (torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    counts = [torch.zeros(EXPERTS, dtype=torch.int64, device="cuda") for _ in range(2)]
    logits, ids, weights = route_window(x, router, TOP_K, True, counts[0], None)
    pieces = few_rows_linear(x, router)
    piece_ids, piece_weights = route_top_k(pieces, TOP_K, True, counts[1], None)
    assert torch.equal(logits, pieces) and torch.equal(ids, piece_ids) and torch.equal(weights, piece_weights)
    assert torch.equal(counts[0], counts[1]) and _arrivals(x.device).sum().item() == 0
    picks = Picks(expert_pairs(x, ids, weights, gate_up, down), ids, sum_picks)
    residual = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    norm = torch.rand(HIDDEN, device="cuda", generator=g).bfloat16()
    fused = add_rms_norm(picks, residual, norm, 1e-6, False)
    summed = add_rms_norm(picks.total(), residual, norm, 1e-6, False)
    assert all(torch.equal(a, b) for a, b in zip(fused, summed, strict=True))
