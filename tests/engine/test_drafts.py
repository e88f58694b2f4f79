"""Draft tokens: the n-gram drafter, the MTP head, the acceptance rule, and the engine's windows with drafts
against the same requests decoded one token a window (tiny models of both architectures on the CPU)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from contiguous_state import ContiguousState
from engine_helpers import complete, make_core, random_prompt, request, run, with_window_graphs
from tokenizers import Tokenizer

from app.default_model import default_model_dir
from app.engine.drafts import (
    GuessSource,
    MtpGuesses,
    NgramDrafter,
    accepted,
    guess_index,
    guess_placeholder,
)
from app.engine.head_graphs import HeadGraphs
from app.engine.mtp_drafts import MtpSpan
from app.engine.protocol import InvalidRequest, SamplingParams
from app.engine.sampler import RowSampling, Sampler
from app.engine.scheduler import placeholder
from app.engine.warm_up import warm_up_kernels
from app.errors import StrataError
from app.models.batch import ForwardBatch


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


SAMPLINGS = pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 0.3, "top_k": 3, "top_p": 0.9, "seed": 5},
        {"temperature": 0, "repetition_penalty": 1.3, "logprobs": 2},
    ],
    ids=["greedy", "seeded", "penalised"],
)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, max_position_embeddings=4096
    )


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


def _every_fifth(position: int, token: int, first: bool) -> bool:
    """Every fifth guess wrong, and some first ones."""
    return position % 5 == 4 or (first and position % 7 == 3)


def _oracle(
    monkeypatch: pytest.MonkeyPatch,
    answers: dict[tuple[int, ...], list[int]],
    wrong: Callable[[int, int, bool], bool] = _every_fifth,
) -> None:
    """Drafts from the answers decoded one token a window, those `wrong` says (of a guess's output position,
    token and whether it is a window's first) wrong: windows then accept all, some or none of their drafts
    (the tiny random models do not repeat themselves enough for n-grams to be tried this way)."""

    def draft(self: NgramDrafter, tokens: list[int], k: int) -> list[int]:
        prompt = max((p for p in answers if tuple(tokens[: len(p)]) == p), key=len)
        done = len(tokens) - len(prompt)
        guesses = answers[prompt][done : done + k]
        return [t + 1 if wrong(done + j, t, j == 0) else t for j, t in enumerate(guesses)]

    monkeypatch.setattr(NgramDrafter, "draft", draft)


@SAMPLINGS
@pytest.mark.parametrize("count", [1, 8])
def test_drafts_give_the_tokens_of_decoding_one_at_a_time(
    model: Path, params: dict, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = {"parallel": 8, "max_batched_tokens": 128, "decode_share": 0.01}
    plain, one_at_a_time = _tokens(make_core(model, **settings), params, count)
    prompts = [_repetitive(20 + 9 * i, i) for i in range(count)]
    _oracle(monkeypatch, {tuple(p): answer for p, answer in zip(prompts, plain, strict=True)})
    drafted, windows = _tokens(make_core(model, spec="ngram", spec_tokens=4, **settings), params, count)
    assert drafted == plain
    outcomes = [(k, n) for w in windows for _, k, n in w.drafts]
    assert any(n == k for k, n in outcomes) and any(0 < n < k for k, n in outcomes)  # all, and some
    assert any(n == 0 for k, n in outcomes)
    assert len(windows) < len(one_at_a_time)  # accepted drafts saved windows


def test_ngram_drafts_guess_a_repeated_phrase(tmp_path: Path) -> None:
    attention = write_checkpoint(tmp_path, "qwen3_moe", max_position_embeddings=4096)
    settings = {"parallel": 8, "max_batched_tokens": 128, "decode_share": 0.01}
    plain, _ = _tokens(make_core(attention, **settings), {"temperature": 0}, 3)
    drafted, windows = _tokens(make_core(attention, spec="ngram", **settings), {"temperature": 0}, 3)
    assert drafted == plain and sum(n for w in windows for _, _, n in w.drafts) > 0


def test_a_requests_own_spec_tokens_turn_drafts_on_or_off(model: Path) -> None:
    core = make_core(model, parallel=2, spec="ngram")
    plain, _ = _tokens(core, {"temperature": 0, "spec_tokens": 0}, 2)
    asked, windows = _tokens(core, {"temperature": 0, "spec_tokens": 2}, 2)
    assert asked == plain and max(k for w in windows for _, k, _ in w.drafts) == 2
    _, none = _tokens(core, {"temperature": 0, "spec_tokens": 0}, 1)
    assert not any(w.drafts for w in none)


def test_drafts_need_room_to_roll_back_on_a_recurrent_model(tmp_path: Path) -> None:
    attention = make_core(write_checkpoint(tmp_path / "moe", "qwen3_moe"))
    assert attention.add_request(request([5, 6, 7], spec_tokens=2)) == []  # drafts without --spec
    hybrid = make_core(write_checkpoint(tmp_path / "next", "qwen3_next"))
    [answer] = hybrid.add_request(request([5, 6, 7], spec_tokens=2))
    assert answer.finish_reason == "error" and "start the engine with --spec" in (answer.error or "")
    with pytest.raises(InvalidRequest, match="spec_tokens must be in"):
        SamplingParams(spec_tokens=17).validate()


def test_drafts_on_a_two_stage_split_give_the_tokens_of_the_whole_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hybrid model: its stage 1 holds recurrent layers whose state a wrong guess rolls back; two slot
    # groups pipelined down the stages, each drafting from its own tokens.
    model = write_checkpoint(tmp_path, "qwen3_next", max_position_embeddings=4096)
    settings = {"parallel": 4, "max_batched_tokens": 128, "decode_share": 0.01}
    whole, _ = _tokens(make_core(model, **settings), {"temperature": 0}, 4)
    prompts = [_repetitive(20 + 9 * i, i) for i in range(4)]
    _oracle(monkeypatch, {tuple(p): answer for p, answer in zip(prompts, whole, strict=True)})
    core = make_core(model, spec="ngram", layer_split="2", batch_groups=2, **settings)
    in_flight: list[int] = []
    launch = core._launch

    def counted(window: object, began: float) -> object:
        in_flight.append(len(core._flights))
        return launch(window, began)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "_launch", counted)
    try:
        split, windows = _tokens(core, {"temperature": 0}, 4)
    finally:
        core.close()
    outcomes = [(k, n) for w in windows for _, k, n in w.drafts]
    assert split == whole and any(n == k for k, n in outcomes) and any(n < k for k, n in outcomes)
    assert max(in_flight) == 1  # pipelined groups: one group's window launched while the other's runs


def test_a_follow_up_continues_from_what_a_drafting_turn_left(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Turns that stop at a token their window's drafts guessed wrong (the state rolled back and read again
    # in the window planned before the turn's end is handed out), or right (the state past the turn's end,
    # where later accepted drafts stand), leave
    # what a follow-up continues from (prefix cache, parked state): its tokens are those of an engine that
    # never drafted.
    settings = {"parallel": 2, "park_memory": 64 << 20}
    prompt = _repetitive(40, 3)
    plain = make_core(model, **settings)
    longest = complete(plain, prompt, max_tokens=30, temperature=0, ignore_eos=True).token_ids
    turns = []
    for stop in {longest[i] for i in (9, 16, 22)}:
        params = {"temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}
        first = complete(plain, prompt, max_tokens=30, **params).token_ids
        follow = [*prompt, *first, 7, 8, 9]
        turns.append((params, first, follow, complete(plain, follow, max_tokens=12, **params).token_ids))
    for (params, first, follow, expected), guessed_right in itertools.product(turns, (False, True)):
        wrong = _every_fifth if guessed_right else partial(_guessed_wrong, params["stop_token_ids"][0])
        _oracle(monkeypatch, {tuple(prompt): first, tuple(follow): expected}, wrong)
        drafting = make_core(model, spec="ngram", spec_tokens=4, **settings)
        assert complete(drafting, prompt, max_tokens=30, **params).token_ids == first
        assert complete(drafting, follow, max_tokens=12, **params).token_ids == expected


def _guessed_wrong(stop: int, position: int, token: int, first: bool) -> bool:
    return token == stop


@pytest.fixture(scope="module")
def headed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny hybrid model with a (random) MTP head."""
    return write_checkpoint(
        tmp_path_factory.mktemp("mtp"), "qwen3_next", mtp_layers=1, max_position_embeddings=4096
    )


class _Source:
    stale = False

    def value(self, index: int) -> int:
        return 100 + index


def test_guesses_left_on_the_device_are_drafted_as_placeholders_until_a_later_pass_replaces_them() -> None:
    source, guesses = _Source(), MtpGuesses()
    guesses.offer(5, [guess_placeholder(3), guess_placeholder(4)], source)
    drafts = guesses.draft([1, 2, 3, 4, 5], 3)
    assert [source.value(guess_index(t) or 0) for t in drafts] == [103, 104]
    assert guess_index(placeholder(0)) is None and guess_index(7) is None  # a window's, and a token
    assert guesses.draft([1, 2, 3, 4], 3) == []  # they follow five tokens
    source.stale = True
    assert guesses.draft([1, 2, 3, 4, 5], 3) == []  # another pass may have overwritten them


def _offers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int]]]:
    """Every (length, guesses) the MTP head offers, as it offers them."""
    offered: list[tuple[int, list[int]]] = []
    offer = MtpGuesses.offer

    def record(self: MtpGuesses, length: int, guesses: list[int], source: GuessSource | None = None) -> None:
        values = [t if (i := guess_index(t)) is None or source is None else source.value(i) for t in guesses]
        offered.append((length, values))
        offer(self, length, guesses, source)

    monkeypatch.setattr(MtpGuesses, "offer", record)
    return offered


def test_the_mtp_heads_guesses_are_what_it_predicts_over_the_whole_sequence(
    headed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The head reads each window's rows into its own keys and values as the windows go: its first guess
    # after every window is what the head predicts reading the whole sequence at once (tests/models).
    offered = _offers(monkeypatch)
    core = make_core(headed, parallel=2, max_batched_tokens=48, decode_share=0.01, spec="mtp", spec_tokens=3)
    prompt = random_prompt(70, 4)
    answer = complete(core, prompt, max_tokens=24, temperature=0, ignore_eos=True).token_ids
    tokens = prompt + answer
    model = core.loaded.model
    with torch.no_grad():
        batch = ForwardBatch.build([(0, tokens[:-1], 0)], ContiguousState())
        hidden = model(batch)
        logits = model.logits(model.mtp_forward(hidden, torch.tensor(tokens[1:]), batch))
    assert offered and offered[0][0] == len(prompt) + 1  # after the prompt's windows and the first token
    for length, guesses in offered:
        if length - 2 < len(logits):
            row = logits[length - 2]  # the head at the newest token's row guesses the one after it
            assert row[guesses[0]] >= row.max() - 1e-4, (length, guesses)
    assert all(len(g) == 3 for length, g in offered if length + 3 < len(tokens))


@SAMPLINGS
@pytest.mark.parametrize("count", [1, 8])
def test_mtp_drafts_give_the_tokens_of_decoding_one_at_a_time(
    headed: Path, params: dict, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = {"parallel": 8, "max_batched_tokens": 128, "decode_share": 0.01}
    plain, _ = _tokens(make_core(headed, **settings), params, count)
    offered = _offers(monkeypatch)
    drafted, windows = _tokens(make_core(headed, spec="mtp", spec_tokens=3, **settings), params, count)
    assert drafted == plain and offered and any(w.drafts for w in windows)


def test_mtp_drafts_over_kv_in_host_ram_give_the_tokens_of_decoding_one_at_a_time(headed: Path) -> None:
    """`--kv-resident`: the head's keys and values share the blocks, most of them in host RAM, and its passes
    stream them in as the decoder's layers do."""
    settings = {"parallel": 8, "max_batched_tokens": 128, "decode_share": 0.01}
    plain, _ = _tokens(make_core(headed, **settings), {"temperature": 0}, 8)
    core = make_core(headed, spec="mtp", spec_tokens=3, kv_resident=48, **settings)
    drafted, windows = _tokens(core, {"temperature": 0}, 8)
    assert drafted == plain and any(w.drafts for w in windows)
    assert sum(w.kv_host_reads for w in windows) > 0


def test_the_demo_models_mtp_head_guesses_most_next_tokens() -> None:
    demo = default_model_dir()
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    texts = ["Once upon a time, there was a little girl named Lily.", "Tom and his mom went to the park."]
    prompts = [tokenizer.encode(t).ids for t in texts]

    def answers(**config: object) -> tuple[list[list[int]], list]:
        core = make_core(demo, parallel=2, **config)
        arrivals = [(0, request(p, max_tokens=48, temperature=0)) for p in prompts]
        results, windows = run(core, arrivals)
        return [results[a.request_id].token_ids for _, a in arrivals], windows

    plain, _ = answers()
    drafted, windows = answers(spec="mtp", spec_tokens=3)
    assert drafted == plain
    outcomes = [(k, n) for w in windows for _, k, n in w.drafts]
    per_window = sum(1 + n for _, n in outcomes) / len(outcomes)
    assert per_window > 1.8, per_window  # the head guesses the token after next right ~75% of the time


@pytest.mark.parametrize("captured", [False, True], ids=["eager head", "captured head"])
def test_mtp_drafts_on_a_two_stage_split_give_the_tokens_of_the_whole_model(
    headed: Path, monkeypatch: pytest.MonkeyPatch, captured: bool
) -> None:
    """With the head's passes eager, or through its captured pass's static inputs (run eagerly on the CPU;
    on a split its guesses are read on the host)."""
    settings = {"parallel": 4, "max_batched_tokens": 128, "decode_share": 0.01}
    whole, _ = _tokens(make_core(headed, **settings), {"temperature": 0}, 4)
    core = make_core(headed, spec="mtp", layer_split="2", **settings)
    passes: list[bool] = []
    try:
        assert core.mtp is not None
        if captured:
            max_blocks = -(-core.max_model_len // core.config.block_size)
            head = HeadGraphs(core.loaded.model, core.runner.state, 4, 3, max_blocks)
            run_head = head.run
            monkeypatch.setattr(head, "run", lambda *args: passes.append(args[-1]) or run_head(*args))
            core.mtp.graphs = head
        split, windows = _tokens(core, {"temperature": 0}, 4)
    finally:
        core.close()
    assert split == whole and any(w.drafts for w in windows)
    assert (passes and not any(passes)) if captured else not passes


def test_mtp_drafts_need_a_head(model: Path) -> None:
    with pytest.raises(StrataError, match="no MTP head"):
        make_core(model, spec="mtp")


@pytest.mark.parametrize("adapt_every", [0, 4], ids=["frozen", "adapting"])
def test_mtp_drafts_beside_an_expert_tier_give_the_tokens_of_the_whole_model(
    headed: Path, adapt_every: int
) -> None:
    settings = {"parallel": 4, "max_batched_tokens": 128, "decode_share": 0.01}
    whole, _ = _tokens(make_core(headed, **settings), {"temperature": 0}, 4)
    tiered = make_core(headed, spec="mtp", expert_cache=2, adapt_every=adapt_every, **settings)
    assert tiered.tiered
    drafted, windows = _tokens(tiered, {"temperature": 0}, 4)
    assert drafted == whole and any(w.drafts for w in windows)


def test_drafts_with_the_reference_kernels_give_the_tokens_of_decoding_one_at_a_time(headed: Path) -> None:
    # The reference set has no fused decode step: the recurrent layers project a drafting window's rows at
    # once and run only the conv and delta rule row by row.
    settings = {"parallel": 4, "max_batched_tokens": 128, "decode_share": 0.01, "backend": "torch"}
    plain, _ = _tokens(make_core(headed, **settings), {"temperature": 0}, 3)
    drafted, windows = _tokens(make_core(headed, spec="mtp", **settings), {"temperature": 0}, 3)
    assert drafted == plain and any(w.drafts for w in windows)


def test_drafting_windows_through_the_graphs_give_the_tokens_of_one_token_a_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernels (interpreter) with the tiles fixed: verifying windows padded to the graphs' mixed
    buckets, whose Gated DeltaNet layers read each drafting chunk token by token in one launch and keep the
    state after each row in a draft slot, give the tokens of one token a window (the torch reference's), with
    guesses all right, partly right and all wrong."""
    hybrid = write_checkpoint(tmp_path, "qwen3_next", num_hidden_layers=2, full_attention_interval=2)
    settings = {"backend": "triton", "exact": True, "parallel": 2, "max_batched_tokens": 32}
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    prompts = [random_prompt(9, 4), random_prompt(5, 5)]
    arrivals = [(0, request(p, **params)) for p in prompts]
    plain, _ = run(make_core(hybrid, **{**settings, "backend": "torch"}), arrivals)  # the reference's tokens
    answers = {tuple(a.prompt_token_ids): plain[a.request_id].token_ids for _, a in arrivals}
    _oracle(monkeypatch, answers, lambda position, token, first: position in (1, 3))
    drafting = make_core(hybrid, spec="ngram", spec_tokens=3, **settings)
    with_window_graphs(drafting, draft_rows=2 * 3)
    graphs = drafting.runner.graphs
    assert graphs is not None
    verified: list[int] = []  # draft tokens of each window run over the graphs' static inputs
    run_bucket = graphs.run

    def run_and_count(chunks: list, bucket: object, fed: object = None) -> torch.Tensor:
        verified.append(sum(c.drafts for c in chunks))
        return run_bucket(chunks, bucket, fed)  # type: ignore[arg-type]

    monkeypatch.setattr(graphs, "run", run_and_count)
    drafted, windows = run(drafting, [(0, request(p, **params)) for p in prompts])
    assert [r.token_ids for r in drafted.values()] == [plain[a.request_id].token_ids for _, a in arrivals]
    outcomes = [(k, n) for w in windows for _, k, n in w.drafts]
    assert any(n == k for k, n in outcomes) and any(0 < n < k for k, n in outcomes)
    assert any(n == 0 for k, n in outcomes)
    assert sum(verified) == sum(k for k, _ in outcomes) > 0  # every drafting window went through them


def test_the_heads_captured_pass_guesses_what_its_eager_pass_guesses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model's head over the static inputs of its graphs (run eagerly on the CPU) against its eager
    pass, on every pass of a run with three slots: verified rows all, partly and not accepted, spans padded
    to the span counts captured."""
    demo = default_model_dir()
    core = make_core(demo, parallel=3, max_batched_tokens=48, decode_share=0.01, spec="mtp", spec_tokens=3)
    drafter = core.mtp
    assert drafter is not None and drafter.graphs is None  # no graphs on the CPU
    max_blocks = -(-core.max_model_len // core.config.block_size)
    head = HeadGraphs(core.loaded.model, core.runner.state, 3, 3, max_blocks)
    eager_guess = drafter.guess
    compared: list[int] = []

    def both(hidden: torch.Tensor, spans: list[MtpSpan], on_device: bool) -> tuple[list[list[int]], None]:
        eager, _ = eager_guess(hidden, spans)  # its keys and values first: the graphs' pass writes the same
        bucket = head.bucket(spans)
        if bucket is not None:
            assert head.run(hidden, spans, bucket) == eager
            held = head.run(hidden, spans, bucket, on_device=True)  # left on the device: placeholders
            source = head.latest
            assert source is not None
            assert [[source.value(guess_index(t) or 0) for t in row] for row in held] == eager
            compared.append(len(spans))
        return eager, None

    monkeypatch.setattr(drafter, "guess", both)
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    texts = ["def add(a, b):", "class Queue:\n    def __init__(self):", "for name in names:"]
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    arrivals = [(i, request(tokenizer.encode(t).ids, **params)) for i, t in enumerate(texts)]
    _, windows = run(core, arrivals)
    assert len(compared) > 3 and max(compared) == 3
    outcomes = [(k, n) for w in windows for _, k, n in w.drafts]
    assert any(n == k for k, n in outcomes) and any(0 < n < k for k, n in outcomes)
    assert any(n == 0 for k, n in outcomes)


def test_the_kernel_warm_up_runs_the_drafting_head_and_leaves_conversations_alone(
    headed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(headed, parallel=2, spec="mtp", spec_tokens=3)
    prompt = random_prompt(40, 5)
    first = complete(core, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    model = core.runner.model
    passes: list[int] = []
    head_forward = model.mtp_forward

    def counted(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        passes.append(len(hidden))
        return head_forward(hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "mtp_forward", counted)
    warm_up_kernels(model, core.runner.state, 128)
    assert passes  # the head's eager pass over prompt rows is compiled before the first request
    again = complete(core, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert again.token_ids == first.token_ids


@SAMPLINGS
def test_mtp_drafts_through_the_heads_captured_pass_give_the_tokens_of_one_token_a_window(
    headed: Path, monkeypatch: pytest.MonkeyPatch, params: dict
) -> None:
    """Every head pass through the captured pass's static inputs (run eagerly on the CPU), a prompt's rows
    but its last read eagerly before it: the tokens of decoding one token a window. The guesses stay on the
    device and the windows feed them from there, unless penalties read them on the host."""
    settings = {"parallel": 3, "max_batched_tokens": 48, "decode_share": 0.01}
    plain, _ = _tokens(make_core(headed, **settings), params, 3)
    core = make_core(headed, spec="mtp", spec_tokens=3, **settings)
    assert core.mtp is not None
    max_blocks = -(-core.max_model_len // core.config.block_size)
    head = HeadGraphs(core.loaded.model, core.runner.state, 3, 3, max_blocks)
    core.mtp.graphs = head
    passes: list[bool] = []
    run_head = head.run

    def counted(hidden: torch.Tensor, spans: list[MtpSpan], bucket: int, on_device: bool) -> list[list[int]]:
        passes.append(on_device)
        return run_head(hidden, spans, bucket, on_device)

    monkeypatch.setattr(head, "run", counted)
    guesses = core.mtp.guess
    calls: list[int] = []
    monkeypatch.setattr(core.mtp, "guess", lambda *args: calls.append(1) or guesses(*args))
    drafted, windows = _tokens(core, params, 3)
    assert drafted == plain
    assert len(passes) == len(calls) > 0  # none ran eagerly
    penalised = SamplingParams(**params).penalised
    assert all(not on for on in passes) if penalised else all(passes)
    assert any(w.drafts for w in windows)
