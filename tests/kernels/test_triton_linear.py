"""The dense projections of few rows against torch, in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from app.kernels.triton_linear import TILE, few_rows_linear, resident_tile_linear, row_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(40, 300), (13, 64)])
def test_few_rows_linear_matches_torch_and_a_row_never_depends_on_the_batch(
    dtype: torch.dtype, n: int, k: int
) -> None:
    # A small weight up to 16 rows: its rows one by one (k of 300), resident tiles (k of 64); cuBLAS beyond.
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x = torch.randn(TILE, k, generator=g).to(dtype)
    got = few_rows_linear(x, weight)
    expected = torch.nn.functional.linear(x.float(), weight.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    for rows in (slice(0, 1), slice(3, 7), slice(TILE - 1, TILE)):
        alone = few_rows_linear(x[rows], weight)
        if k > 128 or dtype != torch.float32:
            assert torch.equal(alone, got[rows])
        else:
            # The interpreter computes a resident tile's fp32 dot with numpy's BLAS, whose bits can depend on
            # the tile's other (padding) rows; on a GPU the tile is one tensor-core dot of fixed shape, and
            # the GPU engine tests check that a row's tokens do not depend on its batch.
            torch.testing.assert_close(alone, got[rows], atol=1e-6, rtol=1e-6)
    many = torch.randn(TILE + 1, k, generator=g).to(dtype)
    torch.testing.assert_close(few_rows_linear(many, weight), torch.nn.functional.linear(many, weight))


@pytest.mark.parametrize("block_n", [1, 4, 16])
def test_rows_over_whole_weight_rows_match_torch_and_keep_their_bits(block_n: int) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 100, generator=g)
    weight = torch.randn(37, 100, generator=g)
    bias = torch.randn(37, generator=g)
    got = row_linear(x, weight, bias, block_n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(row_linear(x[3:4], weight, bias, block_n), got[3:4])


@pytest.mark.parametrize("chunk_k", [None, 32])
def test_resident_tiles_cover_a_ragged_weight_with_a_bias(chunk_k: int | None) -> None:
    # k of 100 in one dot, or in four pieces of 32 (the last one short).
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 100, generator=g)
    weight = torch.randn(37, 100, generator=g)
    bias = torch.randn(37, generator=g)
    got = resident_tile_linear(x, weight, bias, chunk_k)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert resident_tile_linear(x[:0], weight, None).shape == (0, 37)


def test_what_does_not_fit_a_program_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        resident_tile_linear(torch.zeros(1, 4096), torch.zeros(16, 4096), None)
    with pytest.raises(ValueError, match="at most"):
        resident_tile_linear(torch.zeros(TILE + 1, 64), torch.zeros(16, 64), None)
    with pytest.raises(ValueError, match="at most"):
        row_linear(torch.zeros(TILE + 1, 64), torch.zeros(16, 64), None, 1)
