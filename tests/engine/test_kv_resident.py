"""KV blocks beyond a VRAM budget (`--kv-resident`): blocks past it live in host RAM and are streamed in for
attention layer by layer, and every greedy token stays what a pool wholly on the device gives, with batches of
prompt chunks and decode rows, with 8-bit rows, through parking and the prefix cache; /metrics counts where
the blocks read came from; the settings' errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import assert_parked_follow_up_continues, complete, make_core, random_prompt, request, run

from app.engine import core as core_module
from app.engine.kv_stream import StreamedKV, shifted
from app.engine.paged_state import device_kv_bytes, kv_block_bytes
from app.errors import StrataError

GREEDY = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
RESIDENT = 48  # tokens: three blocks of 16 on the "device", the rest of the pool in host RAM


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_conversations_streamed_from_host_ram_equal_each_alone_on_a_whole_pool(
    checkpoint: Path, backend: str
) -> None:
    """Eight conversations with their blocks mostly in host RAM, read and decoded together in shared
    windows (several prompt chunks a window, decode rows beside them), give each one's tokens on a pool
    wholly on the device: the fused kernels' path (cpu) and the per-sequence path (torch) alike."""
    whole = make_core(checkpoint, backend=backend)
    core = make_core(
        checkpoint,
        backend=backend,
        kv_resident=RESIDENT,
        parallel=8,
        max_batched_tokens=96,
        decode_share=0.01,
    )
    assert core.runner.state.stream is not None and core.runner.state.resident == 3
    arrivals = [(i, request(random_prompt(15 + 23 * i, i), **GREEDY)) for i in range(8)]
    together, windows = run(core, arrivals)
    assert max(len(w.slots) for w in windows) >= 6
    assert sum(w.kv_host_reads for w in windows) > sum(w.kv_vram_reads for w in windows) > 0
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(whole, add.prompt_token_ids, **GREEDY).token_ids


def test_int8_rows_streamed_from_host_ram_equal_them_on_the_device(checkpoint: Path) -> None:
    whole = make_core(checkpoint, kv_dtype="int8")
    core = make_core(checkpoint, kv_dtype="int8", kv_resident=RESIDENT, parallel=4, max_batched_tokens=64)
    arrivals = [(i, request(random_prompt(40 + 31 * i, i), **GREEDY)) for i in range(4)]
    together, _ = run(core, arrivals)
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(whole, add.prompt_token_ids, **GREEDY).token_ids


def test_a_parked_follow_up_in_host_ram_blocks_continues_as_if_it_never_left(checkpoint: Path) -> None:
    """A turn parked from blocks in host RAM, then restored into blocks in host RAM (all but three of the
    pool's), continues as reading the whole conversation would."""
    assert_parked_follow_up_continues(checkpoint, torch.float32, kv_resident=RESIDENT)


def test_streaming_stages_each_layers_host_blocks_and_sends_written_rows_home() -> None:
    """Three layers over 2 resident blocks and 4 in host RAM: a batch's table names host blocks by staging
    place, each layer's shifted table reads exactly what its home holds, and rows written into staging are
    in their homes once settled (and the next batch reads them)."""
    stream = StreamedKV(3, 6, 2, (2, 1, 1), torch.float32, torch.device("cpu"))
    for layer in range(3):
        for block in range(4):
            stream.homes[0][layer, block] = 100 * layer + 10 * (block + 2)
        stream.on_device[0][layer, :2] = torch.tensor([100 * layer, 100 * layer + 10]).view(2, 1, 1, 1)
    tables, plan = stream.place(torch.tensor([[4, 0, 5, -1], [1, 3, -1, -1]]))
    assert plan is not None and plan.homes.tolist() == [1, 2, 3]
    assert tables.tolist() == [[-2, 0, -3, 2], [1, -1, 2, 2]]
    slots = stream.place_slots(torch.tensor([11, 7, -1]), 2, plan)  # block 5 offset 1, block 3 offset 1, pad
    assert slots.tolist() == [-6, -2, 5] and plan.written.tolist() == [0, 2]
    for layer in range(3):
        shift = stream.ready(layer, plan)
        keys, _ = stream.cache(layer)
        read = keys[shifted(tables[:, :2], shift)][..., 0, 0, 0]
        assert read.tolist() == [[100 * layer + 40, 100 * layer], [100 * layer + 10, 100 * layer + 30]]
        keys.view(-1)[shifted(slots[:2], 2 * shift)] = -1.0 - layer  # rows written through the slot mapping
    stream.host_side()
    for layer in range(3):
        assert stream.homes[0][layer, 3, 1, 0, 0] == -1.0 - layer  # block 5, offset 1
        assert stream.homes[0][layer, 1, 1, 0, 0] == -1.0 - layer  # block 3, offset 1
        assert stream.homes[0][layer, 1, 0, 0, 0] == 100 * layer + 30  # untouched rows stay


def test_metrics_count_where_the_blocks_read_came_from(checkpoint: Path) -> None:
    core = make_core(checkpoint, kv_resident=RESIDENT)
    _, windows = run(core, [(0, request(random_prompt(100, 5), **GREEDY))])
    vram, host = sum(w.kv_vram_reads for w in windows), sum(w.kv_host_reads for w in windows)
    blocks = -(-(100 + GREEDY["max_tokens"] - 1) // 16)
    assert vram > 0 and host > 0 and vram + host >= blocks


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_resident": -1}, "--kv-resident must be 0 or more tokens"),
    ],
)
def test_kv_resident_settings_that_cannot_run_are_one_line_errors(
    checkpoint: Path, settings: dict, message: str
) -> None:
    with pytest.raises(StrataError, match=message):
        make_core(checkpoint, **settings)


def test_blocks_beyond_the_hosts_ram_are_refused_before_they_are_allocated(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 20))
    with pytest.raises(StrataError, match=r"GiB of host RAM, more than 80% of the 0.0 GiB available"):
        make_core(checkpoint, kv_resident=16)


def test_the_device_holds_the_resident_blocks_and_two_staging_areas_of_one_layer(checkpoint: Path) -> None:
    """What an expert tier leaves free for the KV pool: with `--kv-resident` the resident blocks of every
    attention layer and two staging areas of one layer (the rest in host RAM), never more than the pool."""
    config = make_core(checkpoint).loaded.model.config
    block = kv_block_bytes(config, 16, torch.float32)
    layers = config.layer_types.count("full_attention")
    assert device_kv_bytes(config, 100 * block, None, 16, torch.float32) == 100 * block
    expected = min(3 * block + 2 * 97 * block // layers, 100 * block)  # one attention layer: the pool
    assert device_kv_bytes(config, 100 * block, RESIDENT, 16, torch.float32) == expected
    assert device_kv_bytes(config, 100 * block, 4096, 16, torch.float32) == 100 * block
