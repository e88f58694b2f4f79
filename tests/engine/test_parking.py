"""Parked conversations: a follow-up restored from host RAM or from disk (after a restart) continues exactly
as one that never left; bad park files are refused."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.engine.core import EngineCore
from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.engine.parking import ConversationPark, Forgotten, Kept

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


def _conversation(core: EngineCore) -> tuple[list[int], list[int]]:
    """A first turn run to its end on `core`, and the follow-up prompt that continues it."""
    first = random_prompt(600, 1)  # long enough that a restore beats what the device cache keeps
    answer = complete(core, first, **GREEDY).token_ids
    return first + answer, [*first, *answer, *random_prompt(20, 2)]


def _follow(core: EngineCore, follow_up: list[int]) -> tuple[list[int], int]:
    """The follow-up's tokens and how many of its prompt tokens came from a cache or the park."""
    add = request(follow_up, **GREEDY)
    results, windows = run(core, [(0, add)])
    return results[add.request_id].token_ids, sum(w.prefix_cache_hits for w in windows)


def _expected(checkpoint: Path, follow_up: list[int]) -> list[int]:
    """The follow-up read from its start (no cache, no park)."""
    return complete(make_core(checkpoint, prefix_cache=False), follow_up, **GREEDY).token_ids


def test_a_follow_up_restored_from_ram_continues_as_if_it_never_left(checkpoint: Path) -> None:
    config = make_core(checkpoint).loaded.model.config
    memory = 80 * kv_block_bytes(config, 16, torch.float32) + 16 * slot_state_bytes(config, torch.float32)
    core = make_core(checkpoint, kv_memory=memory, park_memory=64 << 20)
    stayed = make_core(checkpoint, park_memory=0)
    turn, follow_up = _conversation(core)
    assert _conversation(stayed)[0] == turn
    # An unrelated long request needs almost every block: the first turn's cached blocks are reused.
    complete(core, random_prompt(1200, 3), max_tokens=5, temperature=0, ignore_eos=True)
    assert len(core.scheduler.pool.match(follow_up, len(turn))) < len(turn) // 16
    tokens, hits = _follow(core, follow_up)
    assert core.park is not None and core.park.stats().restores == 1
    assert hits == len(turn) - 1  # the turn's last generated token was never fed
    assert tokens == _follow(stayed, follow_up)[0]
    assert tokens == _expected(checkpoint, follow_up)


def test_a_follow_up_restored_from_disk_after_a_restart(checkpoint: Path, tmp_path: Path) -> None:
    first = make_core(checkpoint, park_memory=0, park_dir=str(tmp_path), park_disk=64 << 20)
    turn, follow_up = _conversation(first)
    assert first.park is not None
    first.park.flush()
    assert len(list(tmp_path.glob("*.park"))) == 1
    restarted = make_core(checkpoint, park_memory=64 << 20, park_dir=str(tmp_path), park_disk=64 << 20)
    assert restarted.park is not None and restarted.park.stats().conversations_disk == 1
    before = restarted.park.stats().copied_bytes
    tokens, hits = _follow(restarted, follow_up)
    assert restarted.park.stats().restores == 1 and hits == len(turn) - 1
    assert tokens == _expected(checkpoint, follow_up)
    stayed = make_core(checkpoint)
    assert _conversation(stayed)[0] == turn
    assert tokens == _follow(stayed, follow_up)[0]
    # The follow-up, parked in its turn, copied only the blocks the first turn had not filled (and its state).
    config = restarted.loaded.model.config
    block, state = kv_block_bytes(config, 16, torch.float32), slot_state_bytes(config, torch.float32)
    held = len(follow_up) + GREEDY["max_tokens"] - 1
    new_blocks = held // 16 - (len(turn) - 1) // 16
    assert restarted.park.stats().copied_bytes - before <= new_blocks * block + block + state
    assert restarted.park.stats().conversations_ram == 2


def _park_one(checkpoint: Path, directory: Path) -> tuple[list[int], Path]:
    core = make_core(checkpoint, park_memory=0, park_dir=str(directory), park_disk=64 << 20)
    _, follow_up = _conversation(core)
    assert core.park is not None
    core.park.flush()
    (path,) = directory.glob("*.park")
    return follow_up, path


def test_park_files_are_owner_only_and_stray_partial_files_are_cleared(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Parked conversations hold users' words: the directory and files are the owner's alone; a file a run
    left half-written (under its temporary name) is removed at the next start, never read."""
    directory = tmp_path / "park"
    _, path = _park_one(checkpoint, directory)
    assert path.stat().st_mode & 0o777 == 0o600 and directory.stat().st_mode & 0o777 == 0o700
    stray = directory / ("0" * 32 + ".partial")
    stray.write_bytes(b"STRATA-PARKED-1\nhalf")
    core = make_core(checkpoint, park_memory=0, park_dir=str(directory), park_disk=64 << 20)
    assert not stray.exists() and core.park is not None and core.park.stats().conversations_disk == 1


def test_a_full_disk_fails_the_park_not_the_request(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Writing a park file that fails (the disk is full) leaves no file, says so once, and the follow-up is
    answered as if nothing had been parked."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("app.engine.park_file.os.fsync", full)
    core = make_core(checkpoint, park_memory=0, park_dir=str(tmp_path), park_disk=64 << 20)
    with caplog.at_level(logging.WARNING, logger="strata.parking"):
        _, follow_up = _conversation(core)
        assert core.park is not None
        core.park.flush()
    assert "No space left on device" in caplog.text and not list(tmp_path.iterdir())
    assert _follow(core, follow_up)[0] == _expected(checkpoint, follow_up)


def test_a_corrupt_park_file_is_discarded_with_a_log_line(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    follow_up, path = _park_one(checkpoint, tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one byte of the saved state
    path.write_bytes(bytes(data))
    core = make_core(checkpoint, park_memory=64 << 20, park_dir=str(tmp_path), park_disk=64 << 20)
    with caplog.at_level(logging.WARNING, logger="strata.parking"):
        tokens, hits = _follow(core, follow_up)
    assert hits == 0 and core.park is not None and core.park.stats().restores == 0
    assert "checksum mismatch" in caplog.text and not path.exists()
    assert tokens == _expected(checkpoint, follow_up)


def test_park_files_of_another_model_or_block_size_are_not_loaded(
    checkpoint: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    follow_up, path = _park_one(checkpoint, tmp_path)
    arch = "qwen3_next" if "qwen3_next" in str(checkpoint) else "qwen3_moe"
    other = write_checkpoint(tmp_path_factory.mktemp("other"), arch, seed=7, max_position_embeddings=4096)
    core = make_core(other, park_memory=64 << 20, park_dir=str(tmp_path), park_disk=64 << 20)
    assert core.park is not None and core.park.stats().conversations_disk == 0
    _, hits = _follow(core, follow_up)
    assert hits == 0 and path.exists()  # another model's file is left alone
    smaller_blocks = make_core(
        checkpoint, block_size=8, park_memory=64 << 20, park_dir=str(tmp_path), park_disk=64 << 20
    )
    with caplog.at_level(logging.WARNING, logger="strata.parking"):
        tokens, hits = _follow(smaller_blocks, follow_up)
    assert hits == 0 and "block size 16, not 8" in caplog.text and not path.exists()
    assert tokens == _expected(checkpoint, follow_up)


def test_an_unusable_park_directory_leaves_parking_in_ram(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="strata.parking"):
        core = make_core(
            checkpoint, park_memory=64 << 20, park_dir=str(blocked / "parked"), park_disk=1 << 20
        )
    assert "not parking conversations on disk" in caplog.text
    _conversation(core)
    assert core.park is not None and core.park.stats().conversations_ram == 1
    assert core.park.stats().conversations_disk == 0


def test_an_aborted_turn_is_parked_too(checkpoint: Path, tmp_path: Path) -> None:
    """A user who stops an answer can follow up on what was said so far (here after a restart)."""
    options = {"park_memory": 64 << 20, "park_dir": str(tmp_path), "park_disk": 64 << 20}
    core = make_core(checkpoint, **options)
    add = request(random_prompt(600, 1), max_tokens=50, temperature=0, ignore_eos=True)
    results, _ = run(core, [(0, add)], aborts={6: [add.request_id]})
    partial = results[add.request_id].token_ids
    assert results[add.request_id].finish_reason == "abort" and 0 < len(partial) < 50
    assert core.park is not None and core.park.stats().conversations_ram == 1
    core.close()
    follow_up = [*add.prompt_token_ids, *partial, *random_prompt(20, 2)]
    tokens, hits = _follow(make_core(checkpoint, **options), follow_up)
    assert hits >= len(add.prompt_token_ids) and tokens == _expected(checkpoint, follow_up)


def test_ram_and_disk_budgets_hold_and_their_byte_counts_add_up(checkpoint: Path, tmp_path: Path) -> None:
    core = make_core(checkpoint, park_memory=1, park_dir=str(tmp_path), park_disk=64 << 20)
    for seed in range(3):
        complete(core, random_prompt(100, seed), max_tokens=4, temperature=0, ignore_eos=True)
    assert core.park is not None
    core.park.flush()
    stats = core.park.stats()
    assert stats.conversations_ram == 0 and stats.bytes_ram == 0  # a 1-byte budget keeps none in RAM
    files = list(tmp_path.glob("*.park"))
    assert stats.conversations_disk == len(files) == 3
    payload = stats.bytes_disk
    assert 0 < payload <= sum(f.stat().st_size for f in files)  # counted without the headers
    small = make_core(checkpoint, park_memory=64 << 20, park_dir=str(tmp_path), park_disk=payload // 2)
    assert small.park is not None and small.park.stats().conversations_disk < 3
    assert small.park.stats().bytes_disk <= payload // 2
    assert len(list(tmp_path.glob("*.park"))) == small.park.stats().conversations_disk


def test_the_ram_the_park_holds_is_the_ram_it_counts(checkpoint: Path) -> None:
    # Conversations sharing a first turn, several evicted: no block or tail keeps a larger gather alive.
    config = make_core(checkpoint).loaded.model.config
    budget = 10 * kv_block_bytes(config, 16, torch.float32) + 2 * slot_state_bytes(config, torch.float32)
    core = make_core(checkpoint, park_memory=budget)
    shared = random_prompt(40, 9)
    for seed in range(6):
        complete(
            core, shared + random_prompt(30 + 7 * seed, seed), max_tokens=3, temperature=0, ignore_eos=True
        )
    assert core.park is not None
    stats = core.park.stats()
    assert 1 <= stats.conversations_ram < 6 and stats.bytes_ram <= budget
    assert core.park.held_bytes() == stats.bytes_ram


def test_a_parked_file_is_read_off_the_engine_thread_while_the_request_waits(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follow-up of a conversation parked on disk waits in the queue while the park's reader thread reads
    and checks the file; `schedule()` never reads one, and a slot already decoding gets a token meanwhile.
    With no RAM for parking, the file read for the follow-up stays until it is restored."""
    first = make_core(checkpoint, park_memory=0, park_dir=str(tmp_path), park_disk=64 << 20)
    _, follow_up = _conversation(first)
    assert first.park is not None
    first.park.flush()
    readers: list[str] = []
    read = ConversationPark._read

    def slow_read(self: ConversationPark, path: Path, key: tuple[int, ...]) -> object:
        readers.append(threading.current_thread().name)
        time.sleep(0.3)
        return read(self, path, key)

    monkeypatch.setattr(ConversationPark, "_read", slow_read)
    restarted = make_core(checkpoint, park_memory=0, park_dir=str(tmp_path), park_disk=64 << 20)
    busy = request(random_prompt(8, 5), max_tokens=200, temperature=0, ignore_eos=True)
    add = request(follow_up, **GREEDY)
    results, windows = run(restarted, [(0, busy), (1, add)])
    assert restarted.park is not None and restarted.park.stats().restores == 1
    assert readers and all(name.startswith("strata-park-reader") for name in readers)
    waited = [w for w in windows if w.waiting and not w.prompt_tokens and w.slots]
    assert waited and all(w.decode_tokens == 1 for w in waited)  # the busy slot ran while the file was read
    assert results[add.request_id].token_ids == _expected(checkpoint, follow_up)


@pytest.mark.parametrize("adapt_every", [1000, 0], ids=["adapting", "frozen"])
def test_a_resumed_conversation_brings_back_the_experts_it_routed_to(
    checkpoint: Path, adapt_every: int
) -> None:
    """With an expert tier (2 experts a layer on the device) that adapts, a follow-up restored from the park
    first makes the experts its conversation routed to most resident again; a frozen tier stays as it is.
    Either way the follow-up continues as if it never left."""
    config = make_core(checkpoint).loaded.model.config
    memory = 80 * kv_block_bytes(config, 16, torch.float32) + 16 * slot_state_bytes(config, torch.float32)
    tier = {"expert_cache": 2, "adapt_every": adapt_every}
    core = make_core(checkpoint, kv_memory=memory, park_memory=64 << 20, **tier)
    _, follow_up = _conversation(core)
    complete(core, random_prompt(1200, 3), max_tokens=5, temperature=0, ignore_eos=True)
    before = [[e for e, slot in enumerate(t.slots) if slot >= 0] for t in core.tiers]
    wanted: list[list[int]] = []
    bring_back = core._bring_back

    def watched(routed: object) -> None:
        bring_back(routed)
        wanted.extend(hot[:2] for hot in routed.hot())  # type: ignore[attr-defined]
        after = [[e for e, slot in enumerate(t.slots) if slot >= 0] for t in core.tiers]
        assert [set(a) for a in after] == [set(hot) for hot in wanted]

    core._bring_back = watched  # type: ignore[method-assign]
    swaps = core.expert_swaps
    add = request(follow_up, **GREEDY)
    results, windows = run(core, [(0, add)])
    swaps += sum(w.experts.swaps for w in windows if w.experts is not None) + core.expert_swaps
    assert core.park is not None and core.park.stats().restores == 1
    if adapt_every:
        assert len(wanted) == len(core.tiers) and all(len(hot) == 2 for hot in wanted)
        assert (swaps > 0) == ([set(h) for h in wanted] != [set(b) for b in before])
    else:  # nothing moves on a frozen tier
        assert not wanted and swaps == 0
        assert [[e for e, slot in enumerate(t.slots) if slot >= 0] for t in core.tiers] == before
    assert results[add.request_id].token_ids == _expected(checkpoint, follow_up)


def test_stage_zeros_changes_reach_a_follower_which_never_evicts_and_refuses_what_it_lacks(
    checkpoint: Path,
) -> None:
    """The changes a layer split's stage 0 sends down (`mirror`): a parked turn, then, once its budget lets
    go of it, its forgetting; a follower makes both (never evicting by itself, whatever its budget) and
    fails a restore of a conversation it does not hold before writing anything."""
    core = make_core(checkpoint, park_memory=64 << 20)
    leader = core.park
    assert leader is not None
    leader.mirror = []
    follower = ConversationPark(core.runner.state, "", 1, follower=True)
    turn, _ = _conversation(core)
    changes = leader.take_mirror()
    assert [type(c) for c in changes] == [Kept] and changes[0].tokens == turn[:-1]
    for change in changes:
        follower.apply(change)
    assert follower.stats().conversations_ram == 1 and follower.stats().bytes_ram > 1
    leader.ram_budget = 0
    complete(core, random_prompt(40, 4), max_tokens=2, temperature=0, ignore_eos=True)
    changes = leader.take_mirror()
    assert [type(c) for c in changes] == [Kept, Forgotten, Forgotten]
    for change in changes:
        follower.apply(change)
    assert follower.stats().conversations_ram == 0 and follower.stats().bytes_ram == 0
    before = core.runner.state.keys.clone()
    with pytest.raises(RuntimeError, match="no part of the parked conversation"):
        follower.restore_key(changes[1].key, [], 0, [0, 1])
    assert torch.equal(core.runner.state.keys, before)
