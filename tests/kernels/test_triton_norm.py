"""The fused norm kernels (in Triton's interpreter on CPU) against the torch references, bit for bit.

Most inputs are multiples of 1/8 in [-2, 2]: their squares sum exactly in any order, so the sum of squares
(the one step whose order the kernels do not share with torch) is the same, and every other rounding step can
be compared exactly. Gaussian inputs check the remaining difference is at most a few units in the last place.
"""

from __future__ import annotations

import pytest
import torch

from app.kernels.triton_norm import add_rms_norm, gated_rms_norm, qk_norm_rope, qk_norm_rope_store, rms_norm
from app.models.config import RopeConfig
from app.models.layers import GatedRMSNorm, RMSNorm, RotaryEmbedding, apply_rotary

EPS = 1e-6
DTYPES = [torch.float32, torch.float16]
# Tolerances for Gaussian inputs, whose sums of squares round differently in another order.
RANDOM_TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 1e-7}, torch.float16: {"rtol": 1e-3, "atol": 1e-5}}


def _dyadic(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: squares sum exactly in fp32 in any order."""
    return torch.randint(-16, 17, shape, generator=gen).float() / 8


def _strided(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [rows, dim] as a view of a wider buffer, so that the row stride is not dim."""
    rows, dim = values.shape
    buffer = torch.full((rows, dim + 24), float("nan"), dtype=dtype)
    buffer[:, 5 : 5 + dim] = values.to(dtype)
    return buffer[:, 5 : 5 + dim]


def _norm(dim: int, offset: bool, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, EPS, offset=offset)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(dim, generator=gen) + (0.0 if offset else 1.0))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dim", [64, 80])
def test_rms_norm_is_bit_identical_to_reference(dtype: torch.dtype, offset: bool, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim + offset)
    norm = _norm(dim, offset, dtype, gen)
    x = _strided(_dyadic(gen, 6, dim), dtype)
    with torch.no_grad():
        expected = norm(x)
    got = rms_norm(x, norm.weight.detach(), EPS, offset)
    assert got.dtype == dtype and got.shape == (6, dim) and got.is_contiguous()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_of_gaussian_rows_is_within_a_few_ulp(dtype: torch.dtype, offset: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    norm = _norm(96, offset, dtype, gen)
    x = _strided(torch.randn(8, 96, generator=gen), dtype)
    with torch.no_grad():
        expected = norm(x)
    torch.testing.assert_close(
        rms_norm(x, norm.weight.detach(), EPS, offset), expected, **RANDOM_TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_is_bit_identical_to_reference(dtype: torch.dtype, offset: bool) -> None:
    gen = torch.Generator().manual_seed(7 + offset)
    norm = _norm(48, offset, dtype, gen)
    x = _strided(_dyadic(gen, 5, 48), dtype)
    residual = _strided(_dyadic(gen, 5, 48), dtype)
    total = residual + x
    with torch.no_grad():
        expected = norm(total)
    normed, new_residual = add_rms_norm(x, residual, norm.weight.detach(), EPS, offset)
    assert torch.equal(new_residual, total)
    assert torch.equal(normed, expected)


@pytest.mark.parametrize("model_dtype", DTYPES)
@pytest.mark.parametrize("x_fp32", [False, True])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_gated_rms_norm_matches_reference(model_dtype: torch.dtype, x_fp32: bool, weight_fp32: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    dim = 32
    norm = GatedRMSNorm(dim, EPS)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(dim, generator=gen) + 1.0)
    norm = norm.to(torch.float32 if weight_fp32 else model_dtype)
    x_dtype = torch.float32 if x_fp32 else model_dtype
    x = _strided(_dyadic(gen, 7, dim), x_dtype)
    gate = _strided(2 * torch.randn(7, dim, generator=gen), model_dtype)
    with torch.no_grad():
        expected = norm(x, gate).to(x_dtype)
    got = gated_rms_norm(x, gate, norm.weight.detach(), EPS)
    assert got.dtype == x_dtype
    if x_dtype == torch.float16:
        assert torch.equal(got, expected)
    else:
        # The interpreter's exp (numpy's) and torch's CPU exp differ in the last bit for some inputs.
        torch.testing.assert_close(got, expected, **RANDOM_TOLERANCE[torch.float32])


def _rope_case(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, gen: torch.Generator, tokens: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as the q half of a gated q_proj output, k as a strided view, and the cos/sin tables."""
    heads, kv_heads = 4, 2
    q_proj = _dyadic(gen, tokens, heads, 2 * head_dim).to(dtype)
    q = q_proj.view(tokens, heads, 2 * head_dim).chunk(2, dim=-1)[0]
    k = _strided(_dyadic(gen, tokens, kv_heads * head_dim), dtype).view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e6), rotary_dim).cos_sin(positions, dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(32, 32), (64, 16)])
def test_qk_norm_rope_is_bit_identical_to_reference(
    dtype: torch.dtype, offset: bool, head_dim: int, rotary_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + offset)
    q, k, cos, sin = _rope_case(dtype, head_dim, rotary_dim, gen)
    q_norm, k_norm = _norm(head_dim, offset, dtype, gen), _norm(head_dim, offset, dtype, gen)
    with torch.no_grad():
        expected_q = apply_rotary(q_norm(q), cos, sin)
        expected_k = apply_rotary(k_norm(k), cos, sin)
    got_q, got_k = qk_norm_rope(q, k, q_norm.weight.detach(), k_norm.weight.detach(), EPS, offset, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, expected_q)
    assert torch.equal(got_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_writes_k_and_v_where_the_slots_say(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    q, k, cos, sin = _rope_case(dtype, 64, 16, gen, tokens=3)
    v = _strided(_dyadic(gen, 3, 2 * 64), dtype).view(3, 2, 64)
    q_norm, k_norm = _norm(64, True, dtype, gen), _norm(64, True, dtype, gen)
    norms = (q_norm.weight.detach(), k_norm.weight.detach(), EPS, True)
    keys, values = torch.zeros(4, 2, 2, 64, dtype=dtype), torch.zeros(4, 2, 2, 64, dtype=dtype)
    slots = torch.tensor([5, 0, 6])  # block 2 offset 1, block 0 offset 0, block 3 offset 0
    got_q = qk_norm_rope_store(q, k, v, *norms, cos, sin, keys, values, slots)
    expected_q, expected_k = qk_norm_rope(q, k, *norms, cos, sin)
    assert torch.equal(got_q, expected_q)
    flat_keys, flat_values = keys.view(-1, 2, 64), values.view(-1, 2, 64)
    assert torch.equal(flat_keys[slots], expected_k) and torch.equal(flat_values[slots], v)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert not flat_keys[untouched].any() and not flat_values[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_of_gaussian_heads_is_within_a_few_ulp(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, cos, sin = _rope_case(dtype, 64, 32, gen)
    q, k = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    q_norm, k_norm = _norm(64, True, dtype, gen), _norm(64, True, dtype, gen)
    with torch.no_grad():
        expected_q = apply_rotary(q_norm(q), cos, sin)
        expected_k = apply_rotary(k_norm(k), cos, sin)
    got_q, got_k = qk_norm_rope(q, k, q_norm.weight.detach(), k_norm.weight.detach(), EPS, True, cos, sin)
    # Cancellation in x*cos + rotated*sin turns an ulp of either product into more of the sum: absolute.
    atol = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got_q, expected_q, rtol=RANDOM_TOLERANCE[dtype]["rtol"], atol=atol)
    torch.testing.assert_close(got_k, expected_k, rtol=RANDOM_TOLERANCE[dtype]["rtol"], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_bit_identical_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    rows, dim, row = 9, 72, 4
    weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)
    x = _strided(torch.randn(rows, dim, generator=gen), dtype)
    residual = _strided(torch.randn(rows, dim, generator=gen), dtype)
    gate = torch.randn(rows, dim, generator=gen).to(dtype)
    one = slice(row, row + 1)

    assert torch.equal(rms_norm(x, weight, EPS, False)[one], rms_norm(x[one], weight, EPS, False))
    batched = add_rms_norm(x, residual, weight, EPS, True)
    alone = add_rms_norm(x[one], residual[one], weight, EPS, True)
    assert torch.equal(batched[0][one], alone[0]) and torch.equal(batched[1][one], alone[1])
    assert torch.equal(
        gated_rms_norm(x, gate, weight, EPS)[one], gated_rms_norm(x[one], gate[one], weight, EPS)
    )

    q, k, cos, sin = _rope_case(dtype, 32, 16, gen, tokens=rows)
    q, k = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    q_weight, k_weight = weight[:32], weight[32:64]
    batched = qk_norm_rope(q, k, q_weight, k_weight, EPS, False, cos, sin)
    alone = qk_norm_rope(q[one], k[one], q_weight, k_weight, EPS, False, cos[one], sin[one])
    assert torch.equal(batched[0][one], alone[0]) and torch.equal(batched[1][one], alone[1])


def test_empty_batches_and_bad_shapes() -> None:
    weight = torch.ones(16)
    assert rms_norm(torch.empty(0, 16), weight, EPS, False).shape == (0, 16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 16), torch.ones(8), EPS, False)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(3, 16), torch.randn(3, 16).half(), weight, EPS, False)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope(q, k, weight, weight, EPS, False, torch.ones(2, 7), torch.ones(2, 7))
