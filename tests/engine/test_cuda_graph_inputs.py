"""The static inputs a window graph replays from: the chunks first, padding on the scratch block and slot."""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint

from app.engine.cuda_graphs import Bucket, WindowGraphs, buckets_up_to, mixed_buckets, token_buckets
from app.engine.paged_state import PagedState
from app.engine.protocol import SamplingParams
from app.engine.scheduler import Chunk, Request
from app.loading.loader import load_model


def test_buckets_end_at_the_slot_count_and_the_token_budget() -> None:
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(10) == [1, 2, 4, 8, 10]
    assert buckets_up_to(32) == [1, 2, 4, 8, 16, 24, 32]
    assert token_buckets(300) == [32, 64, 128, 256, 300]
    assert token_buckets(100_000)[-1] == 4096
    assert mixed_buckets(300, 9) == [
        Bucket(32, 9, 32),
        Bucket(64, 9, 64),
        Bucket(128, 9, 128),
        Bucket(256, 9, 128),
        Bucket(256, 9, 256),
        Bucket(300, 9, 128),
        Bucket(300, 9, 300),
    ]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> WindowGraphs:
    path = write_checkpoint(tmp_path_factory.mktemp("graphs"), "qwen3_next")
    model, _ = load_model(path, dtype="float32", progress=False)
    state = PagedState(
        model.config, blocks=20, block_size=4, slots=6, dtype=torch.float32, device=torch.device("cpu")
    )
    return WindowGraphs(model, state, slots=6, max_blocks=5, max_tokens=40)


def _chunk(tokens: list[int], past: int, slot: int, blocks: list[int], **flags: object) -> Chunk:
    request = Request(f"r{slot}", [1] * (past + len(tokens)), SamplingParams(), 0.0, blocks=blocks)
    decode = bool(flags.get("decode", False))
    save = flags.get("save")
    drafts, step_saves = int(flags.get("drafts", 0)), tuple(flags.get("step_saves", ()))
    return Chunk(
        request,
        slot,
        tokens,
        past,
        samples=True,
        fresh=past == 0,
        decode=decode,
        save=save,
        drafts=drafts,
        step_saves=step_saves,
    )


def test_a_window_picks_the_smallest_bucket_that_holds_it(graphs: WindowGraphs) -> None:
    decode = [_chunk([7], 5, 3, [9, 2], decode=True), _chunk([11], 0, 1, [4], decode=True)]
    assert graphs.bucket(decode) == Bucket(2, 2, 1)
    mixed = [_chunk([7], 5, 3, [9, 2], decode=True), _chunk([1] * 30, 0, 1, [4] * 8)]
    assert graphs.bucket(mixed) == Bucket(32, 7, 32)
    assert graphs.bucket([_chunk([1] * 41, 0, 1, [4] * 11)]) is None  # beyond every bucket: eager
    assert graphs.bucket([]) is None
    # the CPU set's recurrent layers read draft rows a window each: a drafting window runs eagerly
    assert graphs.bucket([_chunk([7, 8, 9], 5, 3, [9, 2, 3], decode=True, drafts=2)]) is None


def test_a_drafting_window_fills_its_stepwise_rows_and_every_row_it_samples(graphs: WindowGraphs) -> None:
    chunks = [
        _chunk([7, 8, 9, 10], 5, 3, [9, 2, 3], decode=True, drafts=3, step_saves=(9, 10, 11)),
        _chunk([21, 22, 23, 24, 25, 26], 2, 0, [5, 6]),
    ]
    graphs._fill(chunks, Bucket(12, 7, 12))
    assert graphs.stepwise[:3].tolist() == [1, 0, 0]
    assert graphs.row_saves[:12].tolist() == [9, 10, 11] + [-1] * 9  # the state after each row but the last
    assert graphs.sample_rows[:6].tolist() == [0, 1, 2, 3, 9, 0]  # each verified row, then the prompt's last
    assert graphs.positions[:4].tolist() == [5, 6, 7, 8]


def test_decode_rows_fill_the_static_inputs_and_padding_goes_to_scratch(graphs: WindowGraphs) -> None:
    rows = [_chunk([7], 5, 3, [9, 2], decode=True), _chunk([11], 0, 1, [4], decode=True)]
    graphs._fill(rows, Bucket(4, 4, 1))
    assert graphs.input_ids[:4].tolist() == [7, 11, 0, 0]
    assert graphs.positions[:4].tolist() == [5, 0, 0, 0]
    assert graphs.slot_mapping[:4].tolist() == [2 * 4 + 1, 4 * 4, 20 * 4, 20 * 4]  # scratch block 20
    assert graphs.state_slots[:4].tolist() == [3, 1, 6, 6]  # scratch slot 6
    assert graphs.row_slots[:4].tolist() == [3, 1, 6, 6]
    assert graphs.live[:4].tolist() == [1, 1, 0, 0]
    assert graphs.query_start[:5].tolist() == [0, 1, 2, 3, 4]
    assert graphs.seq_lens[:4].tolist() == [6, 1, 1, 1]
    assert graphs.block_table[0, :2].tolist() == [9, 2]
    assert graphs.block_table[1:4, 0].tolist() == [4, 20, 20]
    graphs._fill(rows[1:], Bucket(4, 4, 1))  # fewer rows: the earlier ones become padding again
    assert graphs.input_ids[:4].tolist() == [11, 0, 0, 0]
    assert graphs.live[:4].tolist() == [1, 0, 0, 0]
    assert graphs.block_table[:4, 0].tolist() == [4, 20, 20, 20]


def test_prompt_chunks_fill_the_static_inputs_with_one_padding_sequence(graphs: WindowGraphs) -> None:
    chunks = [
        _chunk([7], 5, 3, [9, 2], decode=True),
        _chunk([21, 22, 23, 24, 25, 26], 2, 0, [5, 6], save=(4, 8)),
    ]
    graphs._fill(chunks, Bucket(12, 7, 12))
    assert graphs.input_ids[:12].tolist() == [7, 21, 22, 23, 24, 25, 26, 0, 0, 0, 0, 0]
    assert graphs.positions[:12].tolist() == [5, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    assert graphs.slot_mapping[:12].tolist() == [
        2 * 4 + 1,
        *[5 * 4 + 2, 5 * 4 + 3, 6 * 4, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3],
        *[20 * 4, 20 * 4 + 1, 20 * 4 + 2, 20 * 4 + 3, 20 * 4],  # the padding sequence on scratch
    ]
    assert graphs.live[:12].tolist() == [1] * 7 + [0] * 5
    assert graphs.row_slots[:12].tolist() == [3] + [0] * 6 + [6] * 5  # each row's sequence's slot
    assert graphs.query_start[:8].tolist() == [0, 1, 7, 12, 12, 12, 12, 12]  # then empty sequences
    assert graphs.seq_lens[:7].tolist() == [6, 8, 5, 0, 0, 0, 0]
    assert graphs.state_slots[:7].tolist() == [3, 0, 6, 6, 6, 6, 6]
    assert graphs.save_at[:7].tolist() == [0, 4, 0, 0, 0, 0, 0]
    assert graphs.save_slots[:7].tolist() == [-1, 8, -1, -1, -1, -1, -1]
    assert graphs.sample_rows[:3].tolist() == [0, 6, 0]  # the rows the chunks sample at, then unused
    assert graphs.block_table[1, :2].tolist() == [5, 6] and graphs.block_table[2, :2].tolist() == [20, 20]
