"""The engine on the GPU with the Triton kernels and window graphs: batch = solo, graphs = eager = torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, request, run

from app.engine.config import STREAMED_WINDOW_TOKENS, WINDOW_TOKENS
from app.kernels import triton_launch
from app.models.expert_costs import MissCosts
from app.models.expert_tier import STREAM_COVERAGE, ExpertStaging
from app.models.moe import SparseMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, max_position_embeddings=4096
    )


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_eight_conversations_together_equal_each_alone(checkpoint: Path, exact: bool) -> None:
    # A small decode share lets prompts be read beside decoding slots at once, so that all eight overlap.
    core = make_core(
        checkpoint,
        device="cuda",
        dtype="bfloat16",
        parallel=8,
        max_batched_tokens=96,
        exact=exact,
        decode_share=0.01,
    )
    assert core.backends.name.startswith("triton") and core.runner.graphs is not None
    arrivals = [
        (i, request(_prompt(15 + 23 * i, i), max_tokens=30, temperature=0, ignore_eos=True)) for i in range(8)
    ]
    together, windows = run(core, arrivals)
    assert max(len(w.slots) for w in windows) >= 6
    for _, add in arrivals:
        alone = complete(core, add.prompt_token_ids, max_tokens=30, temperature=0, ignore_eos=True)
        assert together[add.request_id].token_ids == alone.token_ids


def test_prompts_cut_into_other_pieces_beside_others_give_bit_identical_logprobs(checkpoint: Path) -> None:
    """With --exact, a conversation's logprobs do not depend on the windows its prompt was read in.

    The prompts are longer than the budget, so they are cut into other pieces together than alone (at
    multiples of the Gated DeltaNet chunk on qwen3_next). The last arrives once the first three are read and
    decode (a request read while others' prompts wait holds its decoding), so it is read beside decode rows.
    """
    core = make_core(
        checkpoint,
        device="cuda",
        dtype="bfloat16",
        parallel=4,
        max_batched_tokens=200,
        exact=True,
        decode_share=0.01,
    )
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    arrivals = [
        (at, request(_prompt(n, 40 + at), **params)) for at, n in [(0, 500), (1, 650), (2, 300), (10, 900)]
    ]
    together, windows = run(core, arrivals)
    assert any(w.prompt_tokens and w.decode_tokens for w in windows)
    for _, add in arrivals:
        alone = complete(core, add.prompt_token_ids, **params)
        assert together[add.request_id].token_ids == alone.token_ids
        got = [p.chosen.logprob for p in together[add.request_id].logprobs]
        assert got == [p.chosen.logprob for p in alone.logprobs]


def test_windows_replayed_from_graphs_equal_eager_windows_bit_for_bit(checkpoint: Path) -> None:
    """With --exact, prompt pieces beside decode rows padded into captured buckets give the logprobs of the
    same windows run eagerly, bit for bit."""
    settings = {
        "device": "cuda",
        "dtype": "bfloat16",
        "parallel": 4,
        "max_batched_tokens": 200,
        "exact": True,
        "decode_share": 0.01,
    }
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    arrivals = [(at, request(_prompt(n, 60 + at), **params)) for at, n in [(0, 300), (1, 90), (3, 170)]]
    graphed = make_core(checkpoint, **settings)
    assert graphed.runner.graphs is not None
    replayed: list[bool] = []
    launch = graphed.runner.launch

    def launch_and_record(window):  # type: ignore[no-untyped-def]
        launched = launch(window)
        if window.prompt_tokens:
            replayed.append(launched.replayed)
        return launched

    graphed.runner.launch = launch_and_record  # type: ignore[method-assign]
    together, _ = run(graphed, arrivals)
    eager, _ = run(make_core(checkpoint, enforce_eager=True, **settings), arrivals)
    assert replayed and all(replayed)
    for _, add in arrivals:
        assert together[add.request_id].token_ids == eager[add.request_id].token_ids
        got = [p.chosen.logprob for p in together[add.request_id].logprobs]
        assert got == [p.chosen.logprob for p in eager[add.request_id].logprobs]


def test_dependent_launches_give_the_bits_of_plain_launches(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels placed while their predecessor finishes (programmatic dependent launch, graphs and eager prompt
    windows) wait for its results: the logprobs of a batch are those of plain launches, bit for bit."""
    settings = {"device": "cuda", "dtype": "bfloat16", "parallel": 4, "max_batched_tokens": 128}
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    arrivals = [(at, request(_prompt(n, 80 + at), **params)) for at, n in [(0, 150), (1, 40), (2, 90)]]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("STRATA_PDL", setting)
        triton_launch._dependent_programs.cache_clear()
        results[setting], _ = run(make_core(checkpoint, **settings), arrivals)
    triton_launch._dependent_programs.cache_clear()
    for _, add in arrivals:
        dependent, plain = results["1"][add.request_id], results["0"][add.request_id]
        assert dependent.token_ids == plain.token_ids
        assert [p.chosen.logprob for p in dependent.logprobs] == [p.chosen.logprob for p in plain.logprobs]


def test_triton_and_graphs_give_the_tokens_of_the_torch_reference(checkpoint: Path) -> None:
    prompt = _prompt(40, 5)
    tokens = {}
    for name, options in {
        "torch": {"backend": "torch"},
        "eager": {"enforce_eager": True},
        "graphs": {},
    }.items():
        core = make_core(checkpoint, device="cuda", **options)
        tokens[name] = complete(core, prompt, max_tokens=32, temperature=0, ignore_eos=True).token_ids
    assert tokens["eager"] == tokens["torch"]
    assert tokens["graphs"] == tokens["torch"]


def test_graph_padding_rows_are_not_counted_as_routed(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    core = make_core(checkpoint, device="cuda", parallel=8)
    adds = [request(_prompt(30, 12 + i), max_tokens=5, temperature=0, ignore_eos=True) for i in range(3)]
    _, windows = run(core, [(0, a) for a in adds])
    config = core.loaded.model.config
    for layer in range(len(windows[0].experts.layers)):
        routed = sum(sum(w.experts.routed[layer]) for w in windows)
        assert routed == sum(w.rows for w in windows) * config.num_experts_per_tok


def test_a_follow_up_from_the_prefix_cache_gives_the_tokens_of_reading_it_all(checkpoint: Path) -> None:
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    cached = make_core(checkpoint, device="cuda")
    fresh = make_core(checkpoint, device="cuda", prefix_cache=False)
    first = _prompt(300, 50)
    answer = complete(cached, first, **params).token_ids
    follow_up = [*first, *answer, *_prompt(40, 51)]
    add = request(follow_up, **params)
    results, windows = run(cached, [(0, add)])
    assert sum(w.prefix_cache_hits for w in windows) >= 300
    assert results[add.request_id].token_ids == complete(fresh, follow_up, **params).token_ids


def test_overlapped_windows_replayed_from_graphs_give_the_plain_loops_tokens(checkpoint: Path) -> None:
    """Windows planned and queued while the one before runs feed its tokens from the device into the graphs'
    static inputs: with --exact, the tokens and logprobs of the plain loop, bit for bit."""
    settings = {"device": "cuda", "dtype": "bfloat16", "parallel": 4, "max_batched_tokens": 128}
    params = {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    seeded = {"max_tokens": 9, "temperature": 0.8, "seed": 4, "ignore_eos": True}
    arrivals = [(0, request(_prompt(200, 70), **params)), (2, request(_prompt(30, 71), **seeded))]
    arrivals += [(4, request(_prompt(90, 72), **params)), (5, request(_prompt(7, 73), **params))]
    results = {}
    for overlap in (False, True):
        core = make_core(checkpoint, overlap=overlap, exact=True, **settings)
        assert core.runner.graphs is not None
        results[overlap], _ = run(core, arrivals)
    for _, add in arrivals:
        plain, overlapped = results[False][add.request_id], results[True][add.request_id]
        assert overlapped.token_ids == plain.token_ids
        assert [p.chosen for p in overlapped.logprobs] == [p.chosen for p in plain.logprobs]


def test_captured_mixed_windows_price_prompt_rows_before_any_window_runs(checkpoint: Path) -> None:
    core = make_core(checkpoint, device="cuda", dtype="bfloat16", parallel=4, max_batched_tokens=256)
    assert core.runner.graphs is not None and core.scheduler.cost.calibrated
    assert core.scheduler.cost.predict(256, 2) > 0


@pytest.mark.parametrize(
    ("pcie_frac", "eager", "split", "pool"),
    [
        (None, False, False, "step"),
        (0.0, False, False, "step"),
        (1.0, False, False, "step"),
        (None, True, False, "step"),
        (None, False, True, "step"),
        (None, False, False, "background"),
        (None, False, False, "device wait"),
        (0.0, False, False, "device wait"),
        (None, False, True, "device wait"),
        (None, False, False, "device wait, Python step"),
    ],
)
def test_a_frozen_expert_tier_on_the_gpu_gives_the_all_resident_tokens(
    checkpoint: Path,
    pcie_frac: float | None,
    eager: bool,
    split: bool,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two experts a layer on the device (the Triton experts kernel), the misses computed on the CPU from
    host RAM or copied over PCIe into staging slots (as measured, all on the CPU, all over PCIe; or with
    experts split between the two at 8 channels, where the test model's 32 would not be split at 64), decode
    windows replayed as piecewise graphs (or all eager), the CPU pool run in the step's thread, on its own
    (`STRATA_POOL_BACKGROUND=1`), or so with the graph after a cut launched while it runs, waiting for it on
    the device (`STRATA_POOL_DEVICE_WAIT=1`), a small window's host step native where the pool runs in the
    background (app/models/tier_step.py), or in Python (`STRATA_NATIVE_STEP=0`): the greedy tokens of the
    all-resident model."""
    monkeypatch.setenv("STRATA_POOL_BACKGROUND", str(int(pool != "step")))
    monkeypatch.setenv("STRATA_POOL_DEVICE_WAIT", str(int(pool.startswith("device wait"))))
    monkeypatch.setenv("STRATA_NATIVE_STEP", str(int(not pool.endswith("Python step"))))
    splits = []
    if split:  # both sides described as equally fast, so that a lone miss is split (at 8 of 32 channels)
        monkeypatch.setattr("app.models.expert_tier.SPLIT_ALIGN", 8)
        monkeypatch.setattr("app.models.expert_costs.SPLIT_GAIN_S", 0.0)
        monkeypatch.setattr(MissCosts, "observe_cpu", lambda *observed: None)
        monkeypatch.setattr(MissCosts, "observe_pcie", lambda *observed: None)
        zero = ExpertStaging.zero_gate_rows  # what every split does, in Python or native

        def zero_and_count(self: ExpertStaging, channels: int) -> None:
            splits.append(channels)
            zero(self, channels)

        monkeypatch.setattr(ExpertStaging, "zero_gate_rows", zero_and_count)
    settings = {"device": "cuda", "dtype": "float32", "parallel": 2}
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(_prompt(40, 90), **params)), (1, request(_prompt(9, 91), **params))]
    everything, _ = run(make_core(checkpoint, **settings), arrivals)
    tiered = make_core(
        checkpoint, expert_cache=2, adapt_every=0, pcie_frac=pcie_frac, enforce_eager=eager, **settings
    )
    assert tiered.tiered
    # prompt windows copy host experts, larger ones, unless every miss stays on the CPU
    assert tiered.window_tokens == (STREAMED_WINDOW_TOKENS if pcie_frac != 0.0 else WINDOW_TOKENS)
    graphs = tiered.runner.graphs
    assert (graphs is None) if eager else (graphs is not None and graphs.pieces and not graphs.graphs)
    link = tiered.tiers[0].link
    assert link is not None and link.fns.waits == pool.startswith("device wait")
    assert (tiered.tiers[0].host_finish is None) == (pool == "step")
    costs = tiered.tiers[0].costs
    assert costs is not None
    if split:  # the tiny experts' measured costs are their calls' own: described instead
        costs.pcie_bytes_s, costs.cpu_row_s, costs.cpu_fixed_s = costs.cpu_bytes_s, 0.0, 0.0
    measured = costs.pcie_bytes_s
    results, stats = run(tiered, arrivals)
    for _, add in arrivals:
        assert results[add.request_id].token_ids == everything[add.request_id].token_ids
    native = not eager and pool in ("background", "device wait")
    assert all((t._small_step is not None) == native for t in tiered.tiers)
    reported = [s.experts.served_total() for s in stats if s.experts is not None]
    reported += [t.take_counts().served for t in tiered.tiers]  # since the last report
    vram, cpu, pcie = (sum(c) for c in zip(*reported, strict=True))
    assert vram > 0 and cpu + pcie > 0
    assert (pcie_frac != 1.0 or cpu == 0) and (pcie_frac != 0.0 or pcie == 0)
    if pcie_frac == 1.0:  # the copies' device time, read at later steps, moved the link's rate
        assert costs.pcie_bytes_s != measured
    assert bool(splits) == split  # at 64 channels the test model's experts are never split


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_adapting_expert_tier_on_the_gpu_gives_the_all_resident_tokens(
    checkpoint: Path, asynchronous: bool
) -> None:
    """Swaps every window (queued before the next, or copied on a side stream and landed between windows)
    while decode windows replay piecewise graphs: the greedy tokens of the all-resident model."""
    settings = {"device": "cuda", "dtype": "float32", "parallel": 2}
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(_prompt(30, 92), **params)), (3, request(_prompt(12, 93), **params))]
    everything, _ = run(make_core(checkpoint, **settings), arrivals)
    tiered = make_core(checkpoint, expert_cache=2, adapt_every=1, adapt_async=asynchronous, **settings)
    results, stats = run(tiered, arrivals)
    for _, add in arrivals:
        assert results[add.request_id].token_ids == everything[add.request_id].token_ids
    assert sum(s.experts.swaps for s in stats if s.experts is not None) + tiered.expert_swaps > 0


def test_long_prompts_stream_whole_layers_ahead_and_give_the_all_resident_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows of more routed entries than a small window's (made small here) whose first tiered layer misses
    most host experts copy each later layer's host part a layer ahead on a side stream, and windows of
    STREAM_AT_ONCE entries an expert (made large here) every layer's from the first: the greedy tokens of
    the all-resident model, and the streamed layers' entries counted as served over PCIe."""
    monkeypatch.setattr("app.models.expert_tier.HOST_READ_ENTRIES", 64)
    settings = {"device": "cuda", "dtype": "float32", "parallel": 2}
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(_prompt(200, 94), **params)), (2, request(_prompt(150, 95), **params))]
    everything, _ = run(make_core(checkpoint, **settings), arrivals)
    tiered = make_core(checkpoint, expert_cache=2, adapt_every=0, **settings)
    experts = tiered.tiers[0].experts
    stream = tiered.tiers[0].stream
    assert stream is not None and len(stream.tiers) == len(tiered.tiers) > 1
    coverages: list[float] = []
    prefetched: list[int] = []
    begin, prefetch = stream.begin, stream.prefetch
    monkeypatch.setattr(stream, "begin", lambda coverage: (coverages.append(coverage), begin(coverage))[1])
    monkeypatch.setattr(stream, "prefetch", lambda at: (prefetched.append(at), prefetch(at))[1])
    # From its first layer: the 200-token prompt's window (400 entries), not the 150-token one's (302).
    monkeypatch.setattr("app.models.expert_tier.STREAM_AT_ONCE", 350 // experts)
    results, stats = run(tiered, arrivals)
    for _, add in arrivals:
        assert results[add.request_id].token_ids == everything[add.request_id].token_ids
    assert coverages and max(coverages) >= STREAM_COVERAGE  # the 150-token prompt, after its first layer
    assert prefetched.count(0) == 1 and prefetched.count(1) == 2  # the 200-token prompt from its first
    reported = [s.experts.served_total() for s in stats if s.experts is not None]
    reported += [t.take_counts().served for t in tiered.tiers]
    vram, _, pcie = (sum(c) for c in zip(*reported, strict=True))
    assert vram > 0 and pcie > 0


def test_whole_layers_placement_on_the_gpu_gives_the_all_resident_tokens(checkpoint: Path) -> None:
    """`--expert-placement layers`: whole layers untiered inside the decode graphs, the others tiered (the
    graphs cut only there): the greedy tokens of the all-resident model."""
    settings = {"device": "cuda", "dtype": "float32", "parallel": 2}
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    arrivals = [(0, request(_prompt(30, 96), **params)), (1, request(_prompt(12, 97), **params))]
    everything, _ = run(make_core(checkpoint, **settings), arrivals)
    placed = make_core(checkpoint, expert_cache=3, adapt_every=0, expert_placement="layers", **settings)
    moe_layers = sum(isinstance(m, SparseMoE) for m in placed.loaded.model.modules())
    assert 0 < len(placed.tiers) < moe_layers
    results, _ = run(placed, arrivals)
    for _, add in arrivals:
        assert results[add.request_id].token_ids == everything[add.request_id].token_ids
