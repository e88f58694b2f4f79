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


def test_staged_blocks_arrive_before_each_layer_and_written_rows_reach_their_homes() -> None:
    """12 layers, 64 host blocks read by a batch in scattered order; each layer reads its own homes' values
    through the shifted table while the device is kept busy, writes a row into each of 5 blocks through the
    shifted slot mapping, and after `host_side` every home holds its layer's written rows."""
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
