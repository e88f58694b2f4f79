"""The grouped-matmul routed experts against the reference, in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from app.kernels.reference import experts_reference
from app.kernels.triton_moe import (
    EXACT_TILES,
    PER_PAIR_TOKENS,
    align_routes,
    exact_linear,
    fused_experts,
    moe_tiles,
    route_top_k,
)


def _inputs(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 64, 48
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    return x, ids, weights, gate_up, down


def test_routes_group_every_pair_by_expert_in_padded_tiles() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 1]])
    routes = align_routes(ids, experts=5, block_m=2)
    rows, experts = routes.rows.view(-1, 2).tolist(), routes.block_expert.tolist()
    used = [(e, r) for e, r in zip(experts, rows, strict=True) if e >= 0]
    assert used == [(0, [3, 6]), (1, [1, 2]), (1, [5, 6]), (3, [0, 4])]  # 6 = padding (pairs)
    assert all(e == -1 for e in experts[len(used) :])


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (2, 8, 3), (5, 8, 3), (70, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_experts_match_the_reference(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    x, ids, weights, gate_up, down = _inputs(tokens, experts, top_k, dtype)
    got = fused_experts(x, ids, weights, gate_up, down)
    expected = experts_reference(x.float(), ids, weights.float(), gate_up.float(), down.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_entries_with_a_negative_id_add_nothing(tokens: int) -> None:
    # A tier passes -1 for the entries another part computes: the same bits as those entries weighted 0,
    # without reading any expert for them (a row with every entry skipped sums to zero).
    x, ids, weights, gate_up, down = _inputs(tokens, 8, 3, torch.float32, seed=5)
    skipped = torch.rand(ids.shape, generator=torch.Generator().manual_seed(6)) < 0.4
    skipped[0] = True
    ids = ids.masked_fill(skipped, -1)
    got = fused_experts(x, ids, weights, gate_up, down)
    assert torch.equal(got, fused_experts(x, ids.clamp_min(0), weights * ~skipped, gate_up, down))
    assert not got[0].any()
    torch.testing.assert_close(got, experts_reference(x, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)


def test_exact_tiles_do_not_follow_the_batch() -> None:
    assert moe_tiles(1, exact=True) == moe_tiles(4096, exact=True) == EXACT_TILES
    assert moe_tiles(4096, exact=False).block_m > EXACT_TILES.block_m


@pytest.mark.parametrize("exact", [True, False])
def test_a_row_is_the_same_alone_and_in_any_batch(exact: bool) -> None:
    # One or two tokens run a tile per pair with the down projection and the sum in one launch; nine go
    # through the aligned tiles: a row's result must not tell which.
    x, ids, weights, gate_up, down = _inputs(9, 8, 2, torch.float32)
    batched = fused_experts(x, ids, weights, gate_up, down, exact=exact)
    for rows in (slice(0, 1), slice(4, 4 + PER_PAIR_TOKENS), slice(8, 9)):
        alone = fused_experts(x[rows], ids[rows], weights[rows], gate_up, down, exact=exact)
        assert torch.equal(alone, batched[rows])


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_the_reference_and_counts_live_rows(renormalize: bool) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 20, generator=g)
    live = torch.tensor([1, 1, 0, 1, 1, 0])
    counts = torch.zeros(20, dtype=torch.int64)
    ids, weights = route_top_k(logits, 4, renormalize, counts, live)
    probs = logits.softmax(-1)
    expected_weights, expected_ids = probs.topk(4, dim=-1)
    if renormalize:
        expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    expected_counts = torch.bincount(expected_ids[live.bool()].flatten(), minlength=20)
    assert torch.equal(counts, expected_counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_linear_matches_torch_and_a_row_never_depends_on_the_batch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 96, generator=g).to(dtype)
    weight = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    got = exact_linear(x, weight, bias)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    for row in (0, 20, 36):
        assert torch.equal(exact_linear(x[row : row + 1], weight, bias)[0], got[row])
