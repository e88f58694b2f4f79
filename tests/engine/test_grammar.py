"""Structured output in the engine: a request's grammar masks its tokens, the free requests beside it draw
what they draw alone (tiny models of both architectures on the CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from checkpoints import PERSON_SCHEMA as PERSON
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.engine.grammar import TokenMask
from app.engine.grammar_source import check_grammar
from app.engine.protocol import AddRequest, Grammar, InvalidRequest, SamplingParams
from app.engine.sampler import RowSampling, Sampler


def _schema(schema: dict) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_sampled_outputs_under_a_json_schema_always_validate(checkpoint: Path) -> None:
    core = make_core(checkpoint, parallel=8)
    arrivals = [
        (
            i // 4,
            request(random_prompt(5 + i, i), max_tokens=60, temperature=1.0, seed=i, grammar=_schema(PERSON)),
        )
        for i in range(16)
    ]
    results, _ = run(core, arrivals)
    finished = [r for r in results.values() if r.finish_reason == "stop"]
    assert len(finished) >= 8  # the tiny random model mostly finishes within 60 tokens
    for result in finished:
        jsonschema.validate(json.loads(result.text), PERSON)
    for result in results.values():
        assert result.finish_reason in ("stop", "length")


def test_free_requests_beside_constrained_ones_draw_what_they_draw_alone(checkpoint: Path) -> None:
    core = make_core(checkpoint, parallel=4)
    free = [
        request(random_prompt(12, 1), max_tokens=12, temperature=0, ignore_eos=True),
        request(random_prompt(30, 2), max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
    ]
    alone, _ = run(core, [(0, add) for add in free])
    again = [request(list(add.prompt_token_ids), **_fields(add.params)) for add in free]
    constrained = [
        request(random_prompt(9, 3), max_tokens=12, temperature=0, grammar=Grammar("regex", "[a-z]{3,}")),
        request(random_prompt(20, 4), max_tokens=12, temperature=1.0, seed=3, grammar=_schema(PERSON)),
    ]
    together, stats = run(core, [(0, add) for add in again + constrained])
    assert any(len(w.slots) == 4 for w in stats)  # they shared windows
    for first, second in zip(free, again, strict=True):
        assert together[second.request_id].token_ids == alone[first.request_id].token_ids
    assert re.fullmatch("[a-z]{3,}", together[constrained[0].request_id].text)


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_a_grammar_ends_its_request_when_its_output_is_whole(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    choice = Grammar("choice", json.dumps(["yes", "no", "maybe not"]))
    result = complete(core, random_prompt(8, 5), max_tokens=30, temperature=1.0, seed=1, grammar=choice)
    assert result.text in ("yes", "no", "maybe not") and result.finish_reason == "stop"
    forced = complete(
        core, random_prompt(8, 6), max_tokens=30, temperature=0, ignore_eos=True, grammar=choice
    )
    assert forced.text in ("yes", "no", "maybe not") and forced.finish_reason == "stop"


def test_a_constrained_request_drafts_nothing_and_keeps_its_grammar(checkpoint: Path) -> None:
    core = make_core(checkpoint, spec="ngram", spec_tokens=3, parallel=2)
    arrivals = [
        (0, request(random_prompt(10, 8), max_tokens=40, temperature=0, grammar=_schema(PERSON))),
        (0, request([5, 6, 7] * 6, max_tokens=20, temperature=0, ignore_eos=True)),
    ]
    results, stats = run(core, arrivals)
    first = results[arrivals[0][1].request_id]
    if first.finish_reason == "stop":
        jsonschema.validate(json.loads(first.text), PERSON)
    drafting_slots = {slot for w in stats for slot, _, _ in w.drafts}
    grammar_slots = {s.slot for w in stats for s in w.slots if s.request_id == arrivals[0][1].request_id}
    assert not drafting_slots & grammar_slots


def test_a_grammar_that_cannot_compile_is_refused_with_its_reason(checkpoint: Path) -> None:
    with pytest.raises(InvalidRequest, match="JSON schema cannot be compiled: .*objectx"):
        check_grammar(_schema({"type": "objectx"}))
    with pytest.raises(InvalidRequest, match="regular expression cannot be compiled"):
        check_grammar(Grammar("regex", "[a-z"))
    core = make_core(checkpoint)
    result = complete(core, [5, 6, 7], max_tokens=4, grammar=Grammar("lark", "start: missing_rule"))
    assert result.finish_reason == "error" and "cannot be compiled" in (result.error or "")
    assert complete(core, [5, 6, 7], max_tokens=3, temperature=0).finish_reason == "length"  # still serves


def test_the_mask_leaves_only_allowed_tokens_and_the_logprobs_of_the_model() -> None:
    """Bits unpacked right (token 32 * i + j is bit j of word i), rows without a mask untouched."""
    logits = torch.randn(3, 70)
    words = torch.zeros((1, 3), dtype=torch.int32)
    allowed = [1, 33, 64, 69]
    for token in allowed:
        words[0, token // 32] |= 1 << (token % 32)
    masked = TokenMask([1], words).apply(logits)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed
    rows = [RowSampling(SamplingParams(temperature=1.0, seed=s, logprobs=2), 0, [1], []) for s in range(3)]
    drawn = Sampler()(logits, rows, TokenMask([1], words))
    assert drawn.token_ids[1] in allowed
    chosen = drawn.logprobs[1]
    assert chosen is not None
    expected = torch.log_softmax(logits[1], -1)[drawn.token_ids[1]].item()
    assert chosen.chosen.logprob == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("settings", [{"overlap": False}, {"layer_split": "2"}], ids=["no-overlap", "split"])
def test_grammars_give_the_same_tokens_without_overlap_and_on_a_split(
    checkpoint: Path, settings: dict
) -> None:
    """Overlapped windows draw a grammar row's token once the window before is read; a split's windows
    have their masks at launch; both give the tokens of the plain engine."""

    def arrivals() -> list[tuple[int, AddRequest]]:
        params = {"max_tokens": 30, "temperature": 1.0, "grammar": _schema(PERSON)}
        constrained = [(i, request(random_prompt(6 + i, 20 + i), seed=i, **params)) for i in range(3)]
        return [
            *constrained,
            (1, request(random_prompt(15, 30), max_tokens=10, temperature=0, ignore_eos=True)),
        ]

    first = arrivals()
    plain, _ = run(make_core(checkpoint, parallel=4), first)
    second = arrivals()
    core = make_core(checkpoint, parallel=4, **settings)
    try:
        other, _ = run(core, second)
    finally:
        core.close()
    for (_, a), (_, b) in zip(first, second, strict=True):
        assert other[b.request_id].token_ids == plain[a.request_id].token_ids
