"""An engine whose MoE layers keep 2 experts on the device and the rest in host RAM: with the tier frozen,
every request's tokens equal the all-resident model's, and the residency shows in the expert reports."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import make_core, random_prompt, request, run

from app.engine.config import STREAMED_WINDOW_TOKENS, WINDOW_TOKENS, EngineConfig
from app.errors import StrataError
from app.models.expert_tier import TieredExperts
from app.models.moe import SparseMoE
from app.models.placement import layer_residency


def test_a_frozen_tier_with_two_experts_resident_gives_the_all_resident_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    arrivals = [
        (0, request(random_prompt(30, 80), **greedy)),
        (1, request(random_prompt(11, 81), **greedy)),
        (2, request(random_prompt(45, 82), max_tokens=8, temperature=0.9, seed=6, ignore_eos=True)),
    ]
    everything, _ = run(make_core(checkpoint), arrivals)
    core = make_core(checkpoint, expert_cache=2)
    tiers = [m for m in core.loaded.model.modules() if isinstance(m, TieredExperts)]
    assert tiers and all(t.gate_up is not None and t.gate_up.shape[0] == 2 for t in tiers)
    experts = core.loaded.model.config.num_experts
    assert all(t.host_gate_up.shape[0] == experts - 2 + 1 for t in tiers)  # host RAM: the others only
    tiered, windows = run(core, arrivals)
    for _, add in arrivals:
        assert tiered[add.request_id].token_ids == everything[add.request_id].token_ids
    report = next(w.experts for w in windows if w.experts is not None)
    assert all(row == [0, 0] + [1] * (experts - 2) for row in report.location)


def test_a_window_takes_more_tokens_where_the_tier_copies_host_experts_over_pcie() -> None:
    # a prompt window then copies nearly every host expert whatever its rows: fewer, larger windows
    assert EngineConfig().window_tokens(staged=False) == WINDOW_TOKENS
    assert EngineConfig().window_tokens(staged=True) == STREAMED_WINDOW_TOKENS > WINDOW_TOKENS
    assert EngineConfig(pcie_frac=0.5).window_tokens(staged=True) == STREAMED_WINDOW_TOKENS
    assert EngineConfig(pcie_frac=0.0).window_tokens(staged=True) == WINDOW_TOKENS  # every miss on the CPU
    assert EngineConfig(max_batched_tokens=512).window_tokens(staged=True) == 512  # as the user asked


def test_a_tier_on_the_cpu_keeps_the_default_window(checkpoint: Path) -> None:
    # on a CPU the host experts are computed where they lie: a window costs its rows, nothing is copied
    core = make_core(checkpoint, expert_cache=2)
    assert core.tiered and core.window_tokens == WINDOW_TOKENS
    assert core.ready().window_tokens == WINDOW_TOKENS
    assert core.scheduler.config.max_batched_tokens == WINDOW_TOKENS


def test_an_expert_cache_below_zero_is_refused(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--expert-cache"):
        make_core(checkpoint, expert_cache=-1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_tier_adapting_every_window_gives_the_all_resident_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(random_prompt(25, 83), **greedy)), (2, request(random_prompt(14, 84), **greedy))]
    everything, _ = run(make_core(checkpoint), arrivals)
    core = make_core(checkpoint, expert_cache=2, adapt_every=1, adapt_async=asynchronous)
    assert all(len(t.spare_slots) == asynchronous for t in core.tiers)
    adapting, windows = run(core, arrivals)
    assert sum(w.experts.swaps for w in windows if w.experts is not None) > 0
    assert sum(w.experts.pcie_bytes for w in windows if w.experts is not None) == 0  # nothing crosses PCIe
    for _, add in arrivals:
        assert adapting[add.request_id].token_ids == everything[add.request_id].token_ids


def test_a_negative_adaptation_period_is_refused(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--adapt-every"):
        make_core(checkpoint, expert_cache=2, adapt_every=-1)


def test_expert_vram_keeps_as_many_experts_a_layer_as_the_bytes_hold(checkpoint: Path) -> None:
    """`--expert-vram` is `--expert-cache` in bytes: the weights' dtype, every MoE layer (MTP included)."""
    everything = make_core(checkpoint, dtype="float32")
    config = everything.loaded.model.config
    layers = sum(isinstance(m, SparseMoE) for m in everything.loaded.model.modules())
    expert = 3 * config.hidden_size * config.moe_intermediate_size * 4
    tiered = make_core(checkpoint, dtype="float32", expert_vram=layers * expert * 3 + expert)
    assert tiered.tiers and all(t.resident == 3 for t in tiered.tiers)
    assert not make_core(checkpoint, dtype="float32", expert_vram=layers * expert * config.num_experts).tiers
    with pytest.raises(StrataError, match="not both"):
        make_core(checkpoint, expert_cache=2, expert_vram=1 << 30)


def test_whole_layers_placement_keeps_some_layers_untiered_and_gives_the_all_resident_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--expert-placement layers`: the same budget gathered into whole layers (no tier there, served from
    the device), one layer in part, the rest with no expert resident; the tokens are the all-resident ones."""
    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(random_prompt(28, 85), **greedy)), (1, request(random_prompt(9, 86), **greedy))]
    everything, _ = run(make_core(checkpoint), arrivals)
    core = make_core(checkpoint, expert_cache=3, expert_placement="layers")
    model = core.loaded.model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    experts = model.config.num_experts
    expected = layer_residency(3 * len(layers), len(layers), experts, "layers")
    assert [t.resident for t in core.tiers] == [n for n in expected if n < experts]
    assert len(core.tiers) < len(layers)
    placed, windows = run(core, arrivals)
    for _, add in arrivals:
        assert placed[add.request_id].token_ids == everything[add.request_id].token_ids
    reports = [w.experts for w in windows if w.experts is not None and w.experts.served]
    untiered = [i for i, moe in enumerate(layers) if not isinstance(moe.experts, TieredExperts)]
    for report in reports:
        for i in untiered:  # a whole layer on the device serves every entry from VRAM
            assert report.served[i] == [sum(report.routed[i]), 0, 0]
            assert report.location[i] == [0] * experts
    assert any(sum(r.served[i][1] for i in range(len(layers))) for r in reports)  # the others miss


def test_an_unknown_expert_placement_is_refused(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--expert-placement"):
        make_core(checkpoint, expert_cache=2, expert_placement="rows")


def test_the_gguf_benchmarks_shares_count_what_the_engines_reports_took(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's expert reports take the tiers' counts (a report every window here), so a benchmark that
    read only the tiers' counts after a run found none: benchmarks/gguf_bench.py adds up the reports'
    counts."""
    from benchmarks.gguf_bench import ServedShares

    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    core = make_core(checkpoint, expert_cache=2, adapt_every=0)
    shares = ServedShares(core)
    run(core, [(0, request(random_prompt(30, 80), max_tokens=4, temperature=0, ignore_eos=True))])
    served = shares.take()
    assert served["cpu_share"] > 0 and served["vram_share"] > 0
    assert sum(served.values()) == pytest.approx(1.0)
    assert shares.take() == {}
