"""The Triton set's MoE block with a shared expert (app/kernels/triton_moe_block.py) against the same block's
pieces, in Triton's interpreter: outputs, the routing counts, a row's bits alone or in a window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from app.kernels.backends import select_backends
from app.kernels.triton_moe_block import MAX_ROWS, _arrivals, moe_block
from app.loading.loader import load_model
from app.models.moe import SparseMoE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def _block(checkpoint: Path, dtype: str) -> SparseMoE:
    model = load_model(checkpoint, dtype=dtype, progress=False, backends=select_backends("triton", "cpu"))[0]
    block = next(d.mlp for d in model.model.layers if isinstance(d.mlp, SparseMoE))
    assert block.block_kernel is moe_block and block.shared_expert is not None
    return block


def _run(
    block: SparseMoE, x: torch.Tensor, live: torch.Tensor | None, fused: bool
) -> tuple[torch.Tensor, ...]:
    """The block over x through its fused kernels or its pieces: the output and the picks it counted."""
    kernel = block.block_kernel
    block.block_kernel = kernel if fused else None
    try:
        with torch.inference_mode():
            block.take_routed()
            out = block(x, live)
            return out, block.take_routed()
    finally:
        block.block_kernel = kernel


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("float16", 2e-3)])
def test_the_block_equals_its_pieces(checkpoint: Path, dtype: str, tolerance: float) -> None:
    block = _block(checkpoint, dtype)
    x = torch.randn(5, block.gate.in_features, generator=torch.Generator().manual_seed(3))
    x = x.to(getattr(torch, dtype))
    live = torch.tensor([1, 1, 0, 1, 1])
    fused, fused_counts = _run(block, x, live, fused=True)
    pieces, pieces_counts = _run(block, x, live, fused=False)
    torch.testing.assert_close(fused, pieces, rtol=tolerance, atol=tolerance)
    assert torch.equal(fused_counts, pieces_counts) and fused_counts.sum() == 4 * block.top_k
    assert _arrivals(x.device).sum().item() == 0  # each row's last router program set its counter back


def test_a_rows_result_does_not_depend_on_its_window(checkpoint: Path) -> None:
    block = _block(checkpoint, "float32")
    x = torch.randn(MAX_ROWS, block.gate.in_features, generator=torch.Generator().manual_seed(4))
    window = _run(block, x, None, fused=True)[0]
    assert torch.equal(window[6], _run(block, x[6:7], None, fused=True)[0][0])


def test_windows_beyond_its_rows_run_the_pieces(checkpoint: Path) -> None:
    block = _block(checkpoint, "float32")
    x = torch.randn(MAX_ROWS + 1, block.gate.in_features, generator=torch.Generator().manual_seed(5))
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    mlp = block.shared_expert
    shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, block.shared_expert_gate.weight)
    counts = torch.zeros(block.gate.out_features, dtype=torch.int64)
    experts = block.experts
    args = (x, block.gate.weight, block.top_k, True, counts, None, experts.gate_up, experts.down)
    assert moe_block(*args, shared) is None and moe_block(x[:2], *args[1:], None) is None
    assert counts.sum() == 0
    fused, _ = _run(block, x, None, fused=True)
    torch.testing.assert_close(fused, _run(block, x, None, fused=False)[0])


def test_exact_mode_keeps_the_pieces() -> None:
    assert select_backends("triton", "cpu", exact=True).moe_block is None


def test_a_shared_expert_of_another_size_runs_the_pieces(checkpoint: Path) -> None:
    block = _block(checkpoint, "float32")
    experts = block.experts
    hidden, inter = block.gate.in_features, experts.intermediate
    x = torch.randn(2, hidden)
    counts = torch.zeros(block.gate.out_features, dtype=torch.int64)
    wider = (torch.randn(2 * inter, hidden), torch.randn(2 * inter, hidden), torch.randn(hidden, 2 * inter))
    args = (x, block.gate.weight, block.top_k, True, counts, None, experts.gate_up, experts.down)
    assert moe_block(*args, (*wider, torch.randn(1, hidden))) is None and counts.sum() == 0
