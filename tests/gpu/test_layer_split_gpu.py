"""The layer split on two GPUs or more: stages over NCCL give the tokens of the model run whole on one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, random_prompt, request, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


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


@pytest.mark.parametrize("groups", [1, 2])
def test_a_split_over_two_gpus_gives_the_tokens_of_one(checkpoint: Path, groups: int) -> None:
    # --exact: the same kernels' tiles whatever a window holds, so that a group's smaller windows give the
    # bits of the whole model's.
    settings = dict(device="cuda", dtype="bfloat16", parallel=8, max_batched_tokens=96, exact=True)
    whole, _ = _tokens(make_core(checkpoint, **settings))
    core = make_core(checkpoint, **settings, layer_split="2", batch_groups=groups)
    try:
        split, windows = _tokens(core)
        assert split == whole
        assert all(w.stages is not None and len(w.stages) == 2 for w in windows)
    finally:
        core.close()
