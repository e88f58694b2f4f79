"""Weights held as GGUF blocks (every type of HELD_BLOCKS), dequantized in the grouped matmul's programs
(Triton's interpreter on CPU tensors), against the reference on the values the `gguf` package's dequantizer
gives."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from app.kernels.gguf_quants import dequantize, i_quant_tables, random_blocks, to_held
from app.kernels.interface import HELD_BLOCKS, held_kind, held_row_bytes
from app.kernels.reference import experts_reference
from app.kernels.triton_linear import few_rows_linear, held_tiles
from app.kernels.triton_moe import (
    EXACT_TILES,
    HELD_PER_PAIR_TOKENS,
    MoeTiles,
    exact_fused_experts,
    exact_linear,
    fused_experts,
    moe_tiles,
    tiled_linear,
)
from app.kernels.triton_quant import IQ3_S_GRID, IQ3_XXS_GRID, IQ4_NL_LEVELS, quant_step, quant_tables

KINDS = list(HELD_BLOCKS)
# a type of each form of the sums on the CUDA cores (Q8_0's and Q4_K's own; every other type widens its
# values as Q6_K does, and the projections' test below runs each of them there)
ROWWISE_FORMS = ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "IQ3_S"]  # IQ3_XXS reads its grid as IQ3_S does
HIDDEN, INTER = 256, 256  # whole Q4_K super-blocks
# fp16 activations: Triton's interpreter does not compute bf16 dots (the GPU test runs bf16)
DTYPE = torch.float16


def _held(kind: str, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of `kind` for a weight of `shape` as kernels hold them, and their values."""
    blocks = random_blocks(kind, shape, seed)
    return to_held(kind, blocks), dequantize(kind, blocks, shape)


def _inputs(tokens: int, experts: int, top_k: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(DTYPE)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).to(DTYPE)
    gate_up = _held(kind, (experts, 2 * INTER, HIDDEN), seed + 1)
    down = _held(kind, (experts, HIDDEN, INTER), seed + 2)
    return x, ids, weights, gate_up, down


def test_the_kernels_i_quant_tables_are_the_gguf_packages() -> None:
    """IQ4_NL's levels (constants in the kernels) and the IQ3 grids packed a word an entry, lane 0 in the low
    byte, hold the `gguf` package's values."""
    tables = i_quant_tables()
    assert list(IQ4_NL_LEVELS) == tables["iq4"].tolist()
    words = quant_tables(torch.device("cpu"))
    for name, start, entries in (("IQ3_XXS", IQ3_XXS_GRID, 256), ("IQ3_S", IQ3_S_GRID, 512)):
        entry = words[start : start + entries]
        lanes = torch.stack([(entry >> (8 * lane)) & 255 for lane in range(4)], dim=1)
        assert torch.equal(lanes.float(), tables[name])


def test_a_held_weights_type_is_told_by_its_row_width() -> None:
    assert held_row_bytes("Q8_0", 256) == 272 and held_row_bytes("Q4_K", 256) == 144
    assert held_kind(torch.empty(3, 420, dtype=torch.uint8), 512) == "Q6_K"
    assert quant_step("Q6_K", 512, 512, rowwise=True) == quant_step("Q6_K", 512, 512) == 128
    assert held_kind(torch.empty(3, 272, dtype=torch.uint8), 256) == "Q8_0"
    assert held_kind(torch.empty(3, 144, dtype=torch.uint8), 256) == "Q4_K"
    widths = {"Q5_K": 176, "IQ4_XS": 136, "IQ3_XXS": 98, "IQ3_S": 110}
    assert all(
        held_kind(torch.empty(3, 2 * width, dtype=torch.uint8), 512) == k for k, width in widths.items()
    )
    with pytest.raises(ValueError, match="hold no known blocks"):
        held_kind(torch.empty(3, 100, dtype=torch.uint8), 256)
    assert quant_step("Q4_K", 768, 128) == 128 and quant_step("Q4_K", 256, 512) == 256
    # an i-quant's tile step is a quarter super-block, its row sums' half of one
    assert quant_step("IQ4_XS", 2048, 256) == 64 and quant_step("IQ3_S", 2048, 256, rowwise=True) == 128
    assert quant_step("Q8_0", 768, 512) == 256
    assert quant_step("Q8_0", 96, 128) == 32


@pytest.mark.parametrize("kind", KINDS)
def test_held_experts_match_the_reference_on_their_dequantized_values(kind: str) -> None:
    # nine tokens: the decode tiles (fewer take the row sums, tested below)
    x, ids, weights, (gate_up, gate_up_values), (down, down_values) = _inputs(9, 6, 2, kind)
    got = fused_experts(x, ids, weights, gate_up, down)
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values.float(), down_values.float())
    scale = expected.abs().max()
    torch.testing.assert_close(got.float() / scale, expected / scale, atol=2e-2, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_held_experts_give_a_row_the_same_bits_alone_and_batched(kind: str) -> None:
    x, ids, weights, (gate_up, _), (down, _) = _inputs(5, 6, 2, kind, seed=3)
    batched = exact_fused_experts(x, ids, weights, gate_up, down)
    alone = exact_fused_experts(x[3:4], ids[3:4], weights[3:4], gate_up, down)
    assert torch.equal(batched[3:4], alone)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_held_dense_projections_match_their_dequantized_values(kind: str, rows: int) -> None:
    weight, values = _held(kind, (40, HIDDEN), 7)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(DTYPE)
    bias = torch.randn(40).to(DTYPE)
    expected = torch.nn.functional.linear(x.float(), values.float(), bias.float())
    scale = expected.abs().max()
    for got in (few_rows_linear(x, weight, bias), exact_linear(x, weight, bias)):
        torch.testing.assert_close(got.float() / scale, expected / scale, atol=2e-2, rtol=0)
    assert torch.equal(exact_linear(x, weight)[-1:], exact_linear(x[-1:], weight))


@pytest.mark.parametrize("kind", ROWWISE_FORMS)
def test_up_to_eight_rows_held_experts_are_summed_on_the_cuda_cores_with_the_bits_of_a_lone_row(
    kind: str,
) -> None:
    x, ids, weights, (gate_up, gate_up_values), (down, down_values) = _inputs(2, 4, 1, kind, seed=5)
    assert moe_tiles(HELD_PER_PAIR_TOKENS, exact=False, held=(kind, kind)).rowwise
    assert not moe_tiles(HELD_PER_PAIR_TOKENS + 1, exact=False, held=(kind, kind)).rowwise
    window = fused_experts(x, ids, weights, gate_up, down)
    assert torch.equal(window[1:2], fused_experts(x[1:2], ids[1:2], weights[1:2], gate_up, down))
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values.float(), down_values.float())
    scale = expected.abs().max()
    torch.testing.assert_close(window.float() / scale, expected / scale, atol=2e-3, rtol=0)


@pytest.mark.parametrize(("tokens", "top_k"), [(2, 1), (9, 2)])
def test_held_experts_skip_entries_with_a_negative_id(tokens: int, top_k: int) -> None:
    # the row sums (2 tokens) and the tiles (9): a skipped entry adds nothing, as if weighted 0
    x, ids, weights, (gate_up, _), (down, _) = _inputs(tokens, 4, top_k, "Q8_0", seed=8)
    skipped = torch.zeros_like(ids, dtype=torch.bool)
    skipped[0, -1] = True
    got = fused_experts(x, ids.masked_fill(skipped, -1), weights, gate_up, down)
    assert torch.equal(got, fused_experts(x, ids, weights * ~skipped, gate_up, down))


def test_tiles_over_iq3_s_experts_run_one_pipeline_stage_and_others_keep_theirs() -> None:
    assert moe_tiles(12, exact=False, held=("IQ3_S", "Q4_K")).num_stages == 1
    assert moe_tiles(4096, exact=False, held=("IQ3_S", "IQ3_S")).num_stages == 1
    assert moe_tiles(12, exact=False, held=("Q4_K", "Q4_K")).num_stages == EXACT_TILES.num_stages
    assert moe_tiles(12, exact=True, held=("IQ3_S", "IQ3_S")) == EXACT_TILES


def test_q8_0_experts_widened_columns_first_keep_a_rows_bits_and_the_reference_values() -> None:
    x, ids, weights, (gate_up, gate_up_values), (down, down_values) = _inputs(12, 6, 2, "Q8_0", seed=7)
    assert moe_tiles(12, exact=False, held=("Q8_0", "Q8_0")) == EXACT_TILES
    columns_first = replace(EXACT_TILES, block_k=256, num_stages=2, columns_first=True)
    window = fused_experts(x, ids, weights, gate_up, down, tiles=columns_first)
    first_nine = fused_experts(x[:9], ids[:9], weights[:9], gate_up, down, tiles=columns_first)
    assert torch.equal(window[:9], first_nine)
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values.float(), down_values.float())
    scale = expected.abs().max()
    torch.testing.assert_close(window.float() / scale, expected / scale, atol=2e-2, rtol=0)
    (q4_k_gate_up, _), (q4_k_down, _) = _inputs(12, 6, 2, "Q4_K")[3:]
    with pytest.raises(ValueError, match="Q8_0 blocks only"):
        fused_experts(x, ids, weights, q4_k_gate_up, q4_k_down, tiles=columns_first)


@pytest.mark.parametrize("rows", [1, 12])
def test_held_q8_0_rows_of_any_whole_blocks_read_their_codes_and_scales_where_they_lie(rows: int) -> None:
    """Held Q8_0 rows (a row's codes, then its scales) of 352 and 64 values, not a multiple of 256, so their
    codes are not 16-byte aligned: row sums, tiles and columns first alike."""
    weight, values = _held("Q8_0", (40, 352), 4)
    x = torch.randn(rows, 352, generator=torch.Generator().manual_seed(rows)).to(DTYPE)
    expected = x.float() @ values.float().T
    scale = expected.abs().max()
    for got in (few_rows_linear(x, weight), exact_linear(x, weight)):
        torch.testing.assert_close(got.float() / scale, expected / scale, atol=2e-2, rtol=0)
    g = torch.Generator().manual_seed(rows)
    gate_up, gate_up_values = _held("Q8_0", (4, 2 * 64, 352), 5)
    down, down_values = _held("Q8_0", (4, 352, 64), 6)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g).to(DTYPE)
    got = fused_experts(x, ids, weights, gate_up, down)
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values.float(), down_values.float())
    scale = expected.abs().max()
    torch.testing.assert_close(got.float() / scale, expected / scale, atol=2e-2, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_one_or_two_rows_of_a_held_projection_are_summed_on_the_cuda_cores_with_the_same_bits(
    kind: str,
) -> None:
    weight, values = _held(kind, (24, 2 * HIDDEN), 9)
    x = torch.randn(2, 2 * HIDDEN, generator=torch.Generator().manual_seed(2)).to(DTYPE)
    assert held_tiles(2, 24).rowwise and not held_tiles(3, 24).rowwise
    pair = few_rows_linear(x, weight)
    assert torch.equal(pair[1:], few_rows_linear(x[1:], weight))
    expected = x.float() @ values.float().T
    scale = expected.abs().max()
    torch.testing.assert_close(pair.float() / scale, expected / scale, atol=2e-3, rtol=0)


def test_a_launch_of_more_column_blocks_than_the_grid_holds_is_refused_with_a_message() -> None:
    weight = torch.zeros(65536, 34, dtype=torch.uint8)  # Q8_0 rows of 32 values
    tiles = MoeTiles(1, 1, 32, 1, 1, rowwise=True)
    with pytest.raises(ValueError, match="more than 65535 blocks"):
        tiled_linear(torch.zeros(1, 32, dtype=DTYPE), weight, None, tiles)
