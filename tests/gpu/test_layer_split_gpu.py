"""The layer split on GPUs: stages over NCCL on two cards, or sharing one card through host memory, replaying
their window graphs (or eagerly), give the tokens of the model run whole on one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, random_prompt, request, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, max_position_embeddings=4096
    )


def _tokens(core: object) -> tuple[list[list[int]], list]:
    """Eight greedy requests arriving one window apart: each one's tokens, and the windows' stats."""
    arrivals = [
        (i, request(random_prompt(9 + 31 * i, i), max_tokens=16, temperature=0, ignore_eos=True))
        for i in range(8)
    ]
    results, windows = run(core, arrivals)  # type: ignore[arg-type]
    return [results[add.request_id].token_ids for _, add in arrivals], windows


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("gpus", [(0, 1), (0, 0)], ids=["two cards", "one card shared"])
def test_a_split_over_gpus_gives_the_tokens_of_one(
    checkpoint: Path, groups: int, gpus: tuple, eager: bool
) -> None:
    if max(gpus) >= torch.cuda.device_count():
        pytest.skip(f"needs {max(gpus) + 1} CUDA devices")
    # --exact: the same kernels' tiles whatever a window holds, so that a group's smaller windows give the
    # bits of the whole model's.
    settings = dict(device="cuda", dtype="bfloat16", parallel=8, max_batched_tokens=96, exact=True)
    whole, _ = _tokens(make_core(checkpoint, **settings))
    split_settings = dict(layer_split="2", batch_groups=groups, stage_gpus=gpus, enforce_eager=eager)
    core = make_core(checkpoint, **settings, **split_settings)
    try:
        split, windows = _tokens(core)
        assert split == whole
        assert all(w.stages is not None and len(w.stages) == 2 for w in windows)
        replayed = [w for w in windows if w.replayed]
        assert not replayed if eager else {bool(w.prompt_tokens) for w in replayed} == {True, False}
    finally:
        core.close()


def test_an_adapting_expert_tier_on_a_split_replays_piecewise_graphs(checkpoint: Path) -> None:
    """Two experts a layer on the card of each stage (sharing one card), swaps every window, decode windows
    replayed piecewise around each stage's misses: the greedy tokens of the all-resident model run whole."""
    settings = dict(device="cuda", dtype="float32", parallel=4)
    whole, _ = _tokens(make_core(checkpoint, **settings))
    tier = dict(expert_cache=2, adapt_every=1)
    core = make_core(checkpoint, **settings, **tier, layer_split="2", batch_groups=2, stage_gpus=(0, 0))
    try:
        graphs = core.runner.graphs
        assert graphs is not None and graphs.pieces and not graphs.graphs
        split, windows = _tokens(core)
        assert split == whole
        assert any(w.replayed for w in windows)
    finally:
        core.close()
