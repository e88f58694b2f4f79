"""A directory of weights drawn as they load (config, tokenizer, `random_weights.json`): the same tensors at
every load and on every stage of a layer split."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, random_prompt, request, run

from app.loading.identity import model_identity
from app.loading.loader import load_model
from app.loading.random_weights import RandomWeights, write_marker


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def drawn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint's config and tokenizer, its weight files replaced by the marker."""
    source = write_checkpoint(tmp_path_factory.mktemp("source"), request.param)
    path = tmp_path_factory.mktemp(f"drawn-{request.param}")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    write_marker(path, seed=3, drawn_whole=256)  # the tiny model's matrices from the shared base
    return path


def test_weights_drawn_as_they_load_are_the_same_at_every_load(drawn: Path) -> None:
    first, _ = load_model(drawn, dtype="bfloat16", progress=False)
    again, _ = load_model(drawn, dtype="bfloat16", progress=False)
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    weights = RandomWeights(drawn)
    large = [n for n in weights.names() if torch.Size(weights.shape(n)).numel() > weights.drawn_whole]
    assert large and not torch.equal(
        weights.tensor(large[0]).flatten()[:64], weights.tensor(large[1]).flatten()[:64]
    )
    norms = [n for n in weights.names() if n.endswith("input_layernorm.weight")]
    assert {float(v) for v in weights.tensor(norms[0]).float().unique()} <= {0.0, 1.0}  # as initialised
    assert 0.015 < float(weights.tensor(large[0]).float().std()) < 0.025
    identity = model_identity(drawn)
    write_marker(drawn, seed=4, drawn_whole=256)
    assert model_identity(drawn) != identity  # the marker is part of the fingerprint
    write_marker(drawn, seed=3, drawn_whole=256)


def test_a_split_draws_on_every_stage_the_weights_of_the_model_run_whole(drawn: Path) -> None:
    arrivals = [(i, request(random_prompt(20 + 7 * i, i), max_tokens=6, temperature=0)) for i in range(3)]
    whole, _ = run(make_core(drawn), arrivals)
    core = make_core(drawn, layer_split="2")
    try:
        split, _ = run(core, arrivals)
    finally:
        core.close()
    assert [split[a.request_id].token_ids for _, a in arrivals] == [
        whole[a.request_id].token_ids for _, a in arrivals
    ]
