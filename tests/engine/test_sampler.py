"""The sampler: greedy, filters, seeded reproducibility in any batch, distribution, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.protocol import MAX_LOGPROBS, SamplingParams
from app.engine.sampler import (
    RowSampling,
    Sampler,
    apply_penalties,
    mix_seed,
    sampling_probs,
    seeded_noise,
)


def _row(
    position: int = 0,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    **params: object,
) -> RowSampling:
    return RowSampling(SamplingParams(**params), position, prompt, output)


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- seed mixing --------------------------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_mix_seed_is_splitmix64_of_seed_then_position() -> None:
    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output of splitmix64 seeded with 0
    for seed, position in [(0, 0), (7, 3), (123456789, 4096), (2**64 - 1, 1)]:
        assert mix_seed(seed, position) == _splitmix64(_splitmix64(seed) ^ position) & ((1 << 63) - 1)


def test_mix_seed_is_63_bit_and_separates_positions() -> None:
    values = {mix_seed(7, p) for p in range(1000)}
    assert len(values) == 1000
    assert all(0 <= v < 1 << 63 for v in values)
    assert mix_seed(7, 3) != mix_seed(8, 3)
    assert mix_seed(-1, 0) == mix_seed(2**64 - 1, 0)
    assert 0 <= mix_seed(1 << 70, 1 << 66) < 1 << 63


def test_seeded_noise_is_reproducible_exponential() -> None:
    a = seeded_noise(3, 10, 5000)
    assert a.dtype == torch.float32 and a.shape == (5000,)
    assert torch.equal(a, seeded_noise(3, 10, 5000))
    assert not torch.equal(a, seeded_noise(3, 11, 5000))
    assert (a > 0).all()
    assert abs(a.mean().item() - 1.0) < 0.05


# --- greedy and filters that reduce to greedy ---------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = _logits(6, 50)
    result = Sampler()(logits, [_row(temperature=0.0) for _ in range(6)])
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 6


def test_greedy_ties_take_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert Sampler()(logits, [_row(temperature=0.0)]).token_ids == [1]


def test_greedy_does_not_change_input_logits() -> None:
    logits = _logits(2, 30)
    before = logits.clone()
    rows = [
        _row(prompt=(1, 2), output=(3,), temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
        _row(seed=1, temperature=0.8, top_k=5, top_p=0.9, logprobs=3),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_tiny_temperature_behaves_like_greedy() -> None:
    logits = _logits(8, 100, seed=1)
    rows = [_row(position=i, temperature=1e-4, seed=i) for i in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()
    rows = [_row(temperature=1e-4) for _ in range(8)]
    assert Sampler(seed=5)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(16, 64, seed=2)
    sampler = Sampler()
    for trial in range(20):
        rows = [_row(position=trial, seed=trial if i % 2 else None, top_k=1) for i in range(16)]
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(16, 64, seed=3)
    sampler = Sampler()
    for trial in range(20):
        rows = [_row(position=trial, seed=trial if i % 2 else None, top_p=1e-6) for i in range(16)]
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


# --- filter semantics ---------------------------------------------------------------------------------------


def _probs_of(probs: list[float], **params: object) -> list[float]:
    logits = torch.tensor([probs]).log()
    return sampling_probs(logits, [SamplingParams(**params)])[0].tolist()


def test_sampling_probs_without_cuts_is_softmax_over_temperature() -> None:
    logits = _logits(3, 20, seed=4)
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)]
    expected = torch.stack([torch.softmax(logits[i] / t, -1) for i, t in enumerate((0.5, 1.0, 2.0))])
    torch.testing.assert_close(sampling_probs(logits, params), expected)


def test_sampling_probs_rejects_greedy_rows() -> None:
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(torch.zeros(1, 4), [SamplingParams(temperature=0.0)])


def test_top_k_keeps_k_largest_renormalised() -> None:
    got = _probs_of([0.1, 0.4, 0.2, 0.3], top_k=2)
    assert got == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7], abs=1e-6)
    assert _probs_of([0.1, 0.4, 0.2, 0.3], top_k=10) == pytest.approx([0.1, 0.4, 0.2, 0.3], abs=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_it() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]
    assert _probs_of(probs, top_p=0.4) == pytest.approx([0, 1, 0, 0], abs=1e-6)
    assert _probs_of(probs, top_p=0.75) == pytest.approx([0, 0.625, 0, 0.375], abs=1e-6)
    assert _probs_of(probs, top_p=0.85) == pytest.approx([0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95], abs=1e-6)
    assert _probs_of(probs, top_p=1.0) == pytest.approx(probs, abs=1e-6)


def test_top_p_one_keeps_every_token_despite_rounding() -> None:
    # Over a large vocabulary the fp32 running sum reaches 1.0 before the last tokens; top_p=1 must still
    # keep them when another cut (here top_k, min_p) sends the row through the filter.
    logits = torch.randn(1, 50000, generator=torch.Generator().manual_seed(0)) * 2
    for params in (SamplingParams(top_k=50000), SamplingParams(min_p=1e-30)):
        got = sampling_probs(logits, [params])
        assert (got > 0).all()
        torch.testing.assert_close(got, torch.softmax(logits, -1))


def test_top_p_applies_to_top_k_renormalised() -> None:
    # After top_k=2 the two survivors weigh 4/7 and 3/7: top_p=0.5 keeps only the first (4/7 >= 0.5),
    # where on the raw probabilities (0.4 < 0.5) it would have kept both.
    assert _probs_of([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5) == pytest.approx([1, 0, 0, 0], abs=1e-6)


def test_min_p_drops_tokens_below_share_of_max() -> None:
    got = _probs_of([0.5, 0.3, 0.12, 0.08], min_p=0.2)
    assert got == pytest.approx([0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0], abs=1e-6)
    assert _probs_of([0.5, 0.3, 0.12, 0.08], min_p=1.0) == pytest.approx([1, 0, 0, 0], abs=1e-6)


def test_min_p_filtered_token_is_never_drawn() -> None:
    # Token 3 has probability 0.08 < 0.2 * 0.5 and would otherwise be drawn ~8% of the time.
    logits = torch.tensor([[0.5, 0.3, 0.12, 0.08]]).log().expand(500, 4)
    seeded = [_row(position=i, seed=i, min_p=0.2) for i in range(500)]
    unseeded = [_row(min_p=0.2) for _ in range(500)]
    sampler = Sampler()
    tokens = sampler(logits, seeded).token_ids + sampler(logits, unseeded).token_ids
    assert 3 not in tokens
    assert set(tokens) == {0, 1, 2}
    without = sampler(logits, [_row(position=i, seed=i) for i in range(500)]).token_ids
    assert 3 in without


def test_filters_hold_row_by_row_in_a_mixed_batch() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().expand(4, 4)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.6, temperature=2.0),
    ]
    got = sampling_probs(logits, params)
    torch.testing.assert_close(got[0], torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(got[1], torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(got[2], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    hot = torch.softmax(torch.tensor([0.4, 0.3, 0.2, 0.1]).log() / 2, -1)
    torch.testing.assert_close(got[3], torch.cat([hot[:3] / hot[:3].sum(), torch.zeros(1)]))


# --- seeded reproducibility ---------------------------------------------------------------------------------


def test_seeded_row_is_the_same_alone_and_in_any_batch() -> None:
    vocab = 1000
    target = _logits(1, vocab, seed=10)[0] / 3  # flat enough that the draw is far from fixed
    others = _logits(5, vocab, seed=11)
    for seed in range(25):
        row = _row(position=40 + seed, seed=seed, temperature=0.9, top_p=0.95)
        alone = Sampler(seed=1)(target[None], [row]).token_ids[0]

        batch = torch.stack([others[0], others[1], target, others[2], others[3], others[4]])
        rows = [
            _row(seed=seed + 1, position=40 + seed),
            _row(),
            row,
            _row(temperature=0.0),
            _row(seed=seed, position=41 + seed, top_k=20),
            _row(prompt=(1, 2), output=(3,), repetition_penalty=1.3, presence_penalty=0.5),
        ]
        assert Sampler(seed=2)(batch, rows).token_ids[2] == alone

        reversed_rows = [rows[5], rows[4], rows[2], rows[0]]
        reversed_batch = torch.stack([others[4], others[3], target, others[0]])
        assert Sampler(seed=3)(reversed_batch, reversed_rows).token_ids[2] == alone

        last = torch.stack([others[1], target])
        assert Sampler(seed=4)(last, [_row(), row]).token_ids[1] == alone


def test_different_seeds_and_positions_draw_differently() -> None:
    logits = torch.zeros(200, 1000)  # uniform over 1000 tokens
    sampler = Sampler()
    by_seed = sampler(logits, [_row(position=5, seed=s) for s in range(200)]).token_ids
    by_position = sampler(logits, [_row(position=p, seed=5) for p in range(200)]).token_ids
    assert len(set(by_seed)) > 150
    assert len(set(by_position)) > 150
    assert by_seed != by_position


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = torch.zeros(64, 1000)
    rows = [_row() for _ in range(64)]
    first = Sampler(seed=9)(logits, rows).token_ids
    assert Sampler(seed=9)(logits, rows).token_ids == first
    assert Sampler(seed=10)(logits, rows).token_ids != first
    sampler = Sampler(seed=9)
    sampler(logits, rows)
    assert sampler(logits, rows).token_ids != first  # the generator moves on between calls


# --- distribution -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_softmax_over_temperature(seeded: bool) -> None:
    n, temperature = 4000, 0.7
    base = torch.tensor([1.0, 0.2, -0.5, 0.6, -1.5])
    expected = torch.softmax(base / temperature, -1)
    rows = [_row(position=i, seed=1234 if seeded else None, temperature=temperature) for i in range(n)]
    tokens = torch.tensor(Sampler(seed=77)(base.expand(n, 5), rows).token_ids)
    counts = torch.bincount(tokens, minlength=5).double()
    freq = counts / n
    assert (freq - expected.double()).abs().max().item() < 0.025
    chi2 = (((counts - n * expected.double()) ** 2) / (n * expected.double())).sum().item()
    assert chi2 < 18.5  # p ~ 0.001 for 4 degrees of freedom


def test_draws_follow_filtered_distribution() -> None:
    n = 4000
    base = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]).log().expand(n, 5)
    rows = [_row(position=i, seed=99, top_k=3) for i in range(n)]
    tokens = torch.tensor(Sampler()(base, rows).token_ids)
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.tensor([0, 0.4, 0, 0.3, 0.15], dtype=torch.float64) / 0.85
    assert (freq - expected).abs().max().item() < 0.025
    assert freq[0] == 0 and freq[2] == 0


# --- penalties ----------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    row = _row(prompt=(0, 1, 1), output=(3, 0, 5), repetition_penalty=2.0)
    got = apply_penalties(logits, [row])
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.0, 0.5, -6.0, 1.0, 0.0]]), rtol=0, atol=0)
    assert logits[0, 0] == 2.0  # the input is kept


def test_repetition_penalty_below_one_encourages() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    got = apply_penalties(logits, [_row(prompt=(0,), output=(1,), repetition_penalty=0.5)])
    torch.testing.assert_close(got, torch.tensor([[4.0, -0.5, 0.5]]), rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    row = _row(prompt=(4, 4, 4), output=(0, 2, 2, 2, 1, 2), presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, [row])
    expected = torch.tensor([[1 - 0.5 - 0.25, 1 - 0.5 - 0.25, 1 - 0.5 - 1.0, 1.0, 1.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


def test_negative_presence_and_frequency_penalties_raise_logits() -> None:
    logits = torch.zeros(1, 3)
    got = apply_penalties(logits, [_row(output=(1, 1), presence_penalty=-1.0, frequency_penalty=-0.5)])
    torch.testing.assert_close(got, torch.tensor([[0.0, 2.0, 0.0]]), rtol=0, atol=0)


def test_repetition_then_presence_and_frequency() -> None:
    logits = torch.tensor([[3.0, -2.0, 1.0]])
    row = _row(
        prompt=(2,), output=(0, 0, 1), repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5
    )
    got = apply_penalties(logits, [row])
    expected = torch.tensor([[3.0 / 1.5 - 0.5 - 1.0, -2.0 * 1.5 - 0.5 - 0.5, 1.0 / 1.5]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        _row(output=(2,), repetition_penalty=2.0),
        _row(output=(2,)),
        _row(output=(1, 1), frequency_penalty=1.0),
    ]
    got = apply_penalties(logits, rows)
    expected = torch.tensor([[1.0, 2.0, 1.5], [1.0, 2.0, 3.0], [1.0, 0.0, 3.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_no_penalty_returns_logits_unchanged() -> None:
    logits = _logits(2, 10)
    got = apply_penalties(logits, [_row(output=(1, 2)), _row(prompt=(3,), presence_penalty=1.0)])
    assert torch.equal(got, logits)


def test_penalties_flip_greedy_choice() -> None:
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.0]] * 5)
    rows = [
        _row(temperature=0.0),
        _row(prompt=(0,), temperature=0.0, repetition_penalty=2.0),  # 3 -> 1.5 < 2
        _row(output=(0,), temperature=0.0, presence_penalty=1.5),  # 3 -> 1.5 < 2
        _row(output=(0, 0), temperature=0.0, frequency_penalty=0.6),  # 3 -> 1.8 < 2
        _row(prompt=(0, 1), temperature=0.0, repetition_penalty=2.0),  # 1.5 vs 1.0: stays 0
    ]
    assert sampler(logits, rows).token_ids == [0, 1, 1, 1, 0]
    # A negative logit pushed further down by repetition: -1 * 2 = -2 < -1.5 (token 3 at -0.5 * 3).
    logits = torch.tensor([[-1.0, -10.0, -10.0, -1.5]])
    assert sampler(logits, [_row(prompt=(0,), temperature=0.0, repetition_penalty=2.0)]).token_ids == [3]


def test_penalised_sampling_uses_penalised_distribution() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0]]).expand(200, 3)
    rows = [
        _row(position=i, seed=i, output=(0,), presence_penalty=2.0, frequency_penalty=2.0) for i in range(200)
    ]
    tokens = Sampler()(logits, rows).token_ids
    share = tokens.count(0) / 200
    expected = torch.softmax(torch.tensor([1.0, 0.0, 0.0]), -1)[0].item()
    assert abs(share - expected) < 0.12


# --- logprobs -----------------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits() -> None:
    logits = _logits(3, 40, seed=20)
    raw = torch.log_softmax(logits, -1)
    rows = [
        _row(temperature=0.0, logprobs=5, output=(int(logits[0].argmax()),), repetition_penalty=5.0),
        _row(position=3, seed=3, temperature=0.5, top_k=3, logprobs=MAX_LOGPROBS),
        _row(logprobs=2, presence_penalty=2.0, output=(1, 2)),
    ]
    result = Sampler()(logits, rows)
    for i, (row, lp) in enumerate(zip(rows, result.logprobs, strict=True)):
        assert lp is not None
        assert lp.chosen.token_id == result.token_ids[i]
        assert lp.chosen.logprob == pytest.approx(raw[i, lp.chosen.token_id].item(), abs=1e-6)
        assert len(lp.top) == row.params.logprobs
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True)
        top = raw[i].topk(row.params.logprobs)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-6)
        for t in lp.top:
            assert t.logprob == pytest.approx(raw[i, t.token_id].item(), abs=1e-6)


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    logits = _logits(1, 10, seed=21)
    result = Sampler()(logits, [_row(temperature=0.0, logprobs=0)])
    lp = result.logprobs[0]
    assert lp is not None and lp.top == []
    assert lp.chosen.token_id == int(logits.argmax())
    assert lp.chosen.logprob == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-6)


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = _logits(4, 12, seed=22)
    rows = [_row(logprobs=None), _row(logprobs=3), _row(temperature=0.0), _row(logprobs=0, seed=1)]
    result = Sampler()(logits, rows)
    assert result.logprobs[0] is None and result.logprobs[2] is None
    assert result.logprobs[1] is not None and len(result.logprobs[1].top) == 3
    assert result.logprobs[3] is not None and result.logprobs[3].top == []
    assert len(result.token_ids) == 4


def test_logprobs_wider_than_vocab_list_the_whole_vocab() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    result = Sampler()(logits, [_row(temperature=0.0, logprobs=5), _row(temperature=0.0, logprobs=1)])
    wide, narrow = result.logprobs
    assert wide is not None and narrow is not None
    assert [t.token_id for t in wide.top] == [2, 1, 0]
    assert sum(math.exp(t.logprob) for t in wide.top) == pytest.approx(1.0, abs=1e-6)
    assert [t.token_id for t in narrow.top] == [2]


# --- shapes -------------------------------------------------------------------------------------------------


def test_empty_batch() -> None:
    result = Sampler()(torch.zeros(0, 8), [])
    assert result.token_ids == [] and result.logprobs == []


def test_rows_must_match_logits() -> None:
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(torch.zeros(3, 8), [_row(), _row()])
