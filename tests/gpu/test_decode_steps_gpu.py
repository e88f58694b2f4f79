"""The Triton set's fused decode steps on a CUDA device at Qwen3-Next-80B-A3B's sizes, in bf16: the Gated
DeltaNet layer's step (app/kernels/triton_gdn_decode.py) and the MoE block with its shared expert
(app/kernels/triton_moe_block.py) against the same layers' pieces, a row alone and in a window, and in a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

from app.engine.paged_state import PagedState
from app.kernels.backends import select_backends
from app.kernels.triton_moe_block import MAX_ROWS, _arrivals
from app.models.batch import ForwardBatch
from app.models.config import ModelConfig
from app.models.gdn import GatedDeltaNet
from app.models.moe import SparseMoE
from app.models.qwen3 import DecoderLayer
from benchmarks.shapes import shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SLOTS = 40
ROWS = [3, 17, 5, 0, 29, 11, 8, 21]  # a window's rows, by state slot


def _config() -> ModelConfig:
    """Qwen3-Next-80B-A3B's sizes (benchmarks/shapes.py), four layers, a small vocabulary and context."""
    config = shape("qnext", 4)
    config.update(vocab_size=1024, max_position_embeddings=4096)
    return ModelConfig.from_dict(config)


@pytest.fixture(scope="module")
def layer() -> DecoderLayer:
    """Layer 0 (Gated DeltaNet + MoE) at full size with random bf16 weights of the checkpoints' scale."""
    torch.manual_seed(0)
    built = DecoderLayer(_config(), 0, "linear_attention", True, select_backends("triton", "cuda"))
    with torch.no_grad():
        for name, p in built.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
    return built.cuda().bfloat16()


def _state(seed: int) -> PagedState:
    """Paged state of the layer's sizes whose Gated DeltaNet pools hold random values."""
    state = PagedState(_config(), blocks=8, block_size=16, slots=SLOTS, dtype=torch.bfloat16, device=CUDA)
    conv, recurrent = state.linear_pools(0)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    conv.copy_(torch.randn(conv.shape, generator=generator, device="cuda"))
    recurrent.copy_(0.1 * torch.randn(recurrent.shape, generator=generator, device="cuda"))
    return state


def _gdn_step(
    mixer: GatedDeltaNet, x: torch.Tensor, slots: list[int], fused: bool
) -> tuple[torch.Tensor, ...]:
    """The mixer over a window of one decode row per slot, by its fused step or its pieces: the output and
    the pools afterwards."""
    state = _state(7)
    for slot in slots:
        state.set_block_table(slot, [0])
    batch = ForwardBatch.build([(slot, [0], 9) for slot in slots], state, CUDA)
    batch.layout = state.layout(batch.spans)
    step = mixer.decode_step
    mixer.decode_step = step if fused else None
    try:
        with torch.inference_mode():
            out = mixer(x, batch)
    finally:
        mixer.decode_step = step
    return (out, *state.linear_pools(0))


def test_the_gated_deltanet_step_equals_its_pieces(layer: DecoderLayer) -> None:
    mixer = layer.linear_attn
    assert mixer is not None
    x = torch.randn(len(ROWS), 2048, device="cuda").bfloat16()
    fused = _gdn_step(mixer, x, ROWS, fused=True)
    pieces = _gdn_step(mixer, x, ROWS, fused=False)
    torch.testing.assert_close(fused[0], pieces[0], rtol=2e-2, atol=2e-3)
    assert torch.equal(fused[1], pieces[1])  # the conv window moves by the same inputs
    torch.testing.assert_close(fused[2], pieces[2], rtol=1e-4, atol=1e-5)
    alone = _gdn_step(mixer, x[2:3], ROWS[2:3], fused=True)
    # the state's bits do not depend on the window; the output projection's may (cuBLAS beyond one row)
    assert torch.equal(alone[2][ROWS[2]], fused[2][ROWS[2]])
    torch.testing.assert_close(alone[0][0], fused[0][2], rtol=1e-2, atol=1e-3)


def test_the_moe_block_equals_its_pieces_and_a_row_its_window(layer: DecoderLayer) -> None:
    block = layer.mlp
    assert isinstance(block, SparseMoE) and block.block_kernel is not None
    x = torch.randn(len(ROWS), 2048, device="cuda").bfloat16()
    kernel = block.block_kernel
    with torch.inference_mode():
        fused = block(x)
        alone = block(x[5:6])
        block.block_kernel = None
        try:
            pieces = block(x)
        finally:
            block.block_kernel = kernel
    torch.testing.assert_close(fused, pieces, rtol=2e-2, atol=2e-3)
    assert torch.equal(alone[0], fused[5])


def test_the_moe_blocks_rows_are_routed_window_after_window(layer: DecoderLayer) -> None:
    """A row is routed by the router program that arrives last on the row's counter: windows of 1, 16 and 7
    rows run back to back, unsynchronised, give the same bits every time and leave every counter at 0."""
    block = layer.mlp
    assert isinstance(block, SparseMoE)
    with torch.inference_mode():
        for rows in (1, MAX_ROWS, 7):
            x = torch.randn(rows, 2048, device="cuda").bfloat16()
            outs = [block(x) for _ in range(40)]
            assert all(torch.equal(out, outs[0]) for out in outs)
    assert _arrivals(CUDA).sum().item() == 0


def test_both_steps_replay_from_a_cuda_graph(layer: DecoderLayer) -> None:
    mixer, block = layer.linear_attn, layer.mlp
    assert mixer is not None and mixer.decode_step is not None and isinstance(block, SparseMoE)
    x = torch.randn(len(ROWS), 2048, device="cuda").bfloat16()
    weights = mixer.weights()
    slots = torch.tensor(ROWS, device="cuda")
    conv, recurrent = _state(3).linear_pools(0)
    start = conv.clone(), recurrent.clone()
    with torch.inference_mode():
        eager = block(mixer.decode_step(x, weights, conv, recurrent, slots))
        after = conv.clone(), recurrent.clone()
        conv.copy_(start[0])
        recurrent.copy_(start[1])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(mixer.decode_step(x, weights, conv, recurrent, slots))  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        conv.copy_(start[0])
        recurrent.copy_(start[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(mixer.decode_step(x, weights, conv, recurrent, slots))
        conv.copy_(start[0])
        recurrent.copy_(start[1])
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(conv, after[0]) and torch.equal(recurrent, after[1])
