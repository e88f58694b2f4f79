"""The static inputs a decode graph replays from: real rows first, padding on the scratch block and slot."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoints import write_checkpoint

from app.engine.cuda_graphs import DecodeGraphs, DecodeRow, buckets_up_to
from app.engine.paged_state import PagedState
from app.loading.loader import load_model


def test_buckets_end_at_the_slot_count() -> None:
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(10) == [1, 2, 4, 8, 10]
    assert buckets_up_to(32) == [1, 2, 4, 8, 16, 24, 32]


def test_rows_fill_the_static_inputs_and_padding_goes_to_scratch(tmp_path: Path) -> None:
    model, _ = load_model(write_checkpoint(tmp_path, "qwen3_next"), dtype="float32", progress=False)
    state = PagedState(
        model.config, blocks=20, block_size=4, slots=6, dtype=torch.float32, device=torch.device("cpu")
    )
    graphs = DecodeGraphs(model, state, max_rows=6, max_blocks=5)
    graphs._fill([DecodeRow(token=7, position=5, slot=3, blocks=[9, 2]), DecodeRow(11, 0, 1, [4])])
    assert graphs.input_ids.tolist() == [7, 11, 0, 0, 0, 0]
    assert graphs.positions.tolist() == [5, 0, 0, 0, 0, 0]
    assert graphs.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4, *[20 * 4] * 4]  # scratch block 20
    assert graphs.state_slots.tolist() == [3, 1, *[6] * 4]  # scratch slot 6
    assert graphs.live.tolist() == [1, 1, 0, 0, 0, 0]
    assert graphs.seq_lens.tolist() == [6, 1, 1, 1, 1, 1]
    assert graphs.block_table[0, :2].tolist() == [9, 2] and graphs.block_table[1:, 0].tolist() == [
        4,
        20,
        20,
        20,
        20,
    ]
    graphs._fill([DecodeRow(5, 1, 0, [8])])  # fewer rows: the earlier ones become padding again
    assert graphs.input_ids.tolist() == [5, 0, 0, 0, 0, 0]
    assert graphs.live.tolist() == [1, 0, 0, 0, 0, 0]
    assert graphs.block_table[:, 0].tolist() == [8, 20, 20, 20, 20, 20]
