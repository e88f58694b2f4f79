"""Parallel loading: chunks read by several threads land where the mapped tensors say, converted or not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from app.loading.checkpoint import CheckpointDir
from app.loading.fill import Extent, ParallelFill
from app.loading.host_pages import HostPages
from app.loading.loader import load_model


def test_chunks_read_by_several_threads_equal_the_mapped_tensors(tmp_path: Path) -> None:
    checkpoint = CheckpointDir(write_checkpoint(tmp_path, "qwen3_moe", shard_size="40KB"))
    fill = ParallelFill(workers=3, chunk_bytes=1000)  # most tensors span several chunks, taken by any thread
    same, wider = {}, {}
    for name in checkpoint.names():
        extent = checkpoint.extent(name)
        same[name] = torch.empty(extent.shape, dtype=extent.dtype)
        wider[name] = torch.empty(extent.shape, dtype=torch.float64)
        fill.add(extent, same[name])
        fill.add(extent, wider[name])
    landed = []
    total = fill.nbytes
    fill.run(landed.append)
    assert sum(landed) == total and len({checkpoint.extent(n).path for n in checkpoint.names()}) > 1
    for name in checkpoint.names():
        expected = checkpoint.tensor(name)
        assert torch.equal(same[name], expected), name
        assert torch.equal(wider[name], expected.double()), name


def test_a_file_shorter_than_its_header_says_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(100))
    fill = ParallelFill(workers=2, chunk_bytes=64)
    fill.add(Extent(path, 0, 400, torch.float32, (100,)), torch.empty(100))
    with pytest.raises(OSError, match="ends before byte"):
        fill.run()


def test_a_destination_must_be_contiguous_and_of_the_extents_shape(tmp_path: Path) -> None:
    extent = Extent(tmp_path / "x", 0, 64, torch.float32, (4, 4))
    with pytest.raises(ValueError, match="contiguous"):
        ParallelFill().add(extent, torch.empty(4, 4).t())
    with pytest.raises(ValueError, match="shape"):
        ParallelFill().add(extent, torch.empty(16))


def test_a_tiered_model_loads_its_host_and_device_experts_through_the_filler(tmp_path: Path) -> None:
    """Narrowed to bf16 at load, the stacked experts (host and device parts) come through the filler and
    hold what the whole model's experts hold."""
    path = write_checkpoint(tmp_path, "qwen3_moe")
    whole, _ = load_model(path, dtype="bfloat16", progress=False)
    tiered, _ = load_model(path, dtype="bfloat16", progress=False, resident_experts=1)
    experts, tier = whole.model.layers[0].mlp.experts, tiered.model.layers[0].mlp.experts
    assert torch.equal(tier.gate_up[:1], experts.gate_up[:1]) and torch.equal(tier.down[:1], experts.down[:1])
    assert torch.equal(tier.host_gate_up[:-1], experts.gate_up[1:])
    assert torch.equal(tier.host_down[:-1], experts.down[1:])


def test_host_pages_take_a_fill_and_outlive_their_holder(tmp_path: Path) -> None:
    """The expert tier's RAM on a GPU machine: untouched mapped pages that the threads fill (pinned after,
    on a GPU: tests/gpu/test_loading_gpu.py); the tensor keeps its mapping once the holder is gone."""
    checkpoint = CheckpointDir(write_checkpoint(tmp_path, "qwen3_moe"))
    name = next(n for n in checkpoint.names() if n.endswith("experts.0.down_proj.weight"))
    extent = checkpoint.extent(name)
    pages = HostPages(extent.shape, extent.dtype)
    fill = ParallelFill(workers=2, chunk_bytes=256)
    fill.add(extent, pages.tensor)
    fill.run()
    tensor = pages.tensor
    del pages
    assert torch.equal(tensor, checkpoint.tensor(name)) and not tensor.is_pinned()
    assert HostPages((0, 4), torch.bfloat16).tensor.shape == (0, 4)
