"""The Triton set's Gated DeltaNet decode step (app/kernels/triton_gdn_decode.py) against the same layer's
pieces, in Triton's interpreter: outputs and both state pools, and a row's bits alone or in a window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from app.engine.paged_state import PagedState
from app.kernels.backends import select_backends
from app.loading.loader import load_model
from app.models.batch import ForwardBatch
from app.models.gdn import GatedDeltaNet
from app.models.qwen3 import CausalLM

SLOTS = (2, 0, 3)  # each decode row's state slot, in window order


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def _model(checkpoint: Path, dtype: str) -> CausalLM:
    return load_model(checkpoint, dtype=dtype, progress=False, backends=select_backends("triton", "cpu"))[0]


def _layer(model: CausalLM) -> GatedDeltaNet:
    return next(d.linear_attn for d in model.model.layers if d.linear_attn is not None)


def _window(
    model: CausalLM, layer: GatedDeltaNet, x: torch.Tensor, slots: tuple[int, ...], fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer over one decode row per slot, from random pools: its output, the pools afterwards and the
    recurrent pool before."""
    state = PagedState(
        model.config, blocks=8, block_size=16, slots=4, dtype=x.dtype, device=torch.device("cpu")
    )
    conv, recurrent = state.linear_pools(layer.layer)
    generator = torch.Generator().manual_seed(13)
    conv.copy_(0.5 * torch.randn(conv.shape, generator=generator))
    recurrent.copy_(0.3 * torch.randn(recurrent.shape, generator=generator))
    start = recurrent.clone()
    for slot in slots:
        state.set_block_table(slot, [slot])
    batch = ForwardBatch.build([(slot, [0], 9 + slot) for slot in slots], state)
    batch.layout = state.layout(batch.spans)
    step = layer.decode_step
    layer.decode_step = step if fused else None
    try:
        with torch.inference_mode():
            out = layer(x, batch)
    finally:
        layer.decode_step = step
    return out, conv.clone(), recurrent.clone(), start


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 2e-5), ("float16", 2e-3)])
def test_the_decode_step_equals_the_layers_pieces(checkpoint: Path, dtype: str, tolerance: float) -> None:
    """Four launches for a window of decode rows against the conv, delta rule and gated norm one by one:
    the output and both pools agree, and the pools moved."""
    model = _model(checkpoint, dtype)
    layer = _layer(model)
    assert layer.decode_step is not None
    x = torch.randn(len(SLOTS), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(getattr(torch, dtype))
    fused = _window(model, layer, x, SLOTS, fused=True)
    pieces = _window(model, layer, x, SLOTS, fused=False)
    for got, expected in zip(fused, pieces, strict=True):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(fused[1][3], pieces[1][3]), "the conv state is a window of inputs, copied exactly"
    before = fused[3]
    assert all(not torch.equal(fused[2][slot], before[slot]) for slot in SLOTS)
    assert torch.equal(fused[2][1], before[1]), "a slot no row continues stays as it was"


def test_a_rows_decode_step_does_not_depend_on_its_window(checkpoint: Path) -> None:
    model = _model(checkpoint, "float32")
    layer = _layer(model)
    x = torch.randn(len(SLOTS), model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    window = _window(model, layer, x, SLOTS, fused=True)
    alone = _window(model, layer, x[1:2], SLOTS[1:2], fused=True)
    assert torch.equal(window[0][1], alone[0][0])
    assert torch.equal(window[2][SLOTS[1]], alone[2][SLOTS[1]])


def test_exact_mode_keeps_the_pieces() -> None:
    assert select_backends("triton", "cpu").gdn_decode is not None
    assert select_backends("triton", "cpu", exact=True).gdn_decode is None
