"""The Triton set's MoE block (app/kernels/triton_moe_block.py) against the same block's pieces, in Triton's
interpreter: with a shared expert the outputs, the routing counts, a row's bits alone or in a window; without
one the router and routing in one launch, bit for bit as the pieces route."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, request, run

from app.kernels import triton_moe_block
from app.kernels.backends import select_backends
from app.kernels.interface import Picks
from app.kernels.triton_moe_block import MAX_ROWS, ONE_LAUNCH_ROWS, _arrivals, moe_block
from app.kernels.triton_norm import add_rms_norm
from app.loading.loader import load_model
from app.models.moe import SparseMoE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE checkpoint whose router the pieces project by `row_linear` (a hidden state over
    ONE_DOT_K), as every full-size shape's."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    return write_checkpoint(path, "qwen3_moe", hidden_size=256, num_hidden_layers=2)


def _block(checkpoint: Path, dtype: str, shared: bool = True) -> SparseMoE:
    model = load_model(checkpoint, dtype=dtype, progress=False, backends=select_backends("triton", "cpu"))[0]
    block = next(d.mlp for d in model.model.layers if isinstance(d.mlp, SparseMoE))
    assert block.block_kernel is moe_block and (block.shared_expert is not None) == shared
    return block


def _args(block: SparseMoE, x: torch.Tensor, counts: torch.Tensor) -> tuple:
    """moe_block's arguments for `block` over x, up to the shared expert."""
    weights = (block.experts.gate_up, block.experts.down)
    return (x, block.gate.weight, block.top_k, block.norm_topk_prob, counts, None, *weights)


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
    args = _args(block, x, counts)
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


@pytest.fixture
def one_launch_from_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch routing taken from one row (ONE_LAUNCH_ROWS), so that small windows cover it."""
    monkeypatch.setattr(triton_moe_block, "ONE_LAUNCH_ROWS", 1)


@pytest.mark.usefixtures("one_launch_from_one_row")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_without_a_shared_expert_routes_in_one_launch(wide_moe: Path, dtype: str) -> None:
    """Routed as its pieces route, bit for bit, padding rows left uncounted."""
    block = _block(wide_moe, dtype, shared=False)
    x = torch.randn(5, block.gate.in_features, generator=torch.Generator().manual_seed(6))
    x = x.to(getattr(torch, dtype))
    counts = torch.zeros(block.gate.out_features, dtype=torch.int64)
    with torch.inference_mode():
        assert moe_block(*_args(block, x, counts), None) is not None and counts.sum() == 5 * block.top_k
    live = torch.tensor([1, 1, 0, 1, 1])
    fused, fused_counts = _run(block, x, live, fused=True)
    pieces, pieces_counts = _run(block, x, live, fused=False)
    assert torch.equal(fused, pieces) and torch.equal(fused_counts, pieces_counts)
    assert fused_counts.sum() == 4 * block.top_k and _arrivals(x.device).sum().item() == 0


def test_a_router_without_the_pieces_row_sums_keeps_the_pieces(checkpoint: Path, wide_moe: Path) -> None:
    """A router over a hidden state of at most ONE_DOT_K (the pieces' tiles give cuBLAS's bits there), a
    window beyond MAX_ROWS and one under ONE_LAUNCH_ROWS: no routing of the block's own."""
    narrow = write_checkpoint(checkpoint.parent / "narrow_moe", "qwen3_moe")
    for path, rows in ((narrow, ONE_LAUNCH_ROWS), (wide_moe, MAX_ROWS + 1), (wide_moe, ONE_LAUNCH_ROWS - 1)):
        block = _block(path, "float32", shared=False)
        x = torch.randn(rows, block.gate.in_features)
        counts = torch.zeros(block.gate.out_features, dtype=torch.int64)
        assert moe_block(*_args(block, x, counts), None) is None and counts.sum() == 0


@pytest.mark.usefixtures("one_launch_from_one_row")
def test_a_norm_sums_a_blocks_picks_in_its_own_launch(wide_moe: Path) -> None:
    """`moe_block(..., picks=True)` leaves the pairs; `add_rms_norm` given them has the bits of adding their
    sum, a pick with a negative id (never computed) left out."""
    block = _block(wide_moe, "bfloat16", shared=False)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, block.gate.in_features, generator=gen).to(torch.bfloat16)
    counts = torch.zeros(block.gate.out_features, dtype=torch.int64)
    with torch.inference_mode():
        picks = moe_block(*_args(block, x, counts), None, picks=True)
        assert isinstance(picks, Picks)
        assert torch.equal(picks.total(), _run(block, x, None, fused=False)[0])
        ids = picks.ids.clone()
        ids[1, 0] = -1
        picks = Picks(picks.pairs, ids, picks.add)
        residual = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
        weight = torch.rand(x.shape[1], generator=gen).to(torch.bfloat16)
        fused = add_rms_norm(picks, residual, weight, 1e-6, False)
        summed = add_rms_norm(picks.total(), residual, weight, 1e-6, False)
    assert all(torch.equal(a, b) for a, b in zip(fused, summed, strict=True))
    assert not torch.equal(picks.total()[1], Picks(picks.pairs, picks.ids.abs(), picks.add).total()[1])


@pytest.mark.usefixtures("one_launch_from_one_row")
def test_the_engine_gives_the_bits_of_the_pieces(wide_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens and logprobs of three conversations read and decoding together, the routing in one
    launch and each block's picks summed by the next norm, bit for bit as with every block's pieces."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 2, 5)]
    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    routed = []
    route_window = triton_moe_block.route_window
    monkeypatch.setattr(triton_moe_block, "route_window", lambda *a: routed.append(1) or route_window(*a))

    def answers() -> list[tuple[list[int], list[float]]]:
        core = make_core(wide_moe, backend="triton", dtype="bfloat16")
        done = run(core, [(0, request(p, **params)) for p in prompts])[0]
        return [(c.token_ids, [p.chosen.logprob for p in c.logprobs]) for c in done.values()]

    fused = answers()
    assert len(routed) == 2 * 2  # both windows' two layers: the prompts' (11 rows) and a decode window
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert fused == answers() and len(routed) == 4
