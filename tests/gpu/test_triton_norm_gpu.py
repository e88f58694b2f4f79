"""The fused norm kernels on a CUDA device in bf16: the torch references on the same inputs, batch invariance.

The kernels sum squares in another order than torch's reductions, so a row's rstd can differ in its last fp32
bit; after rounding to bf16 almost every element is equal and the rest are an ulp or two apart.
"""

from __future__ import annotations

import pytest
import torch

from app.kernels.triton_norm import add_rms_norm, gated_rms_norm, qk_norm_rope, qk_norm_rope_store, rms_norm
from app.models.config import RopeConfig
from app.models.layers import GatedRMSNorm, RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EPS = 1e-6
HIDDEN = 2048
HEADS, KV_HEADS = 16, 2
DV = 128  # the gated norm's row: one value head of Gated DeltaNet
# (head_dim, rotary_dim): Qwen3-MoE rotates whole 128-dim heads, Qwen3-Next a quarter of 256-dim heads.
HEAD_SHAPES = [(128, 128), (256, 64)]
ROWS = [1, 300]
NORM_TOLERANCE = {"rtol": 2**-6, "atol": 1e-5}  # about two bf16 ulps
# x*cos + rotated*sin can cancel: an ulp of a product is then an absolute error of the sum.
ROPE_TOLERANCE = {"rtol": 2**-6, "atol": 2**-5}
MAX_MISMATCH = 0.01  # share of bf16 elements allowed to differ from the reference at all


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, tolerance: dict[str, float]) -> None:
    """Close within `tolerance`; in bf16 also equal in all but a small share of the elements."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tolerance)
    if got.dtype == torch.bfloat16:
        assert (got != expected).float().mean().item() <= MAX_MISMATCH


def _norm(dim: int, offset: bool, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, EPS, offset=offset).to("cuda")
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(dim, generator=gen, device="cuda") + (0.0 if offset else 1.0))
    return norm.to(torch.bfloat16)


def _strided(values: torch.Tensor) -> torch.Tensor:
    """values [rows, dim] as a view into a wider buffer, so the row stride is not dim."""
    rows, dim = values.shape
    buffer = torch.zeros(rows, dim + 64, dtype=values.dtype, device=values.device)
    buffer[:, 32 : 32 + dim] = values
    return buffer[:, 32 : 32 + dim]


def _rope_inputs(
    gen: torch.Generator, tokens: int, head_dim: int, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as the q half of a gated q_proj output, k as a view of a wider projection, cos/sin tables."""
    q = _randn(gen, tokens, HEADS, 2 * head_dim).chunk(2, dim=-1)[0]
    k = _strided(_randn(gen, tokens, KV_HEADS * head_dim)).view(tokens, KV_HEADS, head_dim)
    positions = torch.randint(0, 30000, (tokens,), generator=gen, device="cuda")
    rope = RotaryEmbedding(RopeConfig(theta=1e7), rotary_dim).to("cuda")
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    return q, k, cos, sin


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_and_add_rms_norm_match_reference(rows: int, offset: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows + offset)
    norm = _norm(HIDDEN, offset, gen)
    weight = norm.weight.detach()
    x = _strided(_randn(gen, rows, HIDDEN))
    residual = _randn(gen, rows, HIDDEN)
    with torch.no_grad():
        _assert_matches(rms_norm(x, weight, EPS, offset), norm(x), NORM_TOLERANCE)
        total = residual + x
        normed, new_residual = add_rms_norm(x, residual, weight, EPS, offset)
        assert torch.equal(new_residual, total)
        _assert_matches(normed, norm(total), NORM_TOLERANCE)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gated_rms_norm_matches_reference(rows: int, x_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    norm = GatedRMSNorm(DV, EPS).to("cuda")
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(DV, generator=gen, device="cuda") + 1.0)
    norm = norm.to(torch.bfloat16)
    x = _randn(gen, rows * 4, DV, dtype=x_dtype)
    gate = _strided(_randn(gen, rows * 4, DV))
    with torch.no_grad():
        expected = norm(x, gate)
    tolerance = NORM_TOLERANCE if x_dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    _assert_matches(gated_rms_norm(x, gate, norm.weight.detach(), EPS), expected, tolerance)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), HEAD_SHAPES)
def test_qk_norm_rope_matches_reference(rows: int, offset: bool, head_dim: int, rotary_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows + head_dim + offset)
    q, k, cos, sin = _rope_inputs(gen, rows, head_dim, rotary_dim)
    q_norm, k_norm = _norm(head_dim, offset, gen), _norm(head_dim, offset, gen)
    with torch.no_grad():
        expected_q = apply_rotary(q_norm(q.reshape(rows, HEADS, head_dim)), cos, sin)
        expected_k = apply_rotary(k_norm(k), cos, sin)
    got_q, got_k = qk_norm_rope(q, k, q_norm.weight.detach(), k_norm.weight.detach(), EPS, offset, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    _assert_matches(got_q, expected_q, ROPE_TOLERANCE)
    _assert_matches(got_k, expected_k, ROPE_TOLERANCE)
    if rotary_dim < head_dim:  # the heads' unrotated tails are the plain norm's output
        _assert_matches(got_q[..., rotary_dim:], expected_q[..., rotary_dim:], NORM_TOLERANCE)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), HEAD_SHAPES)
def test_qk_norm_rope_store_writes_what_qk_norm_rope_returns(head_dim: int, rotary_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(head_dim + 1)
    q, k, cos, sin = _rope_inputs(gen, 7, head_dim, rotary_dim)
    v = _randn(gen, 7, KV_HEADS, head_dim)
    norms = (
        _norm(head_dim, True, gen).weight.detach(),
        _norm(head_dim, True, gen).weight.detach(),
        EPS,
        True,
    )
    keys = torch.zeros(4, 16, KV_HEADS, head_dim, dtype=torch.bfloat16, device="cuda")
    values = torch.zeros_like(keys)
    slots = torch.tensor([3, 17, 18, 40, 63, 0, 33], device="cuda")
    got_q = qk_norm_rope_store(q, k, v, *norms, cos, sin, keys, values, slots)
    expected_q, expected_k = qk_norm_rope(q, k, *norms, cos, sin)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(keys.view(-1, KV_HEADS, head_dim)[slots], expected_k)
    assert torch.equal(values.view(-1, KV_HEADS, head_dim)[slots], v)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), HEAD_SHAPES)
def test_rows_are_bit_identical_whatever_shares_the_batch(head_dim: int, rotary_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    rows, row = 300, 137
    one, few = slice(row, row + 1), slice(row - 3, row + 4)
    weight = (0.2 * torch.randn(HIDDEN, generator=gen, device="cuda") + 1.0).bfloat16()
    x, residual = _strided(_randn(gen, rows, HIDDEN)), _randn(gen, rows, HIDDEN)
    batched = rms_norm(x, weight, EPS, True)
    assert torch.equal(batched[one], rms_norm(x[one], weight, EPS, True))
    assert torch.equal(batched[few], rms_norm(x[few], weight, EPS, True))
    batched_sum = add_rms_norm(x, residual, weight, EPS, False)
    alone_sum = add_rms_norm(x[one], residual[one], weight, EPS, False)
    assert torch.equal(batched_sum[0][one], alone_sum[0]) and torch.equal(batched_sum[1][one], alone_sum[1])
    dv_weight = weight[:DV]
    gate = _randn(gen, rows, DV)
    values = _randn(gen, rows, DV, dtype=torch.float32)
    batched = gated_rms_norm(values, gate, dv_weight, EPS)
    assert torch.equal(batched[one], gated_rms_norm(values[one], gate[one], dv_weight, EPS))

    q, k, cos, sin = _rope_inputs(gen, rows, head_dim, rotary_dim)
    q_weight, k_weight = weight[:head_dim], weight[head_dim : 2 * head_dim]
    batched_q, batched_k = qk_norm_rope(q, k, q_weight, k_weight, EPS, True, cos, sin)
    for rows_slice in (one, few):
        alone_q, alone_k = qk_norm_rope(
            q[rows_slice], k[rows_slice], q_weight, k_weight, EPS, True, cos[rows_slice], sin[rows_slice]
        )
        assert torch.equal(batched_q[rows_slice], alone_q) and torch.equal(batched_k[rows_slice], alone_k)


def test_replays_in_a_cuda_graph() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens, head_dim, rotary_dim = 8, 256, 64
    weight = (0.2 * torch.randn(HIDDEN, generator=gen, device="cuda")).bfloat16()
    x, residual = _randn(gen, tokens, HIDDEN), _randn(gen, tokens, HIDDEN)
    q, k, cos, sin = _rope_inputs(gen, tokens, head_dim, rotary_dim)
    q_weight, k_weight = weight[:head_dim], weight[head_dim : 2 * head_dim]

    def step(
        x: torch.Tensor, residual: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        normed, new_residual = add_rms_norm(x, residual, weight, EPS, True)
        return (normed, new_residual, *qk_norm_rope(q, k, q_weight, k_weight, EPS, True, cos, sin))

    eager = step(x, residual, q, k)  # compiles before capture
    static = [x.clone(), residual.clone(), q.clone(), k.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    for tensor in static:
        tensor.normal_(generator=gen)
    graph.replay()
    assert not torch.equal(captured[0], eager[0])
    for tensor, original in zip(static, (x, residual, q, k), strict=True):
        tensor.copy_(original)
    graph.replay()
    for got, expected in zip(captured, eager, strict=True):
        assert torch.equal(got, expected)
