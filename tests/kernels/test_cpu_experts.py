"""The CPU expert pool's native kernel against its torch reference: fp32, bf16 and int8 weights, and GGUF
blocks read in place."""

from __future__ import annotations

import logging
import time

import gguf
import pytest
import torch

from app.kernels import cpu_experts
from app.kernels.cpu_experts import (
    DENSE_WEIGHTS,
    add_rms_norm,
    dense,
    expert_swiglu,
    expert_swiglu_reference,
    experts_swiglu_sum,
    experts_swiglu_sum_reference,
    gated_rms_norm,
    moe_block,
    moe_block_reference,
    native_available,
    rms_norm,
    route,
    routed_experts,
)
from app.kernels.gguf_quants import random_blocks, to_held
from app.kernels.reference import experts_reference
from app.models.layers import GatedRMSNorm, RMSNorm

HIDDEN, INTER = 96, 40
# The first four sums of test_k_quant_experts_sum_their_token_vectors_quantized_to_int8 at one row, as the
# native kernel's AVX-512, AVX2 and plain loops each gave them (every build must)
WRITTEN_DOWN = {
    "Q4_K": 0.4745429754257202,
    "Q5_K": -4.947571277618408,
    "Q6_K": -0.4790056049823761,
    "Q4_K+Q6_K": -0.4708276391029358,
}


def _weights(kind: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    if kind == torch.int8:
        gate_up = torch.randint(-127, 128, (2 * INTER, HIDDEN), dtype=torch.int8, generator=generator)
        down = torch.randint(-127, 128, (HIDDEN, INTER), dtype=torch.int8, generator=generator)
        gate_up_scales = torch.rand(2 * INTER, generator=generator) * 1e-3
        return gate_up, down, gate_up_scales, torch.rand(HIDDEN, generator=generator) * 1e-3
    gate_up = (torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.1).to(kind)
    down = (torch.randn(HIDDEN, INTER, generator=generator) * 0.1).to(kind)
    return gate_up, down, None, None


def test_the_native_kernel_is_built() -> None:
    """The install builds it wherever a C++ compiler with OpenMP exists (CI included)."""
    assert native_available()


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 7])
def test_the_native_kernel_equals_the_reference(kind: torch.dtype, rows: int) -> None:
    gate_up, down, gate_up_scales, down_scales = _weights(kind, rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(9))
    expected = expert_swiglu_reference(x, gate_up, down, gate_up_scales, down_scales)
    got = expert_swiglu(x, gate_up, down, gate_up_scales, down_scales)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _stacked(kind: torch.dtype, experts: int) -> tuple[torch.Tensor | None, ...]:
    parts = [_weights(kind, seed) for seed in range(experts)]
    return tuple(None if p[0] is None else torch.stack(list(p)) for p in zip(*parts, strict=True))


@pytest.mark.parametrize("kind", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_several_experts_in_one_call_equal_the_reference(kind: torch.dtype) -> None:
    """A window's CPU share: experts 4, 1 and 5 of a stacked layer over 1, 6 and 2 of its 7 rows, weighted
    and added at those rows (rows shared between experts add up)."""
    gate_up, down, gate_up_scales, down_scales = _stacked(kind, 6)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3))
    experts = torch.tensor([4, 1, 5])
    offsets = torch.tensor([0, 1, 7, 9])
    rows = torch.tensor([3, 0, 1, 2, 3, 5, 6, 3, 6])
    weights = torch.rand(9, generator=torch.Generator().manual_seed(4))
    args = (x, experts, offsets, rows, weights, gate_up, down, gate_up_scales, down_scales)
    expected = experts_swiglu_sum_reference(*args)
    assert expected[4].abs().sum() == 0  # a row no expert took
    torch.testing.assert_close(experts_swiglu_sum(*args), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_an_experts_leading_channels_alone_equal_the_reference(kind: torch.dtype) -> None:
    """An expert's share of its intermediate channels (the first `channels`, the rest summed elsewhere: the
    expert tier's split miss) equals the reference's; a count outside the expert, a count missing, or GGUF
    blocks are refused."""
    gate_up, down, gate_up_scales, down_scales = _stacked(kind, 6)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3))
    routing = (torch.tensor([4, 1, 5]), torch.tensor([0, 1, 7, 9]), torch.tensor([3, 0, 1, 2, 3, 5, 6, 3, 6]))
    weights = torch.rand(9, generator=torch.Generator().manual_seed(4))
    args = (x, *routing, weights, gate_up, down, gate_up_scales, down_scales)
    channels = torch.tensor([16, INTER, 24])
    expected = experts_swiglu_sum_reference(*args, channels=channels)
    got = experts_swiglu_sum(*args, channels=channels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, experts_swiglu_sum(*args), rtol=1e-3, atol=1e-4)
    for bad in ([0, 16, 16], [16, INTER + 1, 16], [16, 16]):
        with pytest.raises(ValueError):
            experts_swiglu_sum(*args, channels=torch.tensor(bad))
    held_gate_up, _ = _blocks("Q8_0", 6, 2 * 64, HIDDEN, 1)
    held_down, _ = _blocks("Q8_0", 6, HIDDEN, 64, 2)
    with pytest.raises(ValueError, match="channels are for"):
        experts_swiglu_sum(x, *routing, weights, held_gate_up, held_down, channels=torch.tensor([32, 32, 32]))


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_sets_routed_experts_equal_the_reference_and_each_row_its_lone_self(
    kind: torch.dtype,
) -> None:
    """The CPU backend set's experts kernel (native, one call a layer) against the torch reference; and every
    row's result bit for bit the same as when it runs alone (a batch never changes a row's tokens)."""
    gate_up, down, _, _ = _stacked(torch.float32, 6)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5)).to(kind)
    ids = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(r))[:3] for r in range(9)])
    weights = torch.rand(9, 3, generator=torch.Generator().manual_seed(6)).to(kind)
    gate_up, down = gate_up.to(kind), down.to(kind)
    got = routed_experts(x, ids, weights, gate_up, down)
    assert got.dtype == kind
    expected = experts_reference(x.float(), ids, weights.float(), gate_up.float(), down.float())
    torch.testing.assert_close(got.float(), expected, rtol=1e-5 if kind == torch.float32 else 2e-2, atol=1e-5)
    for row in range(9):
        alone = routed_experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], gate_up, down)
        assert torch.equal(alone[0], got[row])


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "routed-only"])
def test_a_whole_moe_block_in_one_call_equals_its_pieces(kind: torch.dtype, shared: bool) -> None:
    """Router, picks and counts (padding rows not counted), routed experts and the gated shared expert in
    one native call against the torch reference; each row bit for bit its lone self."""
    generator = torch.Generator().manual_seed(11)
    gate_up, down, _, _ = _stacked(kind, 6)
    x = torch.randn(5, HIDDEN, generator=generator)
    router = torch.randn(6, HIDDEN, generator=generator)
    parts = None
    if shared:
        shapes = ((24, HIDDEN), (24, HIDDEN), (HIDDEN, 24))
        weights = [(torch.randn(shape, generator=generator) * 0.1).to(kind) for shape in shapes]
        parts = (*weights, torch.randn(1, HIDDEN, generator=generator))
    live = torch.tensor([1, 1, 0, 1, 1])
    counts, expected_counts = torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    got = moe_block(x, router, 3, True, counts, live, gate_up, down, parts)
    expected = moe_block_reference(x, router, 3, True, expected_counts, live, gate_up, down, parts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, expected_counts) and int(counts.sum()) == 4 * 3
    for row in range(5):
        fresh = torch.zeros(6, dtype=torch.int64)
        alone = moe_block(x[row : row + 1], router, 3, True, fresh, None, gate_up, down, parts)
        assert torch.equal(alone[0], got[row])


def _blocks(kind: str, experts: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked random weights as GGUF blocks of `kind` [experts, rows, row bytes] (uint8, as kernels hold
    them) and the values the `gguf` package's dequantizer gives them."""
    if kind == "Q8_0":
        values = (
            torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1
        ).numpy()
        blocks = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).copy())
    else:
        blocks = random_blocks(kind, (experts, rows, cols), seed)
    dequantized = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])
    return to_held(kind, blocks), torch.from_numpy(dequantized.copy())


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("kind", ["Q8_0", "IQ4_XS", "IQ3_XXS", "IQ3_S"])
def test_held_experts_give_the_bits_of_their_dequantized_fp32_copy(kind: str, rows: int) -> None:
    """GGUF's blocks read in place (Q8_0, the i-quants through the tables the kernel is
    handed): the routed experts, a window's CPU share and a whole MoE block give bit for bit what the same
    kernels give on the fp32 values GGUF's own dequantizer makes of them (9 rows: some expert's rows are
    widened once for several passes), and the torch reference's result."""
    hidden, inter = (HIDDEN, 64) if kind == "Q8_0" else (256, 256)
    gate_up, gate_up_values = _blocks(kind, 6, 2 * inter, hidden, rows)
    down, down_values = _blocks(kind, 6, hidden, inter, rows + 1)
    assert cpu_experts.expert_sizes(gate_up, down) == (hidden, inter)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(rows, hidden, generator=generator)
    ids = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(rows)])
    ids[:, 0] = 2  # every row takes expert 2
    weights = torch.rand(rows, 3, generator=generator)
    got = routed_experts(x, ids, weights, gate_up, down)
    assert torch.equal(got, routed_experts(x, ids, weights, gate_up_values, down_values))
    expected = experts_reference(x, ids, weights, gate_up_values, down_values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grouped = cpu_experts.by_expert(ids, weights)
    share = experts_swiglu_sum(x, *grouped, gate_up, down)
    assert torch.equal(share, experts_swiglu_sum(x, *grouped, gate_up_values, down_values))
    torch.testing.assert_close(
        experts_swiglu_sum_reference(x, *grouped, gate_up, down), share, rtol=1e-5, atol=1e-5
    )
    router = torch.randn(6, hidden, generator=generator)
    counts = [torch.zeros(6, dtype=torch.int64) for _ in range(2)]
    block = moe_block(x, router, 3, True, counts[0], None, gate_up, down, None)
    assert torch.equal(
        block, moe_block(x, router, 3, True, counts[1], None, gate_up_values, down_values, None)
    )


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q4_K+Q6_K"])
def test_k_quant_experts_sum_their_token_vectors_quantized_to_int8(kind: str, rows: int) -> None:
    """Q4_K, Q5_K and Q6_K experts read their token vectors and intermediate rows quantized to int8 a block of
    256 at a time (integer dot products): the routed experts, a window's CPU share and a whole MoE block agree
    with the torch reference that quantizes them so, far closer than with the fp32 vectors; every row's
    result is the same bit for bit alone as in its batch; and the AVX-512, AVX2 and plain loops give the same
    bits (a result written down from each). "Q4_K+Q6_K": Q4_K gates and ups beside Q6_K down projections, as
    in a Q4_K_M file, each read as its own type."""
    hidden, inter = 512, 256
    gate_kind, down_kind = (kind.split("+") * 2)[:2]
    gate_up, gate_up_values = _blocks(gate_kind, 5, 2 * inter, hidden, 1)
    down, down_values = _blocks(down_kind, 5, hidden, inter, 2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, hidden, generator=generator)
    ids = torch.stack([torch.randperm(5, generator=generator)[:3] for _ in range(rows)])
    weights = torch.rand(rows, 3, generator=generator)
    grouped = cpu_experts.by_expert(ids, weights)
    got = routed_experts(x, ids, weights, gate_up, down)
    expected = experts_swiglu_sum_reference(x, *grouped, gate_up, down)
    unquantized = experts_reference(x, ids, weights, gate_up_values, down_values)
    # a code a rounding boundary away from the reference's moves a result by about a step times a weight
    tolerance = 2e-3 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    assert float((unquantized - expected).abs().max()) > 5 * float((got - expected).abs().max())
    torch.testing.assert_close(experts_swiglu_sum(x, *grouped, gate_up, down), got, rtol=0, atol=1e-5)
    for row in range(rows):
        alone = routed_experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], gate_up, down)
        assert torch.equal(alone[0], got[row])
    router = torch.randn(5, hidden, generator=generator)
    counts = [torch.zeros(5, dtype=torch.int64) for _ in range(2)]
    block = moe_block(x, router, 3, True, counts[0], None, gate_up, down, None)
    reference = moe_block_reference(x, router, 3, True, counts[1], None, gate_up, down, None)
    torch.testing.assert_close(block, reference, rtol=0, atol=tolerance)
    if rows == 1 and native_available():
        assert float(got[0, :4].sum()) == WRITTEN_DOWN[kind]


@pytest.mark.parametrize("rows", [1, 40])
def test_bf16_weights_of_an_fp32_model_give_the_fp32_result(rows: int) -> None:
    """A bf16 weight kept narrow in an fp32 model (any size): the result of its fp32 copy, natively for a
    few rows and through torch (widened) for many."""
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(24, 64, generator=generator) * 0.1).bfloat16()
    x = torch.randn(rows, 64, generator=generator)
    got = dense(x, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight.float()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_the_cpu_sets_dense_projections_equal_torch(kind: torch.dtype, rows: int) -> None:
    """A few rows times a large weight through the native kernel, the others through torch: torch's result
    either way (with and without a bias; bf16 weights read as they are, the result in x's dtype)."""
    generator = torch.Generator().manual_seed(rows)
    out_features = DENSE_WEIGHTS // 64 + 3
    weight = (torch.randn(out_features, 64, generator=generator) * 0.1).to(kind)
    bias = torch.randn(out_features, generator=generator).to(kind)
    x = torch.randn(rows, 64, generator=generator).to(kind)
    for b in (None, bias):
        expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if kind == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        got = dense(x, weight, b)
        assert got.dtype == kind and got.shape == (rows, out_features)
        torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [False, True], ids=["scale", "offset"])
def test_the_cpu_sets_norms_equal_the_models_reference_norms(kind: torch.dtype, offset: bool) -> None:
    """RMSNorm, residual add + RMSNorm and the gated norm of the CPU set (native for fp32, torch for bf16)
    against the model's own modules without kernels."""
    generator = torch.Generator().manual_seed(int(offset))
    x, h, gate = (torch.randn(5, 48, generator=generator).to(kind) for _ in range(3))
    norm, gated = RMSNorm(48, 1e-6, offset=offset), GatedRMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=generator) * 0.1 + (0.0 if offset else 1.0))
        gated.weight.copy_(torch.randn(48, generator=generator) * 0.1 + 1.0)
    norm, gated = norm.to(kind), gated.to(kind)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if kind == torch.float32 else {"rtol": 0.0, "atol": 0.0}
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6, offset), norm(x), **tolerance)
        normed, summed = add_rms_norm(h, x, norm.weight, 1e-6, offset)
        expected, expected_sum = norm.add_forward(h, x)
        torch.testing.assert_close(summed, expected_sum, rtol=0.0, atol=0.0)
        torch.testing.assert_close(normed, expected, **tolerance)
        torch.testing.assert_close(gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate), **tolerance)


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_cpu_sets_router_picks_as_the_models_router_does(kind: torch.dtype, renormalize: bool) -> None:
    """Softmax, top-k and weights as SparseMoE.route (native for fp32, torch for bf16), the picks of real
    rows counted and padding rows' not."""
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(int(renormalize))).to(kind)
    live = torch.tensor([1, 1, 0, 1, 1, 0])
    counts = torch.zeros(16, dtype=torch.int64)
    ids, weights = route(logits, 4, renormalize, counts, live)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    expected_weights, expected_ids = torch.topk(probs, 4, dim=-1)
    if renormalize:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, expected_ids) and weights.dtype == kind
    torch.testing.assert_close(weights, expected_weights.to(kind), rtol=1e-6, atol=1e-6)
    assert torch.equal(counts, torch.bincount(ids[live.bool()].flatten(), minlength=16))


def test_sums_added_into_a_given_buffer_equal_one_call() -> None:
    """Experts added one call at a time into `out`, in expert order, give one call's sum bit for bit (how the
    expert tier keeps a frozen tier exact)."""
    gate_up, down, _, _ = _stacked(torch.float32, 4)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7))
    rows, weights = torch.tensor([0, 2, 1, 2, 0]), torch.rand(5, generator=torch.Generator().manual_seed(8))
    whole = experts_swiglu_sum(x, torch.tensor([1, 3]), torch.tensor([0, 2, 5]), rows, weights, gate_up, down)
    out = torch.zeros(3, HIDDEN)
    for expert, (first, last) in zip([1, 3], [(0, 2), (2, 5)], strict=True):
        span = slice(first, last)
        experts_swiglu_sum(
            x,
            torch.tensor([expert]),
            torch.tensor([0, last - first]),
            rows[span],
            weights[span],
            gate_up,
            down,
            out=out,
        )
    assert torch.equal(out, whole)


def test_a_background_run_gives_the_calls_bits_once_finished() -> None:
    """The pool's run on its own thread (the caller going on meanwhile) adds the foreground call's bits, and
    takes the time it says; a second start before the finish, a finish with nothing started and an argument
    the kernel would have to convert (a copy gone before the run reads it) are refused."""
    gate_up, down, _, _ = _stacked(torch.bfloat16, 4)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7))
    experts, offsets = torch.tensor([1, 3]), torch.tensor([0, 2, 5])
    rows, weights = torch.tensor([0, 2, 1, 2, 0]), torch.rand(5, generator=torch.Generator().manual_seed(8))
    whole = experts_swiglu_sum(x, experts, offsets, rows, weights, gate_up, down)
    out = torch.zeros(3, HIDDEN)
    args = (x, experts, offsets, rows, weights, gate_up, down)
    assert experts_swiglu_sum(*args, out=out, background=True) is out
    with pytest.raises(RuntimeError, match="still going"):
        experts_swiglu_sum(*args, out=out, background=True)
    assert cpu_experts.finish_background() > 0
    assert torch.equal(out, whole)
    with pytest.raises(RuntimeError, match="no background run"):
        cpu_experts.finish_background()
    with pytest.raises(ValueError, match="as given"):
        experts_swiglu_sum(x, experts.int(), offsets, rows, weights, gate_up, down, out=out, background=True)
    with pytest.raises(ValueError, match="adds into"):
        experts_swiglu_sum(x, experts, offsets, rows, weights, gate_up, down, background=True)


def test_a_run_sets_its_done_word_once_its_sums_are_in() -> None:
    """The word a device waits on: 0 while a background run goes, 1 once its sums are in `out` (before the
    caller's finish), and 1 after a call in the caller's thread; a run refused leaves it as it was."""
    gate_up, down, _, _ = _stacked(torch.bfloat16, 4)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))
    experts, offsets = torch.tensor([0, 2]), torch.tensor([0, 1, 3])
    rows, weights = torch.tensor([1, 0, 2]), torch.rand(3, generator=torch.Generator().manual_seed(10))
    args = (x, experts, offsets, rows, weights, gate_up, down)
    whole = experts_swiglu_sum(*args)
    done = torch.full((1,), 7, dtype=torch.int32)
    out = torch.zeros(3, HIDDEN)
    experts_swiglu_sum(*args, out=out, background=True, done=done)
    deadline = time.monotonic() + 10
    while not int(done[0]) and time.monotonic() < deadline:
        time.sleep(1e-4)
    assert int(done[0]) == 1 and torch.equal(out, whole)  # the sums are in before the caller finishes
    cpu_experts.finish_background()
    done[0] = 0
    assert torch.equal(experts_swiglu_sum(*args, done=done), whole) and int(done[0]) == 1
    done[0] = 5
    with pytest.raises(ValueError, match="rows must be"):
        experts_swiglu_sum(x, experts, offsets, torch.tensor([1, 0, 3]), weights, gate_up, down, done=done)
    assert int(done[0]) == 5
    with pytest.raises(ValueError, match="int32"):
        experts_swiglu_sum(*args, done=torch.ones(1))


def test_entries_outside_the_layer_are_refused() -> None:
    gate_up, down, _, _ = _stacked(torch.float32, 2)
    x = torch.randn(3, HIDDEN)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="experts must be"):
        experts_swiglu_sum(x, torch.tensor([2]), torch.tensor([0, 1]), torch.tensor([0]), one, gate_up, down)
    with pytest.raises(ValueError, match="rows must be"):
        experts_swiglu_sum(x, torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([3]), one, gate_up, down)
    with pytest.raises(ValueError, match="offsets"):
        experts_swiglu_sum(x, torch.tensor([1]), torch.tensor([0, 2]), torch.tensor([0]), one, gate_up, down)


def test_bad_weights_are_refused_before_the_native_kernel_reads_them() -> None:
    gate_up, down, _, _ = _weights(torch.float32, 0)
    x = torch.randn(2, HIDDEN)
    with pytest.raises(ValueError, match="shapes"):
        expert_swiglu(x[:, :-1], gate_up, down)
    with pytest.raises(
        ValueError, match="both fp32, bf16, int8, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS or IQ3_S"
    ):
        expert_swiglu(x, gate_up, down.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        expert_swiglu(x, gate_up.T.contiguous().T, down)
    int8_gate_up, int8_down, _, _ = _weights(torch.int8, 0)
    with pytest.raises(ValueError, match="scales"):
        expert_swiglu(x, int8_gate_up, int8_down)


def test_without_the_native_kernel_the_reference_runs_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_experts, "_native", None)
    monkeypatch.setattr(cpu_experts, "_warned", False)
    gate_up, down, _, _ = _weights(torch.bfloat16, 1)
    x = torch.randn(3, HIDDEN)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        for _ in range(2):
            assert torch.equal(expert_swiglu(x, gate_up, down), expert_swiglu_reference(x, gate_up, down))
    assert sum("not built" in r.getMessage() for r in caplog.records) == 1
