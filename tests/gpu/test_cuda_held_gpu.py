"""The CUDA kernels of held Q4_K and Q8_0 experts (app/kernels/cuda_held.py, native/held_experts.cu) at
Qwen3-30B-A3B's shapes: they serve where they should, match the reference on the blocks' values, skip pairs
whose id is negative, and give a pair the same bits whatever else its window holds."""

from __future__ import annotations

import pytest
import torch

from app.kernels import cuda_held
from app.kernels.gguf_quants import dequantize, random_blocks, to_held
from app.kernels.reference import experts_reference
from app.kernels.triton_moe import fused_experts
from app.kernels.triton_norm import rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


@pytest.fixture(scope="module", params=cuda_held.KINDS)
def experts(request: pytest.FixtureRequest) -> tuple:
    kind = request.param
    gate_up_blocks = random_blocks(kind, (EXPERTS, 2 * INTER, HIDDEN), 1, device="cuda")
    down_blocks = random_blocks(kind, (EXPERTS, HIDDEN, INTER), 2, device="cuda")
    return (
        kind,
        to_held(kind, gate_up_blocks),
        to_held(kind, down_blocks),
        dequantize(kind, gate_up_blocks, (EXPERTS, 2 * INTER, HIDDEN)),
        dequantize(kind, down_blocks, (EXPERTS, HIDDEN, INTER)),
    )


def _window(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, device="cuda", generator=g).bfloat16()
    return x, ids, weights


@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
def test_cuda_experts_match_the_reference(experts: tuple, tokens: int) -> None:
    kind, gate_up, down, gate_up_values, down_values = experts
    x, ids, weights = _window(tokens, tokens)
    ids[0, 1] = -1  # an expert not resident (the tier): its pair adds nothing
    pairs = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind))
    assert pairs is not None, "the CUDA kernels did not serve"
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
    by_choice = pairs.view(tokens, TOP_K, HIDDEN).float()
    got = torch.where(ids[..., None] >= 0, by_choice, 0.0).sum(1)  # a negative id's row is never written
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)
    if cuda_held.serves_experts((kind, kind)):  # the engine's path: these pairs, summed and rounded to bf16
        fused = fused_experts(x, ids, weights, gate_up, down).float()
        torch.testing.assert_close(fused / scale, got / scale, atol=1e-2, rtol=0)


def test_q8_0_down_reads_large_activations_in_halves(experts: tuple) -> None:
    """DOWN_HALF: gate_up hands Q8_0's down its output as fp16 of act / 64, so activations far beyond fp16's
    range (a hidden state 256 times a normed one: act near 10^6) keep the reference's values."""
    kind, gate_up, down, gate_up_values, down_values = experts
    if not cuda_held.down_reads_half(kind):
        pytest.skip("down reads bf16 for this kind")
    x, ids, weights = _window(8, 5)
    x = (x.float() * 256).bfloat16()
    pairs = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind))
    assert pairs is not None, "the CUDA kernels did not serve"
    gate, up = (x.float() @ gate_up_values[ids[0, 0]].T).chunk(2, dim=-1)
    assert (torch.nn.functional.silu(gate) * up).abs().max() > 65504  # beyond fp16's range
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
    got = pairs.view(8, TOP_K, HIDDEN).float().sum(1)
    assert torch.isfinite(got).all()
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)


@pytest.mark.parametrize(("gate_up_kind", "down_kind"), [("Q4_K", "Q8_0"), ("Q8_0", "Q4_K")])
def test_experts_of_two_kinds_hand_down_its_input_as_it_reads_it(gate_up_kind: str, down_kind: str) -> None:
    """A file whose gate and up are held as one kind and down as the other: gate_up writes down's input as
    the down's kind reads it (fp16 of a 64th for a Q8_0 down, `down_reads_half`; bf16 for Q4_K's)."""
    gate_up_blocks = random_blocks(gate_up_kind, (EXPERTS, 2 * INTER, HIDDEN), 3, device="cuda")
    down_blocks = random_blocks(down_kind, (EXPERTS, HIDDEN, INTER), 4, device="cuda")
    gate_up, down = to_held(gate_up_kind, gate_up_blocks), to_held(down_kind, down_blocks)
    x, ids, weights = _window(8, 9)
    pairs = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (gate_up_kind, down_kind))
    assert pairs is not None, "the CUDA kernels did not serve"
    expected = experts_reference(
        x.float(),
        ids,
        weights.float(),
        dequantize(gate_up_kind, gate_up_blocks, (EXPERTS, 2 * INTER, HIDDEN)),
        dequantize(down_kind, down_blocks, (EXPERTS, HIDDEN, INTER)),
    )
    got = pairs.view(8, TOP_K, HIDDEN).float().sum(1)
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)


def test_cuda_gives_a_pair_the_same_bits_alone_and_in_any_window(experts: tuple) -> None:
    kind, gate_up, down, _, _ = experts
    x, ids, weights = _window(64, 7)
    full = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind))
    for tokens in (1, 2, 3, 8, 33):
        window = (x[-tokens:], ids[-tokens:], weights[-tokens:])
        part = cuda_held.expert_pairs(*window, gate_up, down, (kind, kind))
        assert torch.equal(part[-TOP_K:], full[-TOP_K:]), tokens


def test_a_deep_ring_for_down_keeps_the_values_and_a_pairs_bits(
    experts: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DOWN_STAGES: the experts' down projection's warps copy up to 3 iterations (all of q30's 6 at 2 warps)
    before gate_up ends: the reference's values, and a pair's bits alone as in a window, as with the default
    ring (the ring's depth never changes the order of a row's sums)."""
    kind, gate_up, down, gate_up_values, down_values = experts
    x, ids, weights = _window(64, 8)
    shallow = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind))
    monkeypatch.setitem(cuda_held.DEFINES, "DOWN_STAGES", "4")
    cuda_held._kernels.cache_clear()
    try:
        for tokens in (1, 8, 64):
            window = (x[-tokens:], ids[-tokens:], weights[-tokens:])
            pairs = cuda_held.expert_pairs(*window, gate_up, down, (kind, kind))
            assert pairs is not None and torch.equal(pairs[-TOP_K:], shallow[-TOP_K:]), tokens
        expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
        got = pairs.view(64, TOP_K, HIDDEN).float().sum(1)
        scale = expected.abs().max()
        torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)
    finally:
        cuda_held._kernels.cache_clear()


def test_a_block_an_expert_finding_its_pairs_gives_the_tiles_bits(
    experts: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PER_EXPERT_TOKENS: windows of 3 to 8 tokens with a block an expert, each finding its pairs in the
    routing (a pair not resident skipped), give the grouping launch's tiles' bits and the reference's
    values."""
    kind, gate_up, down, gate_up_values, down_values = experts
    x, ids, weights = _window(8, 11)
    ids[2, 3] = -1
    for tokens in (3, 8):
        window = (x[-tokens:], ids[-tokens:], weights[-tokens:])
        monkeypatch.setitem(cuda_held.PER_EXPERT_TOKENS, kind, 0)
        tiles = cuda_held.expert_pairs(*window, gate_up, down, (kind, kind))
        monkeypatch.setitem(cuda_held.PER_EXPERT_TOKENS, kind, 8)
        found = cuda_held.expert_pairs(*window, gate_up, down, (kind, kind))
        kept = (window[1] >= 0).flatten()
        assert found is not None and torch.equal(found[kept], tiles[kept]), tokens
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
    got = torch.where(ids[..., None] >= 0, found.view(8, TOP_K, HIDDEN).float(), 0.0).sum(1)
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)


def test_cuda_leaves_wider_windows_and_other_dtypes_to_triton(experts: tuple) -> None:
    kind, gate_up, down, _, _ = experts
    x, ids, weights = _window(cuda_held.DECODE_TOKENS + 1, 3)
    assert cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind)) is None
    assert cuda_held.expert_pairs(x[:4].half(), ids[:4], weights[:4], gate_up, down, (kind, kind)) is None


@pytest.mark.parametrize("kind", cuda_held.KINDS)
@pytest.mark.parametrize("shape", [(5120, HIDDEN), (HIDDEN, 4096), (151936, HIDDEN)])
def test_cuda_projections_match_the_reference_and_keep_row_bits(kind: str, shape: tuple[int, int]) -> None:
    _check_projection(kind, shape, 4)


def _check_projection(kind: str, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random held weight of `shape` projected by the CUDA kernels at DECODE_TOKENS rows against the
    dequantized reference, and a row's bits in windows of 1, 5 and 9 rows as in that one: (weight, x)."""
    blocks = random_blocks(kind, shape, seed, device="cuda")
    weight, values = to_held(kind, blocks), dequantize(kind, blocks, shape)
    x = torch.randn(cuda_held.DECODE_TOKENS, shape[1], device="cuda").bfloat16()
    full = cuda_held.linear(x, weight, kind)
    assert full is not None, "the CUDA kernels did not serve"
    expected = x.float() @ values.T
    scale = expected.abs().max()
    torch.testing.assert_close(full.float() / scale, expected / scale, atol=1e-2, rtol=0)
    for rows in (1, 5, 9):
        assert torch.equal(cuda_held.linear(x[-rows:], weight, kind)[-1], full[-1]), rows
    return weight, x


def test_cuda_kernels_launched_dependently_in_a_graph_read_what_came_before(experts: tuple) -> None:
    """Replayed in a CUDA graph after a Triton kernel (both launched dependently on Hopper), the projection
    and the experts read that kernel's output of this replay, not an earlier one, and give eager's bits."""
    kind, gate_up, down, _, _ = experts
    x_in, ids, weights = _window(8, 11)
    norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm(x_in, norm, 1e-6, False)
        pairs = cuda_held.expert_pairs(x, ids, weights, gate_up, down, (kind, kind))
        return cuda_held.linear(x, gate_up[0], kind), rms_norm(pairs, norm, 1e-6, False)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (12, 13):
        x_in.copy_(_window(8, seed)[0])
        expected = step()
        graph.replay()
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want), seed


def test_q8_0_gate_and_up_in_fp16_or_bf16_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both builds of Q8_0's gate and up (Q8_HALF: fp16 operands, one MMA a code, the default; Q8_HALF=0:
    bf16, two): the reference's values, a pair's bits alone as in a window, and each other's values."""
    default = _window(8, 11)
    gate_up_blocks = random_blocks("Q8_0", (EXPERTS, 2 * INTER, HIDDEN), 1, device="cuda")
    down_blocks = random_blocks("Q8_0", (EXPERTS, HIDDEN, INTER), 2, device="cuda")
    gate_up, down = to_held("Q8_0", gate_up_blocks), to_held("Q8_0", down_blocks)
    gate_up_values = dequantize("Q8_0", gate_up_blocks, (EXPERTS, 2 * INTER, HIDDEN))
    down_values = dequantize("Q8_0", down_blocks, (EXPERTS, HIDDEN, INTER))
    kinds = ("Q8_0", "Q8_0")
    built = {}
    try:
        for half in ("1", "0"):
            monkeypatch.setitem(cuda_held.DEFINES, "Q8_HALF", half)
            cuda_held._kernels.cache_clear()
            for tokens in (1, 8, 64):
                x, ids, weights = _window(tokens, tokens)
                pairs = cuda_held.expert_pairs(x, ids, weights, gate_up, down, kinds)
                assert pairs is not None, "the CUDA kernels did not serve"
                expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
                got = pairs.view(tokens, TOP_K, HIDDEN).float().sum(1)
                scale = expected.abs().max()
                torch.testing.assert_close(got / scale, expected / scale, atol=1e-2, rtol=0)
                alone = cuda_held.expert_pairs(x[2:3], ids[2:3], weights[2:3], gate_up, down, kinds)
                assert tokens < 3 or torch.equal(alone, pairs[2 * TOP_K : 3 * TOP_K])
            built[half] = cuda_held.expert_pairs(*default, gate_up, down, kinds)
        assert built["1"] is not None and built["0"] is not None
        scale = built["0"].float().abs().max()
        torch.testing.assert_close(built["1"].float() / scale, built["0"].float() / scale, atol=1e-2, rtol=0)
    finally:
        cuda_held._kernels.cache_clear()


@pytest.mark.parametrize("stages", [5, 9])
@pytest.mark.parametrize("kind", cuda_held.KINDS)
def test_projections_with_a_deep_ring_match_the_reference_and_keep_row_bits(
    stages: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DENSE_STAGES: a dense projection's warps copy up to stages - 1 iterations before the kernel before it
    ends (every one of qkv's and the LM head's at 4 warps, half of o's at 5): the reference's values, a row's
    bits alone as in any window, and, replayed in a graph after a Triton kernel that writes x (both launched
    dependently on Hopper), that replay's x read."""
    monkeypatch.setitem(cuda_held.DEFINES, "DENSE_STAGES", str(stages))
    cuda_held._kernels.cache_clear()
    try:
        for shape in [(5120, HIDDEN), (HIDDEN, 4096), (151936, HIDDEN)]:
            weight, x = _check_projection(kind, shape, 6)
            x_in = x[:8].clone()
            norm = torch.ones(shape[1], device="cuda", dtype=torch.bfloat16)

            def step(weight: torch.Tensor = weight, x_in: torch.Tensor = x_in, norm: torch.Tensor = norm):
                return cuda_held.linear(rms_norm(x_in, norm, 1e-6, False), weight, kind)

            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            for seed in (1, 2):
                x_in.copy_(torch.randn(x_in.shape, generator=torch.Generator().manual_seed(seed)).to(x_in))
                expected = step()
                graph.replay()
                assert torch.equal(captured, expected), (shape, seed)
    finally:
        cuda_held._kernels.cache_clear()


@pytest.mark.parametrize("kind", cuda_held.KINDS)
@pytest.mark.parametrize("shape", [(5120, HIDDEN), (HIDDEN, 4096)])
def test_projections_split_over_blocks_match_the_reference_and_keep_row_bits(
    kind: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """k split over several blocks a column tile (SPLIT_WAVES), the last to finish adding the splits in
    order: the reference's values, a row's bits alone as in any window, and in a graph replayed twice (the
    tiles' counters back to 0 after every launch)."""
    monkeypatch.setattr(cuda_held, "SPLIT_WAVES", 2.0)
    kernels = cuda_held._kernels(torch.empty(0, device="cuda").device)  # the key the launches use: cuda:N
    assert kernels is not None and kernels.splits(kind, shape[1], shape[0]) > 1
    weight, x = _check_projection(kind, shape, 5)
    window = x[:8].clone()
    eager = cuda_held.linear(window, weight, kind)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_held.linear(window, weight, kind)
    for _ in range(2):
        graph.replay()
        assert torch.equal(captured, eager)
    assert kernels.arrivals.sum().item() == 0
