"""Draft tokens: the n-gram drafter, the acceptance rule, and the engine's windows with drafts against
the same requests decoded one token a window (tiny attention-only model on the CPU)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, random_prompt, request, run

from app.engine.drafts import NgramDrafter, accepted
from app.engine.protocol import InvalidRequest, SamplingParams
from app.engine.sampler import RowSampling, Sampler
from app.errors import StrataError


def test_the_drafter_continues_the_latest_occurrence_of_the_longest_suffix() -> None:
    drafter = NgramDrafter()
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # "6 7" occurred twice before: the latest is followed by 2, 3; "7 ..." no longer helps
    assert drafter.draft(tokens, 3) == [2, 3, 6]
    tokens += [8]  # now "6 7 8" matches the first occurrence, longer than any other suffix
    assert drafter.draft(tokens, 2) == [9, 1]
    assert drafter.draft([1, 2, 3], 4) == []  # nothing repeats
    assert NgramDrafter().draft([4, 4], 3) == [4]  # what follows runs out at the end


def test_drafts_stand_while_each_equals_the_token_drawn_before_it() -> None:
    assert accepted([3, 4, 5], [3, 4, 5, 6]) == 3
    assert accepted([3, 4, 5], [3, 9, 5, 6]) == 1
    assert accepted([3], [2, 3]) == 0
    with pytest.raises(ValueError, match="verified by 3 rows"):
        accepted([1, 2], [1, 2])


def test_verified_drafts_keep_the_models_distribution() -> None:
    # A two-token toy model over 4 tokens: p1 for the first token, p2(. | first) for the second. Drafts
    # (d1, d2) are verified as the engine does: row 0 draws the first token, row 1 (after d1) the second
    # where d1 stood, else the next window draws it after the first. The pairs must follow p1 x p2.
    p1 = torch.tensor([0.5, 0.25, 0.15, 0.1])
    p2 = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25] * 4, [0.4, 0.4, 0.1, 0.1]])
    d1, d2 = 0, 3
    sampler = Sampler(seed=1)
    draws = 6000
    seeds = range(draws)

    def row(seed: int, position: int, output: list[int]) -> RowSampling:
        return RowSampling(SamplingParams(seed=seed), position, [9], output)

    first = sampler(
        torch.stack([p1.log(), p2[d1].log()]).repeat(draws, 1),
        [row(s, p, [] if p == 1 else [d1]) for s in seeds for p in (1, 2)],
    ).token_ids
    pairs: Counter[tuple[int, int]] = Counter()
    missed = []
    for i, seed in enumerate(seeds):
        drawn = first[2 * i : 2 * i + 2]
        if accepted([d1, d2], [*drawn, d2]) >= 1:
            pairs[(drawn[0], drawn[1])] += 1
        else:
            missed.append((seed, drawn[0]))
    again = sampler(torch.stack([p2[t].log() for _, t in missed]), [row(s, 2, [t]) for s, t in missed])
    for (_, t), second in zip(missed, again.token_ids, strict=True):
        pairs[(t, second)] += 1
    expected = {(a, b): draws * float(p1[a] * p2[a, b]) for a in range(4) for b in range(4)}
    chi2 = sum((pairs[c] - e) ** 2 / e for c, e in expected.items())
    assert chi2 < 37.7, chi2  # 15 degrees of freedom: p = 0.001
    assert math.isclose(sum(pairs.values()), draws)


@pytest.fixture(scope="module")
def attention_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", max_position_embeddings=4096)


def _repetitive(length: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase, so that n-gram drafts find something."""
    phrase = random_prompt(7, seed)
    return (phrase * (length // 7 + 1))[:length]


def _tokens(core: object, params: dict, count: int, stagger: int = 1) -> tuple[list[list[int]], list]:
    arrivals = [
        (stagger * i, request(_repetitive(20 + 9 * i, i), max_tokens=40, ignore_eos=True, **params))
        for i in range(count)
    ]
    results, windows = run(core, arrivals)  # type: ignore[arg-type]
    return [results[add.request_id].token_ids for _, add in arrivals], windows


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 0.3, "top_k": 3, "top_p": 0.9, "seed": 5},
        {"temperature": 0, "repetition_penalty": 1.3, "logprobs": 2},
    ],
    ids=["greedy", "seeded", "penalised"],
)
@pytest.mark.parametrize("count", [1, 8])
def test_drafts_give_the_tokens_of_decoding_one_at_a_time(
    attention_only: Path, params: dict, count: int
) -> None:
    settings = {"parallel": 8, "max_batched_tokens": 128, "decode_share": 0.01}
    plain, one_at_a_time = _tokens(make_core(attention_only, **settings), params, count)
    drafted, windows = _tokens(
        make_core(attention_only, spec="ngram", spec_tokens=4, **settings), params, count
    )
    assert drafted == plain
    proposed = sum(k for w in windows for k, _ in w.drafts)
    taken = sum(n for w in windows for _, n in w.drafts)
    assert proposed > 0 and taken > 0  # the repeated phrases were guessed, some of them right
    assert len(windows) < len(one_at_a_time)  # accepted drafts saved windows


def test_a_requests_own_spec_tokens_turn_drafts_on_or_off(attention_only: Path) -> None:
    core = make_core(attention_only, parallel=2)
    plain, _ = _tokens(core, {"temperature": 0}, 2)
    asked, windows = _tokens(core, {"temperature": 0, "spec_tokens": 2}, 2)
    assert asked == plain and max(k for w in windows for k, _ in w.drafts) == 2
    _, none = _tokens(make_core(attention_only, spec="ngram"), {"temperature": 0, "spec_tokens": 0}, 1)
    assert not any(w.drafts for w in none)


def test_drafts_are_refused_where_they_cannot_be_verified_yet(tmp_path: Path) -> None:
    hybrid = write_checkpoint(tmp_path, "qwen3_next")
    with pytest.raises(StrataError, match="Gated DeltaNet"):
        make_core(hybrid, spec="ngram")
    [answer] = make_core(hybrid).add_request(request([5, 6, 7], spec_tokens=2))
    assert answer.finish_reason == "error" and "Gated DeltaNet" in (answer.error or "")
    with pytest.raises(InvalidRequest, match="spec_tokens must be in"):
        SamplingParams(spec_tokens=17).validate()


def test_drafts_on_a_two_stage_split_give_the_tokens_of_the_whole_model(attention_only: Path) -> None:
    settings = {"parallel": 4, "max_batched_tokens": 128, "decode_share": 0.01}
    whole, _ = _tokens(make_core(attention_only, **settings), {"temperature": 0}, 4)
    core = make_core(attention_only, spec="ngram", layer_split="2", **settings)
    try:
        split, windows = _tokens(core, {"temperature": 0}, 4)
    finally:
        core.close()
    assert split == whole and sum(n for w in windows for _, n in w.drafts) > 0
