"""Keys and values in 8 bits (app/kernels/kv_quant.py): the round trip within its stated bounds, the Triton
kernels (in the interpreter on CPU) writing the rows `quantize` gives and attending over them as the torch
path does over their widened values."""

from __future__ import annotations

import pytest
import torch

from app.kernels import kv_quant
from app.kernels.cpu_sequence import paged_attention_reference
from app.kernels.triton_attention import _paged_attention, paged_attention
from app.kernels.triton_norm import qk_norm_rope, qk_norm_rope_store
from tests.kernels.test_triton_attention import MIXED, SMALL, make_case

KINDS = [torch.int8, torch.float8_e4m3fn]


def _rows(gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes, a row of zeros, a row with one outlier, and exact ties."""
    x = torch.randn(64, 3, 128, generator=gen) * torch.logspace(-6, 4, 64)[:, None, None]
    x[5] = 0.0
    x[9, 1, 7] = 1e3
    x[11, 0, :4] = torch.tensor([2.5, -2.5, 0.5, 127.0]) / 127.0  # int8 halves of a scale of 1/127
    return x


def test_int8_values_are_within_half_a_scale_and_keep_their_zeros() -> None:
    x = _rows(torch.Generator().manual_seed(0))
    rows = kv_quant.quantize(x, torch.int8)
    assert rows.shape == (64, 3, 144) and rows.dtype == torch.int8
    assert not rows.view(torch.uint8)[..., 132:].any()  # the padding after the scale
    codes, scales = kv_quant.codes_and_scales(rows)
    amax = x.abs().amax(-1)
    assert torch.equal(scales, amax.clamp(min=kv_quant.TINY) / 127)
    assert codes.abs().max() <= 127 and not codes[5].any()
    back = kv_quant.dequantize(rows, torch.float32)
    assert ((back - x).abs() <= scales[..., None] * 0.5 * (1 + 1e-6)).all()
    assert codes[11, 0, :4].tolist() == [2, -2, 0, 127]  # halves to even, as torch.round


def test_fp8_values_are_within_a_sixteenth_and_are_torchs_own_e4m3_rounding() -> None:
    x = _rows(torch.Generator().manual_seed(1))
    rows = kv_quant.quantize(x, torch.float8_e4m3fn)
    codes, scales = kv_quant.codes_and_scales(rows)
    y = (x / scales[..., None]).clamp(-448, 448)
    assert torch.equal(codes.float(), y.to(torch.float8_e4m3fn).float())  # the same grid, ties to even
    back = kv_quant.dequantize(rows, torch.float32)
    normal = y.abs() >= 2**-6
    assert ((back - x).abs()[normal] <= x.abs()[normal] / 16).all()
    assert ((back - x).abs()[~normal] <= (scales[..., None] * 2**-10).expand_as(x)[~normal]).all()


def test_a_cache_rows_width_and_the_dtype_asked_for() -> None:
    assert kv_quant.row_width(128, torch.int8) == 144 and kv_quant.row_width(128, torch.bfloat16) == 128
    with pytest.raises(ValueError, match="divisible by 16"):
        kv_quant.row_width(30, torch.float8_e4m3fn)
    assert kv_quant.cache_dtype("auto", torch.float32) == torch.float32
    assert kv_quant.cache_dtype("int8", torch.float32) == torch.int8
    assert kv_quant.cache_dtype("bf16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="needs bf16 activations"):
        kv_quant.cache_dtype("bf16", torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_store_writes_the_rows_quantize_gives(kind: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 3, 4, 2, 64
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen) * 3
    v = torch.randn(tokens, kv_heads, dim, generator=gen) * 0.01
    v[1, 0] = 0.0
    cos, sin = torch.randn(tokens, 16, generator=gen), torch.randn(tokens, 16, generator=gen)
    norms = (torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5, 1e-6, False)
    shape = (4, 2, kv_heads, kv_quant.row_width(dim, kind))
    keys, values = torch.zeros(shape, dtype=kind), torch.zeros(shape, dtype=kind)
    slots = torch.tensor([5, 0, 6])
    got_q = qk_norm_rope_store(q, k, v, *norms, cos, sin, keys, values, slots)
    expected_q, expected_k = qk_norm_rope(q, k, *norms, cos, sin)
    assert torch.equal(got_q, expected_q)
    flat_keys, flat_values = keys.view(-1, kv_heads, shape[-1]), values.view(-1, kv_heads, shape[-1])
    bits = torch.uint8
    assert torch.equal(flat_keys[slots].view(bits), kv_quant.quantize(expected_k, kind).view(bits))
    assert torch.equal(flat_values[slots].view(bits), kv_quant.quantize(v, kind).view(bits))
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert not flat_keys[untouched].view(bits).any()


def _quantized_case(kind: torch.dtype, dtype: torch.dtype, **shape: int):
    """A mixed batch (decode rows and prompt chunks) whose caches are 8-bit rows of its keys."""
    case = make_case(MIXED, dtype=dtype, **shape)
    case.key_cache = kv_quant.quantize(case.key_cache.nan_to_num(), kind)
    case.value_cache = kv_quant.quantize(case.value_cache.nan_to_num(), kind)
    return case


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_over_8_bit_caches_matches_the_torch_path_over_their_values(
    kind: torch.dtype, dtype: torch.dtype
) -> None:
    case = _quantized_case(kind, dtype, heads=4, kv_heads=2, head_dim=32, block_size=16)
    scale = 32**-0.5
    layout = case.layout
    expected = paged_attention_reference(case.q.float(), case.key_cache, case.value_cache, layout, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    for got in (
        paged_attention(case.q, case.key_cache, case.value_cache, layout, scale),
        _paged_attention(case.q, case.key_cache, case.value_cache, layout, scale, SMALL),
    ):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_8_bit_caches_keep_attention_near_the_exact_values() -> None:
    """What the codes cost: int8 within 2% and e4m3 within 8% of attention over the unrounded keys."""
    case = make_case(MIXED, heads=4, kv_heads=2, head_dim=32)
    scale = 32**-0.5
    exact = paged_attention(case.q, case.key_cache, case.value_cache, case.layout, scale)
    for kind, bound in ((torch.int8, 0.02), (torch.float8_e4m3fn, 0.08)):
        keys = kv_quant.quantize(case.key_cache.nan_to_num(), kind)
        values = kv_quant.quantize(case.value_cache.nan_to_num(), kind)
        got = paged_attention(case.q, keys, values, case.layout, scale)
        assert (got - exact).abs().max() <= bound * exact.abs().max()
