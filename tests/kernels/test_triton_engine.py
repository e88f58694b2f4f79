"""The engine on the Triton kernels (Triton's interpreter, CPU tensors) against the torch reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, request, run, with_window_graphs

from app.engine.core import EngineCore
from app.engine.cuda_graphs import StageGraphs
from app.engine.protocol import AddRequest

# The interpreter runs every program of every kernel in Python: two layers a model, the hybrid one of each
# kind (a Gated DeltaNet layer, then an attention layer), which covers every kernel the engine runs.
TWO_LAYERS = {
    "qwen3_moe": {"num_hidden_layers": 2},
    "qwen3_next": {"num_hidden_layers": 2, "full_attention_interval": 2},
}


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param),
        request.param,
        max_position_embeddings=1024,
        **TWO_LAYERS[request.param],
    )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hybrid model alone, for the long tests: its attention and Gated DeltaNet layers cover every kernel
    the engine runs (the attention-only model's differences are covered by the tests over both)."""
    return write_checkpoint(
        tmp_path_factory.mktemp("hybrid"),
        "qwen3_next",
        max_position_embeddings=1024,
        **TWO_LAYERS["qwen3_next"],
    )


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_triton_kernels_give_the_tokens_and_logprobs_of_the_reference(checkpoint: Path) -> None:
    prompt = _prompt(70, 1)
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    fast = complete(make_core(checkpoint, backend="triton"), prompt, **params)
    reference = complete(make_core(checkpoint, backend="torch"), prompt, **params)
    assert fast.token_ids == reference.token_ids
    for got, expected in zip(fast.logprobs, reference.logprobs, strict=True):
        assert got.chosen.logprob == pytest.approx(expected.chosen.logprob, abs=1e-4)


def test_triton_kernels_over_int8_kv_give_the_tokens_of_the_reference_over_it(checkpoint: Path) -> None:
    """The fused store quantizes as the reference's `kv_quant.write` does, attention dots the codes and scales
    the scores where the reference widens the rows first. The kernels' fp32 norms may differ from torch's by
    an ulp, which can move a code by one: logprobs within 1e-3."""
    prompt = _prompt(40, 3)
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    fast = complete(make_core(checkpoint, backend="triton", kv_dtype="int8"), prompt, **params)
    reference = complete(make_core(checkpoint, backend="torch", kv_dtype="int8"), prompt, **params)
    assert fast.token_ids == reference.token_ids
    for got, expected in zip(fast.logprobs, reference.logprobs, strict=True):
        assert got.chosen.logprob == pytest.approx(expected.chosen.logprob, abs=1e-3)


def test_triton_kernels_over_kv_streamed_from_host_ram_give_what_they_give_on_the_device(
    hybrid: Path,
) -> None:
    """`--kv-resident 16`: one block on the device, the others staged layer by layer; the fused store writes
    into the staging area through the shifted slot mapping and attention reads it through the shifted table,
    so prompt and decode windows give the whole pool's logprobs exactly."""
    prompt = _prompt(40, 4)
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    add = request(prompt, **params)
    results, windows = run(make_core(hybrid, backend="triton", kv_resident=16), [(0, add)])
    got = results[add.request_id]
    expected = complete(make_core(hybrid, backend="triton"), prompt, **params)
    assert sum(w.kv_host_reads for w in windows) > 0
    assert got.token_ids == expected.token_ids
    assert [p.chosen.logprob for p in got.logprobs] == [p.chosen.logprob for p in expected.logprobs]


def test_exact_kernels_give_the_tokens_of_the_reference(checkpoint: Path) -> None:
    prompt = _prompt(30, 2)
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    exact = make_core(checkpoint, backend="triton", exact=True)
    assert exact.backends.name == "triton+exact" and exact.backends.linear is not None
    reference = complete(make_core(checkpoint, backend="torch"), prompt, **params)
    assert complete(exact, prompt, **params).token_ids == reference.token_ids


def test_long_prompts_cut_into_other_pieces_beside_others_equal_each_alone(hybrid: Path) -> None:
    """Prompts longer than the budget are read in other windows and pieces together than alone (each alone
    through the torch reference).

    Tokens only: on the CPU torch's vectorised sigmoid / softplus / SiLU round an element by its place in the
    vector, so bits can differ with the batch (tests/gpu checks the bits on a GPU).
    """
    core = make_core(hybrid, backend="triton", parallel=2, max_batched_tokens=36, decode_share=0.01)
    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    arrivals = [(at, request(_prompt(length, at), **params)) for at, length in [(0, 40), (1, 46)]]
    together, windows = run(core, arrivals)
    assert any(w.prompt_tokens and w.decode_tokens for w in windows)
    alone = make_core(hybrid, backend="torch")  # each prompt alone through the reference (none interpreted)
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(alone, add.prompt_token_ids, **params).token_ids


def test_a_shared_prompt_start_is_continued_from_the_cache(hybrid: Path) -> None:
    """The first prompt leaves full blocks (and on hybrid models a checkpoint) up to 64: the others go on, to
    the tokens the torch reference gives the last one read whole."""
    core = make_core(hybrid, backend="triton", max_batched_tokens=256)
    shared = _prompt(72, 7)
    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    adds = [request([*shared, *_prompt(20, 20 + i)], **params) for i in range(3)]
    results, windows = run(core, [(0, adds[0]), (3, adds[1]), (3, adds[2])])
    assert sum(w.prefix_cache_hits for w in windows) == 2 * 64
    fresh = make_core(hybrid, backend="torch", prefix_cache=False)  # the reference: no interpreted kernel
    last = adds[-1]  # both followers continued from the same blocks and checkpoint
    assert results[last.request_id].token_ids == complete(fresh, last.prompt_token_ids, **params).token_ids


def _bucketed_arrivals() -> list[tuple[int, AddRequest]]:
    """Three greedy requests with logprobs, one a window: a prompt read in one chunk that checkpoints
    position 64 on the way, a short one, and a follow-up of the first from the cache."""
    params = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    shared = _prompt(70, 9)
    prompts = [shared, _prompt(20, 1), [*shared, *_prompt(6, 3)]]
    return [(i, request(prompt, **params)) for i, prompt in enumerate(prompts)]


def _assert_same_answers(arrivals: list[tuple[int, AddRequest]], got: dict, expected: list) -> None:
    """Every request got the tokens expected of it (`expected`: in the order of `arrivals`), and their
    logprobs to rounding."""
    for (_, add), theirs in zip(arrivals, expected, strict=True):
        ours = got[add.request_id]
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)


BUCKETED = {"backend": "triton", "parallel": 4, "max_batched_tokens": 72, "decode_share": 0.01}


@pytest.fixture(scope="module")
def eager_bucketed(hybrid: Path) -> list:
    """`_bucketed_arrivals`' answers (in their order) from the hybrid model run whole, every window eagerly
    through the torch reference's kernels (none interpreted): the reference of the tests through the windows'
    graphs, run once."""
    arrivals = _bucketed_arrivals()
    answers = run(make_core(hybrid, **{**BUCKETED, "backend": "torch"}), arrivals)[0]
    return [answers[add.request_id] for _, add in arrivals]


def test_windows_through_the_graphs_static_inputs_give_the_eager_windows_tokens(
    hybrid: Path, eager_bucketed: list
) -> None:
    """Decode rows, prompt pieces, fresh slots, a checkpoint saved inside a chunk and a follow-up from it,
    padded to buckets: the same tokens (and logprobs to rounding) as every window run eagerly."""
    arrivals = _bucketed_arrivals()
    graphed = make_core(hybrid, **BUCKETED)
    used = with_window_graphs(graphed)
    padded, windows = run(graphed, arrivals)
    assert {b.decode for b in used} == {True, False} and any(
        w.prompt_tokens and w.decode_tokens for w in windows
    )
    assert sum(w.prefix_cache_hits for w in windows) > 0
    _assert_same_answers(arrivals, padded, eager_bucketed)


def test_a_split_whose_stages_replay_their_graphs_gives_the_tokens_of_the_model_run_whole(
    hybrid: Path, eager_bucketed: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both stages of a split, two slot groups in flight, run windows through their graphs' static inputs
    (not captured on the CPU): stage 0 picks each window's bucket, every stage fills its own inputs and the
    stream crosses between them. Decode rows, prompt pieces, fresh slots, a checkpoint inside a chunk and a
    follow-up from it give the tokens (and logprobs to rounding) of the model run whole, eagerly."""
    arrivals = _bucketed_arrivals()
    monkeypatch.setattr(EngineCore, "_graphs_wanted", lambda self: True)
    core = make_core(hybrid, layer_split="2", batch_groups=2, **BUCKETED)
    try:
        assert isinstance(core.runner.graphs, StageGraphs)
        split, windows = run(core, arrivals)
    finally:
        core.close()
    replayed = [w for w in windows if w.replayed]
    assert any(w.prompt_tokens for w in replayed) and any(not w.prompt_tokens for w in replayed)
    assert sum(w.prefix_cache_hits for w in windows) > 0
    _assert_same_answers(arrivals, split, eager_bucketed)
