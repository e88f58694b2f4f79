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
from app.engine import kv_stream
from app.engine.blocks import BlockPool, Donor
from app.engine.kv_stream import StreamedKV, shifted
from app.engine.paged_state import device_kv_bytes, kv_block_bytes
from app.engine.scheduler import Phase, Scheduler
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


def test_blocks_follow_the_conversation_being_answered_onto_the_device(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the prefix cache, an answered turn's cached blocks give up the device to the next conversation
    (moved to host RAM, still cached) and come back for its follow-up: neither reads a block from host RAM,
    the follow-up continues from the cache, and every token is what a pool wholly on the device gives, even
    with a budget of one block a window (a window may move what it would otherwise read over the link).
    Without the moves the next conversation reads host blocks."""
    monkeypatch.setattr(core_module, "PLACE_BYTES", 1)
    params = {**GREEDY, "max_tokens": 10}
    whole = make_core(checkpoint)
    first = request(random_prompt(30, 1), **params)
    second = request(random_prompt(60, 2), **params)
    answer = complete(whole, first.prompt_token_ids, **params).token_ids
    follow_up = request([*first.prompt_token_ids, *answer, *random_prompt(6, 3)], **params)

    def conversations() -> list[list]:
        core = make_core(checkpoint, kv_resident=96)  # six blocks on the "device"
        turns = [run(core, [(0, add)]) for add in (first, second, follow_up)]
        for add, (done, _) in zip((first, second, follow_up), turns, strict=True):
            alone = complete(whole, add.prompt_token_ids, **params).token_ids
            assert done[add.request_id].token_ids == alone
        return [windows for _, windows in turns]

    _, second_turn, follow_up_turn = conversations()
    assert sum(w.kv_host_reads for w in second_turn + follow_up_turn) == 0
    assert sum(w.kv_moved_to_host for w in second_turn) > 0  # the first turn's cached blocks
    assert sum(w.kv_moved_to_device for w in follow_up_turn) > 0  # and back
    assert sum(w.prefix_cache_hits for w in follow_up_turn) >= 32
    monkeypatch.setattr(Scheduler, "_place", lambda self, window: None)
    assert sum(w.kv_host_reads for w in conversations()[1]) > 0


def _pool_with_cache(tokens: list[int]) -> tuple[BlockPool, list[int]]:
    """Eight blocks of two, four on the device: `tokens` (five) cached in blocks 0 and 1, which no one holds,
    and a table of four blocks given out after them (2 to 5)."""
    pool = BlockPool(8, 2, caching=True)
    pool.on_device = 4
    cached: list[int] = []
    assert pool.grow(cached, 5) and cached == [0, 1, 2]
    pool.commit(cached, tokens, 5, 0, b"")
    pool.release(cached)  # 0 and 1 cached, no one holds them; 2 free
    table: list[int] = []
    assert pool.grow(table, 8) and table == [2, 3, 4, 5]
    return pool, table


def test_placing_a_table_takes_free_then_idle_device_blocks_and_keeps_their_cache_in_host_ram() -> None:
    """Four of eight blocks on the device: a table's host blocks move onto the device, a cached block the
    device gives up (the one released longest ago first) keeps its registration in a free host block (copied
    there first), the table's blocks with contents are copied after, both in ascending pairs, a budget too
    small for a copy forgets the cached block instead, and where the budget ends the next window goes on."""
    tokens = [5, 6, 7, 8, 9]
    pool, table = _pool_with_cache(tokens)
    copies: list[tuple[int, int]] = []
    assert pool.place(table, 4, 10, copies) == (4, 4)
    assert table == [2, 3, 0, 1]  # paired in ascending order: runs of consecutive blocks
    assert copies == [(0, 6), (1, 7), (4, 0), (5, 1)]
    assert pool.match(tokens, 5) == [6, 7] and pool.free == 4 and pool.cached == 2

    pool, table = _pool_with_cache(tokens)
    copies = []
    assert pool.place(table, 4, 3, copies) == (3, 4)
    assert copies == [(1, 6), (4, 0), (5, 1)] and table == [2, 3, 0, 1]  # the last released kept
    assert pool.match(tokens, 5) == []  # the first block was forgotten: nothing continues from the second
    assert pool.place(table, 4, 3, copies := [], start=2) == (0, 2)  # no device block left: none looked at
    assert copies == []

    pool, table = _pool_with_cache(tokens)
    assert pool.place(table, 4, 1, copies := []) == (1, 3)  # one copy allowed: block 5 waits, index 3
    assert copies == [(4, 1)] and table == [2, 3, 1, 5]
    assert pool.place(table, 4, 8, copies := [], start=3) == (2, 4)  # the next window goes on from there
    assert copies == [(0, 4), (5, 0)] and table == [2, 3, 1, 0]


def test_a_prompt_being_read_lends_its_device_blocks_to_a_decoding_table() -> None:
    """Eight blocks of two, four on the device, all held by a prompt being read (three with keys and values):
    a decoding table's host blocks take the prompt's first ones, whose contents go to free host blocks first
    (the decoding table's contents after them), and the prompt's table is next looked at past them; a budget
    that leaves no copy for the decoding table's own lends nothing."""

    def pools() -> tuple[BlockPool, list[int], list[int]]:
        pool = BlockPool(8, 2)
        pool.on_device = 4
        reading: list[int] = []
        decoding: list[int] = []
        assert pool.grow(reading, 8) and pool.grow(decoding, 4)
        return pool, reading, decoding

    pool, reading, decoding = pools()
    assert (reading, decoding) == ([0, 1, 2, 3], [4, 5])
    copies: list[tuple[int, int]] = []
    donor = Donor(reading, 3)
    assert pool.place(decoding, 1, 10, copies, donors=[donor]) == (3, 2)
    assert copies == [(0, 6), (1, 7), (4, 0)]  # block 5 holds nothing yet: no copy
    assert decoding == [0, 1] and reading == [6, 7, 2, 3] and pool.free == 2
    assert donor.start == 2  # the next look at the reader's table begins past what it lent

    pool, reading, decoding = pools()
    assert pool.place(decoding, 1, 1, copies := [], donors=[Donor(reading, 3)]) == (0, 0)
    assert copies == [] and reading == [0, 1, 2, 3]


def test_a_decoding_request_keeps_its_blocks_on_the_device_while_a_long_prompt_is_read(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six blocks on the "device", filled by a 400-token prompt being read: the request decoding beside it
    takes the reader's device blocks as it grows, so it never reads a block from host RAM (on a GPU its
    windows of decode rows alone replay their graphs); every token is what a pool wholly on the device gives.
    Without the lending its new blocks stay in host RAM while the prompt is read."""
    whole = make_core(checkpoint)
    decoding = request(random_prompt(28, 1), **(decoding_params := {**GREEDY, "max_tokens": 40}))
    reading = request(random_prompt(400, 2), **(reading_params := {**GREEDY, "max_tokens": 4}))
    expected = {
        add.request_id: complete(whole, add.prompt_token_ids, **params).token_ids
        for add, params in ((decoding, decoding_params), (reading, reading_params))
    }

    def decoding_blocks_in_host_ram() -> int:
        """The most blocks the decoding request held in host RAM after a window, while the prompt was read."""
        core = make_core(checkpoint, kv_resident=96, parallel=2, max_batched_tokens=64, decode_share=0.5)
        scheduler, most = core.scheduler, 0

        def look() -> None:
            nonlocal most
            running = scheduler.running
            if any(r.phase is Phase.PROMPT for r in running):
                held = [b for r in running if r.phase is Phase.DECODE for b in r.blocks]
                most = max(most, sum(b >= scheduler.pool.on_device for b in held))

        done, _ = run(core, [(0, decoding), (1, reading)], after_window=look)
        assert {key: done[key].token_ids for key in expected} == expected
        return most

    assert decoding_blocks_in_host_ram() == 0
    monkeypatch.setattr(BlockPool, "_lend", lambda self, *args: None)
    assert decoding_blocks_in_host_ram() > 0


@pytest.mark.parametrize("kernel", [False, True])
def test_block_copies_across_the_device_and_host_ram_are_made_in_order(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies between device and host blocks (merged into runs, or by the block-copy kernel a stretch going
    one way, here in the interpreter) and within host RAM give what copying each pair in turn gives, in
    every layer, keys and values."""
    monkeypatch.setattr(kv_stream, "by_kernel", lambda device, runs: kernel)
    stream = StreamedKV(2, 6, 2, (1, 1, 1), torch.float32, torch.device("cpu"))
    for kind in (0, 1):
        stream.on_device[kind][:, :2] = torch.tensor([[0.0, 1.0], [10.0, 11.0]]).view(2, 2, 1, 1, 1) + kind
        stream.homes[kind][:] = torch.tensor([[2.0, 3, 4, 5], [12, 13, 14, 15]]).view(2, 4, 1, 1, 1) + kind
    pairs = [(0, 3), (1, 4), (5, 0), (3, 2), (2, 1), (4, 5)]
    expected = list(range(6))
    for source, target in pairs:
        expected[target] = expected[source]
    stream.copy_blocks(pairs)
    for layer in range(2):
        for kind in (0, 1):
            held = [*stream.on_device[kind][layer, :2].flatten(), *stream.homes[kind][layer].flatten()]
            assert [int(v) for v in held] == [10 * layer + b + kind for b in expected]


def test_an_engine_streaming_through_the_kernel_gives_the_whole_pools_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window's host blocks in several runs (conversations decoding together append blocks in turn),
    copied in and back home by the kernel (here on the CPU, from two runs on), give the whole pool's
    tokens."""
    greedy = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    used: list[int] = []

    def by_kernel(device: torch.device, runs: int) -> bool:
        used.append(runs)
        return runs > 1

    monkeypatch.setattr(kv_stream, "by_kernel", by_kernel)
    whole = make_core(checkpoint)
    core = make_core(checkpoint, kv_resident=32, parallel=4, max_batched_tokens=64, decode_share=0.01)
    arrivals = [(0, request(random_prompt(20 + 9 * i, i), **greedy)) for i in range(4)]
    together, _ = run(core, arrivals)
    assert max(used) > 1
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(whole, add.prompt_token_ids, **greedy).token_ids


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
