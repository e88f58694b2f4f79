"""KV blocks beyond a VRAM budget on a CUDA device (`--kv-resident`): staging copies on the side stream land
before each layer reads them and the rows a layer writes reach their homes in pinned RAM, and an engine whose
blocks mostly live in host RAM gives every conversation the tokens of a pool wholly on the card."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.engine.kv_stream import StreamedKV, shifted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("gather", ["1", "0"])
def test_staged_blocks_arrive_before_each_layer_and_written_rows_reach_their_homes(
    gather: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 layers, 64 host blocks read by a batch in scattered order; each layer reads its own homes' values
    through the shifted table while the device is kept busy, writes a row into each of 5 blocks through the
    shifted slot mapping, and after `host_side` every home holds its layer's written rows: the blocks copied
    by the kernel reading and writing pinned RAM in place, and by a copy a run (`STRATA_KV_GATHER=0`)."""
    monkeypatch.setenv("STRATA_KV_GATHER", gather)
    layers, blocks, resident, size = 12, 100, 20, 16
    device = torch.device("cuda")
    stream = StreamedKV(layers, blocks, resident, (size, 2, 64), torch.bfloat16, device)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        stream.homes[0][layer].copy_(torch.randn(stream.homes[0][layer].shape, generator=gen))
    chosen = (torch.randperm(blocks - resident, generator=gen)[:64] + resident).view(4, 16)
    tables, plan = stream.place(chosen)
    written = [*chosen[:, -1].tolist(), chosen[0, 0].item()]
    slots = torch.tensor([b * size + 3 for b in written])
    slots = stream.place_slots(slots, size, plan)
    assert plan is not None
    busy = torch.randn(4096, 4096, device=device)
    for layer in range(layers):
        shift = stream.ready(layer, plan)
        busy = busy @ busy / 64  # the device stays busy while copies run beside it
        keys, _ = stream.cache(layer)
        got = keys[shifted(tables.to(device), shift)].float().cpu()
        expected = stream.homes[0][layer, chosen - resident].float()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        rows = keys.view(-1, 2, 64)
        rows[shifted(slots.to(device), shift * size)] = float(layer + 1)
    stream.host_side()
    for layer in range(layers):
        for block in written:
            assert bool((stream.homes[0][layer, block - resident, 3] == layer + 1).all())


SCATTERED = [(3, 30), (5, 25), (7, 33), (9, 21), (1, 36), (2, 38)]  # cached blocks going to host RAM
SCATTERED += [(20, 3), (22, 5), (24, 7), (26, 9), (28, 1)]  # then a conversation's coming onto the device
IN_RUNS = [(3, 30), (4, 31), (5, 32), (20, 3), (21, 4), (22, 5)]


@pytest.mark.parametrize("pairs", [IN_RUNS, SCATTERED], ids=["runs", "scattered"])
def test_block_moves_are_queued_in_the_devices_order_while_it_is_busy(pairs: list[tuple[int, int]]) -> None:
    """Blocks moved from the device to host RAM and back (the prefix cache's blocks giving up the device, a
    conversation's coming onto it) are queued behind work the device is still doing and land before what is
    queued after them: each block ends up holding what copying the pairs in turn gives, in runs (a copy a
    run) or scattered (the block-copy kernel, a launch each way a layer)."""
    layers, blocks, resident, size = 6, 40, 10, 16
    device = torch.device("cuda")
    stream = StreamedKV(layers, blocks, resident, (size, 2, 64), torch.bfloat16, device)
    stream.on_device[0].copy_(torch.arange(resident + 1).view(1, -1, 1, 1, 1).expand_as(stream.on_device[0]))
    stream.homes[0].copy_(torch.arange(resident, blocks).view(1, -1, 1, 1, 1).expand_as(stream.homes[0]))
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(8):
        busy = busy @ busy / 64
    stream.on_device[0][:, 3] = -1.0  # queued before the moves: block 3 leaves the device holding it
    stream.copy_blocks(pairs)
    stream.on_device[0][:, 4] += 100.0  # queued after: adds to what block 4 then holds
    stream.host_side()
    expected = [float(b) for b in range(blocks)]
    expected[3] = -1.0
    for source, target in pairs:
        expected[target] = expected[source]
    expected[4] += 100.0
    for layer in range(layers):
        held = [*stream.on_device[0][layer, :resident, 0, 0, 0].tolist(), *stream.homes[0][layer, :, 0, 0, 0]]
        assert [float(v) for v in held] == expected


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param),
        request.param,
        max_position_embeddings=4096,
        hidden_size=256,
        head_dim=64,
        num_hidden_layers=4,
    )


def test_an_engine_with_kv_in_host_ram_gives_each_conversation_the_whole_pools_tokens(
    checkpoint: Path,
) -> None:
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = make_core(checkpoint, device="cuda", dtype="bfloat16", parallel=4)
    core = make_core(checkpoint, device="cuda", dtype="bfloat16", parallel=4, kv_resident=32)
    assert core.runner.state.stream is not None and core.runner.graphs is not None
    arrivals = [(i, request(random_prompt(30 + 70 * i, i), **greedy)) for i in range(4)]
    together, windows = run(core, arrivals)
    assert sum(w.kv_host_reads for w in windows) > 0
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(whole, add.prompt_token_ids, **greedy).token_ids


def test_turns_that_move_blocks_between_host_ram_and_the_card_keep_their_tokens(checkpoint: Path) -> None:
    """Turns one after another with the prefix cache: each new conversation's blocks come onto the card in
    place of cached ones (which go to host RAM), a follow-up brings its own back; windows replay their graphs
    once no block is read from host RAM, and the tokens are the whole pool's."""
    greedy = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = make_core(checkpoint, device="cuda", dtype="bfloat16")
    core = make_core(checkpoint, device="cuda", dtype="bfloat16", kv_resident=160)
    first = request(random_prompt(50, 1), **greedy)
    answer = complete(whole, first.prompt_token_ids, **greedy).token_ids
    turns = [first, request(random_prompt(100, 2), **greedy)]
    turns.append(request([*first.prompt_token_ids, *answer, *random_prompt(9, 3)], **greedy))
    for add in turns:
        done, windows = run(core, [(0, add)])
        assert done[add.request_id].token_ids == complete(whole, add.prompt_token_ids, **greedy).token_ids
        assert sum(w.kv_host_reads for w in windows) == 0
