"""The layer split on the CPU: stage workers over gloo give the tokens of the model run whole."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.expert_report import joined
from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.engine.protocol import EXPERT_REPORT_S, AddRequest, ExpertUsage
from app.engine.split import split_layers, stage_gpus, stages_for
from app.errors import StrataError

GIB = 1 << 30


def test_a_stage_count_cuts_the_layers_evenly_the_later_stages_taking_the_odd_ones() -> None:
    assert [p.layers for p in split_layers("2", 48)] == [range(0, 24), range(24, 48)]
    assert [p.layers for p in split_layers("3", 4)] == [range(0, 1), range(1, 2), range(2, 4)]
    parts = split_layers("20,28", 48)
    assert [p.layers for p in parts] == [range(0, 20), range(20, 48)]
    assert [(p.first, p.last) for p in parts] == [(True, False), (False, True)]
    assert [(p.first, p.last) for p in split_layers("1", 3)] == [(True, True)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("5", "1 to 4 stages"),
        ("0", "1 to 4 stages"),
        ("2,3", "together the model's 4"),
        ("1,0,3", "each stage"),
        ("two", "give auto"),
    ],
)
def test_a_split_that_does_not_fit_the_model_is_a_one_line_error(spec: str, message: str) -> None:
    with pytest.raises(StrataError, match=message):
        split_layers(spec, 4)


def test_auto_takes_as_few_cards_as_hold_the_weights() -> None:
    assert stages_for(10 * GIB, []) == 1  # a CPU
    assert stages_for(10 * GIB, [24 * GIB, 24 * GIB]) == 1
    assert stages_for(30 * GIB, [24 * GIB, 24 * GIB]) == 2
    assert stages_for(160 * GIB, [80 * GIB] * 8) == 3
    assert stages_for(500 * GIB, [80 * GIB] * 4) == 4  # all of them, though it does not fit


def _workload(prompts: int, seed: int) -> list[tuple[int, AddRequest]]:
    """`prompts` requests arriving one window apart, greedy, 12 tokens each."""
    return [
        (i, request(random_prompt(9 + 31 * i, seed + i), max_tokens=12, temperature=0, ignore_eos=True))
        for i in range(prompts)
    ]


def _tokens(core: EngineCore, arrivals: list[tuple[int, AddRequest]]) -> list[list[int]]:
    results, _ = run(core, arrivals)
    return [results[add.request_id].token_ids for _, add in arrivals]


def _core(checkpoint: Path, **overrides: object) -> EngineCore:
    """8 slots, small windows, and a small decode share that reads prompts beside decoding slots at once."""
    return make_core(checkpoint, parallel=8, max_batched_tokens=96, decode_share=0.01, **overrides)


@pytest.fixture(scope="module")
def whole(checkpoint: Path) -> dict[int, list[list[int]]]:
    """The tokens of the model run whole: 1, 3 and 8 concurrent requests, then a follow-up turn."""
    core = _core(checkpoint)
    tokens = {n: _tokens(core, _workload(n, 10 * n)) for n in (1, 3, 8)}
    tokens[0] = _follow_up(core)
    core.close()
    return tokens


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3_next checkpoint alone, for tests of how stages handle their park files: its files hold KV
    and recurrent state, the other architecture's a part of that."""
    return write_checkpoint(tmp_path_factory.mktemp("hybrid"), "qwen3_next", max_position_embeddings=4096)


def _follow_up(core: EngineCore) -> list[list[int]]:
    """A conversation, then its next turn, which continues from the prefix cache."""
    first = random_prompt(70, 99)
    (answer,) = _tokens(core, [(0, request(first, max_tokens=8, temperature=0, ignore_eos=True))])
    turn = request([*first, *answer, *random_prompt(20, 98)], max_tokens=8, temperature=0, ignore_eos=True)
    results, windows = run(core, [(0, turn)])
    assert sum(w.prefix_cache_hits for w in windows) >= 64  # the first turn's full blocks
    return [answer, results[turn.request_id].token_ids]


@pytest.mark.parametrize(("stages", "groups"), [(2, 2), (3, 3), (4, 4), (2, None)])
def test_a_split_gives_the_tokens_of_the_whole_model(
    checkpoint: Path, whole: dict[int, list[list[int]]], stages: int, groups: int | None
) -> None:
    # One slot group per stage, each stage running another group's window; or one group (a CPU's
    # default), each window down the stages before the next, whose routing reports are checked too. Four
    # stages (issue 22's split, here over gloo) need a layer each: the qwen3_next checkpoint has them.
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    if stages > layers:
        pytest.skip(
            f"{stages} stages need {stages} layers; this checkpoint has {layers} "
            "(test_four_stages_with_four_groups_give_the_whole_models_tokens splits a 4-layer one in four)"
        )
    core = _core(checkpoint, layer_split=str(stages), batch_groups=groups)
    try:
        assert core.pipeline is not None and len(core.pipeline.parts) == stages
        assert core.groups == (groups or 1)
        for n in (1, 3, 8) if groups else (8,):  # one group: the pipelined runs' hardest case only
            arrivals = _workload(n, 10 * n)
            results, windows = run(core, arrivals)
            assert [results[add.request_id].token_ids for _, add in arrivals] == whole[n], f"{n} concurrent"
            for w in windows:  # every stage's times for every window that ran
                assert w.stages is not None and len(w.stages) == stages
                assert all(t.busy_s > 0 and t.wait_s >= 0 for t in w.stages)
        if groups:
            assert _follow_up(core) == whole[0]
        else:
            _routing_reports_cover_every_stage(core)
    finally:
        core.close()


def test_a_split_over_int8_kv_gives_the_tokens_of_the_whole_model_over_it(checkpoint: Path) -> None:
    """Each stage keeps its own layers' 8-bit keys and values (the engine's kv dtype reaches the workers)."""
    arrivals = _workload(3, 40)
    whole = _tokens(_core(checkpoint, kv_dtype="int8"), arrivals)
    core = _core(checkpoint, kv_dtype="int8", layer_split="2", batch_groups=2)
    try:
        assert _tokens(core, _workload(3, 40)) == whole
    finally:
        core.close()


def test_a_split_with_kv_in_host_ram_gives_the_tokens_of_the_whole_model(
    checkpoint: Path, whole: dict[int, list[list[int]]]
) -> None:
    """`--kv-resident`: every stage keeps three blocks of its layers on the device and streams the rest."""
    core = _core(checkpoint, kv_resident=48, layer_split="2", batch_groups=2)
    try:
        arrivals = _workload(3, 30)
        results, windows = run(core, arrivals)
        assert [results[add.request_id].token_ids for _, add in arrivals] == whole[3]
        assert sum(w.kv_host_reads for w in windows) > 0
    finally:
        core.close()


def test_a_split_whose_pool_runs_short_preempts_and_gives_the_tokens_of_the_model_run_whole(
    checkpoint: Path,
) -> None:
    """A pool of about 70 blocks of 4 on the stage that fits fewest, three requests growing to 120 tokens:
    preempted requests give their blocks back and take others when read again, and every stage gets each
    table again once it changed (not every window: `BlockPool.stamp_of`)."""
    params = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    adds = [request(random_prompt(60, 20 + i), **params) for i in range(3)]
    roomy = make_core(checkpoint)
    expected = [complete(roomy, a.prompt_token_ids, **params).token_ids for a in adds]
    config = roomy.loaded.model.config
    parts = split_layers("2", config.num_hidden_layers)
    memory = max(
        70 * kv_block_bytes(config, 4, torch.float32, p.layers)
        + 16 * slot_state_bytes(config, torch.float32, p.layers)
        for p in parts
    )
    core = make_core(checkpoint, kv_memory=memory, block_size=4, layer_split="2", batch_groups=2)
    sent: list[int] = []
    changed = core.runner._changed_tables
    core.runner._changed_tables = lambda chunks: sent.append(len(t := changed(chunks))) or t  # type: ignore[method-assign]
    try:
        assert core.scheduler.pool.total <= 80
        results, windows = run(core, [(0, a) for a in adds])
    finally:
        core.close()
    assert sum(w.preempted for w in windows) >= 1
    assert [results[a.request_id].token_ids for a in adds] == expected
    assert 0 in sent  # a window whose tables had all been sent before sent none


def _routing_reports_cover_every_stage(core: EngineCore) -> None:
    """The routing reports of a split list every stage's layers, the later stages' with their counts."""
    _, windows = run(core, _workload(3, 7))
    time.sleep(EXPERT_REPORT_S)  # the worker reports on its own period, with its next window
    _, more = run(core, _workload(1, 9))
    reports = [w.experts for w in [*windows, *more] if w.experts is not None]
    moe = [i for i, m in enumerate(core.loaded.model.config.moe_layers) if m]
    assert reports[-1].layers == moe  # every stage's layers, in order
    assert core.pipeline is not None
    theirs = core.pipeline.parts[1].layers
    pairs = [pair for r in reports for pair in zip(r.layers, r.routed, strict=True)]
    assert sum(sum(row) for layer, row in pairs if layer in theirs) > 0


def test_a_stage_that_ends_is_an_error_of_the_next_window_not_a_hang(hybrid: Path) -> None:
    core = make_core(hybrid, layer_split="2")
    try:
        assert core.pipeline is not None
        core.pipeline.workers[0].kill()
        with pytest.raises(StrataError, match="stage 1 of the layer split stopped"):
            run(core, [(0, request(random_prompt(20, 1), max_tokens=4))])
    finally:
        core.close()


def test_a_split_with_an_adapting_expert_tier_on_every_stage_gives_the_whole_models_tokens(
    checkpoint: Path, whole: dict[int, list[list[int]]]
) -> None:
    # Two experts a layer resident on each stage, the rest in host RAM, the most routed made resident every
    # two windows: each stage adapts its own layers' tiers on the engine core's schedule.
    core = _core(checkpoint, layer_split="2", batch_groups=2, expert_cache=2, adapt_every=2)
    try:
        assert core.tiers  # stage 0's layers are tiered; stage 1 loads its own the same way
        assert _tokens(core, _workload(8, 80)) == whole[8]
    finally:
        core.close()


def test_groups_and_stage_gpus_without_a_split_or_gpus_are_refused(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--batch-groups pipelines the stages"):
        make_core(checkpoint, batch_groups=2)
    with pytest.raises(StrataError, match="--stage-gpus places the stages of a --layer-split"):
        make_core(checkpoint, stage_gpus=(0, 0))
    with pytest.raises(StrataError, match="this engine runs on the CPU"):
        make_core(checkpoint, layer_split="2", stage_gpus=(0, 0))


@pytest.mark.parametrize(
    ("gpus", "message"),
    [((0,), "names 1 GPUs for 2 stages"), ((1, 0), "stage 0 runs on GPU 0")],
)
def test_stage_gpus_name_a_card_a_stage_and_stage_zero_first(gpus: tuple[int, ...], message: str) -> None:
    assert stage_gpus(EngineConfig(), 3) == (0, 1, 2)
    assert stage_gpus(EngineConfig(stage_gpus=(0, 0, 1)), 3) == (0, 0, 1)
    with pytest.raises(StrataError, match=message):
        stage_gpus(EngineConfig(stage_gpus=gpus), 2)


def test_reports_join_by_layer_and_keep_a_quiet_stages_layers() -> None:
    zero = ExpertUsage(layers=[0], routed=[[2, 0]], location=[[0, 0]], seconds=0.5, swaps=1)
    one = ExpertUsage(layers=[1], routed=[[0, 3]], location=[[0, 1]], seconds=0.4, swaps=2)
    known: dict[int, list[int]] = {}
    both = joined(zero, [one, one], known)
    assert both.layers == [0, 1] and both.routed == [[2, 0], [0, 6]] and both.swaps == 5
    assert both.seconds == 0.5 and known == {1: [0, 1]}
    quiet = joined(zero, [], known)  # stage 1 sent nothing since: its layer listed, without counts
    assert quiet.layers == [0, 1] and quiet.routed == [[2, 0], [0, 0]] and quiet.location[1] == [0, 1]


def test_a_stage_started_elsewhere_joins_at_the_engines_address(
    checkpoint: Path, whole: dict[int, list[list[int]]]
) -> None:
    # `strata stage` in its own process, as on another host, joining over TCP on loopback.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    command = [sys.executable, "-m", "app.cli", "stage", "--rendezvous", address, "--stage", "1"]
    stage = subprocess.Popen([*command, "--stages", "2", "--device", "cpu"])
    try:
        core = _core(checkpoint, layer_split="2", split_rendezvous=address, remote_stages=(1,))
        try:
            assert core.pipeline is not None and not core.pipeline.workers  # none started here
            assert _tokens(core, _workload(3, 30)) == whole[3]
        finally:
            core.close()
        assert stage.wait(timeout=30) == 0  # the engine's stop ends it
    finally:
        stage.kill()


def test_remote_stages_need_an_address_and_a_stage_of_the_split(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="give --split-rendezvous"):
        make_core(checkpoint, layer_split="2", remote_stages=(1,))
    with pytest.raises(StrataError, match="the stages after the first are 1 to 1"):
        make_core(checkpoint, layer_split="2", split_rendezvous="tcp://127.0.0.1:1", remote_stages=(2,))


def test_four_stages_with_four_groups_give_the_whole_models_tokens(tmp_path: Path) -> None:
    # Four stages of one layer each (the four-GPU split's shape), one slot group per stage.
    path = write_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=4, max_position_embeddings=4096)
    whole = _tokens(_core(path), _workload(8, 40))
    core = _core(path, layer_split="4", batch_groups=4)
    try:
        assert _tokens(core, _workload(8, 40)) == whole
    finally:
        core.close()


def test_a_follow_up_restored_from_every_stages_park_continues_as_the_whole_model(checkpoint: Path) -> None:
    """Every stage parks its own layers' part of a finished turn in RAM; once the device cache has given the
    turn's blocks to another request, the follow-up is restored on every stage and answers as the model run
    whole. A conversation stage 0's budget lets go of is let go of on every stage."""
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    first = random_prompt(600, 1)
    whole = make_core(checkpoint, park_memory=0)
    answer = complete(whole, first, **greedy).token_ids
    follow_up = [*first, *answer, *random_prompt(20, 2)]
    expected = complete(whole, follow_up, **greedy).token_ids
    whole.close()
    core = make_core(checkpoint, layer_split="2", batch_groups=2, kv_memory=1 << 20, park_memory=64 << 20)
    try:
        assert core.park is not None and core.pipeline is not None
        blocks = core.scheduler.pool.total
        assert complete(core, first, **greedy).token_ids == answer
        complete(core, random_prompt(min(16 * blocks - 64, 4000), 3), max_tokens=2, ignore_eos=True)
        assert len(core.scheduler.pool.match(follow_up, len(first))) < len(first) // 16
        add = request(follow_up, **greedy)
        results, windows = run(core, [(0, add)])
        assert core.park.stats().restores == 1
        assert sum(w.prefix_cache_hits for w in windows) == len(first) + len(answer) - 1
        assert results[add.request_id].token_ids == expected
        core.park.ram_budget = 0  # the next park lets go of every conversation, on every stage
        complete(core, random_prompt(40, 4), max_tokens=2, ignore_eos=True)
        assert core.park.stats().conversations_ram == 0
    finally:
        core.close()


def _split_park(checkpoint: Path, directory: Path) -> EngineCore:
    """A 2-stage split whose stages park in their own folders of `directory` only (no RAM)."""
    disk = {"park_memory": 0, "park_dir": str(directory), "park_disk": 64 << 20}
    return make_core(checkpoint, layer_split="2", batch_groups=2, **disk)


def _parked_turn(checkpoint: Path, directory: Path) -> tuple[list[int], list[int]]:
    """A turn parked on disk by every stage of a split that then stops; the follow-up prompt, and what the
    model run whole answers it."""
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    first = random_prompt(600, 1)
    core = _split_park(checkpoint, directory)
    answer = complete(core, first, **greedy).token_ids
    core.close()
    follow_up = [*first, *answer, *random_prompt(20, 2)]
    whole = make_core(checkpoint)
    expected = complete(whole, follow_up, **greedy).token_ids
    whole.close()
    return follow_up, expected


def test_every_stage_reads_its_own_file_of_a_follow_up_after_a_restart(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Every stage writes its part of a parked turn to its own folder (the last changes made as the split
    stops); after a restart stage 0 finds the conversation where every stage has it, and each stage restores
    its part from its own file."""
    parked = tmp_path / "parked"
    follow_up, expected = _parked_turn(checkpoint, parked)
    files = {folder.name: len(list(folder.glob("*.park"))) for folder in parked.iterdir()}
    assert files == {"split-2-stage-0": 1, "split-2-stage-1": 1}
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in (parked, *parked.iterdir()))  # users' words
    core = _split_park(checkpoint, parked)
    try:
        assert core.park is not None and core.park.stats().conversations_disk == 1
        add = request(follow_up, max_tokens=10, temperature=0, ignore_eos=True)
        results, _ = run(core, [(0, add)])
        assert core.park.stats().restores == 1
        assert results[add.request_id].token_ids == expected
    finally:
        core.close()


def test_a_bad_file_of_another_stage_discards_the_conversation_on_every_stage(
    hybrid: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stage 0 checks every stage's file before it plans a restore: one stage's bad file means the follow-up
    reads its prompt, and every stage's file of it is deleted."""
    follow_up, expected = _parked_turn(hybrid, tmp_path)
    (bad,) = (tmp_path / "split-2-stage-1").glob("*.park")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    core = _split_park(hybrid, tmp_path)
    try:
        add = request(follow_up, max_tokens=10, temperature=0, ignore_eos=True)
        with caplog.at_level("WARNING", logger="strata.parking"):
            results, _ = run(core, [(0, add)])
        assert "stage 1's part: checksum mismatch" in caplog.text
        assert core.park is not None and core.park.stats().restores == 0
        assert results[add.request_id].token_ids == expected
    finally:
        core.close()
    assert not list((tmp_path / "split-2-stage-0").glob(f"{bad.name}"))
    assert not bad.exists()


def test_another_stages_file_whose_other_part_was_lost_is_deleted_at_start(
    hybrid: Path, tmp_path: Path
) -> None:
    follow_up, expected = _parked_turn(hybrid, tmp_path)
    (own,) = (tmp_path / "split-2-stage-0").glob("*.park")
    own.unlink()
    core = _split_park(hybrid, tmp_path)
    try:
        assert core.park is not None and core.park.stats().conversations_disk == 0
        assert not list((tmp_path / "split-2-stage-1").glob("*.park"))
        add = request(follow_up, max_tokens=10, temperature=0, ignore_eos=True)
        results, _ = run(core, [(0, add)])
        assert results[add.request_id].token_ids == expected
    finally:
        core.close()
