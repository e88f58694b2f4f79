"""Loading onto a GPU: a tiered model's experts in RAM are pinned after the threads filled them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from app.loading.host_pages import HostPages
from app.loading.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_tiered_models_experts_in_ram_are_pinned_and_hold_the_files_weights(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_moe")
    whole, _ = load_model(path, dtype="bfloat16", device="cuda", progress=False)
    tiered, _ = load_model(path, dtype="bfloat16", device="cuda", progress=False, resident_experts=1)
    experts, tier = whole.model.layers[0].mlp.experts, tiered.model.layers[0].mlp.experts
    assert tier.host_gate_up.is_pinned() and tier.host_down.is_pinned()
    assert torch.equal(tier.host_gate_up[:-1].cuda(), experts.gate_up[1:])
    assert torch.equal(tier.host_down[:-1].cuda(), experts.down[1:])
    copied = torch.empty_like(experts.gate_up[1:])
    copied.copy_(tier.host_gate_up[:-1], non_blocking=True)  # an asynchronous copy from registered pages
    torch.cuda.synchronize()
    assert torch.equal(copied, experts.gate_up[1:])


def test_pinned_pages_are_unregistered_when_their_tensor_goes() -> None:
    pages = HostPages((1 << 20,), torch.float32)
    pages.tensor.fill_(1.0)
    pages.pin()
    assert pages.tensor.is_pinned()
    for _ in range(3):  # freed ranges come back to later mappings: registering them again works
        del pages
        gc.collect()
        pages = HostPages((1 << 20,), torch.float32)
        pages.tensor.fill_(2.0)
        pages.pin()
        assert pages.tensor.is_pinned()
