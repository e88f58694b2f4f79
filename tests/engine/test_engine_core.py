"""The engine core in-process on tiny fp32 models: batch = solo, windows, sampling, limits, prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import Completion, complete, make_core, random_prompt, request, run

from app.engine.core import EngineCore
from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.engine.warm_up import warm_up_kernels
from app.models.qwen3 import ModelPart
from app.text.tokenizer import Tokenizer


def _solo(core: EngineCore, prompt: list[int], **params: object) -> Completion:
    return complete(core, prompt, **params)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 11},
        {"temperature": 1.2, "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5, "seed": 3},
    ],
    ids=["greedy", "seeded", "seeded-penalties"],
)
def test_eight_conversations_together_equal_each_alone(checkpoint: Path, params: dict) -> None:
    # A small decode share reads prompts beside decoding slots at once, whatever windows cost on this machine,
    # so that all eight overlap.
    core = make_core(checkpoint, parallel=8, max_batched_tokens=96, decode_share=0.01)
    arrivals = [
        (i, request(random_prompt(15 + 23 * i, i), max_tokens=30, ignore_eos=True, **params))
        for i in range(8)
    ]
    together, windows = run(core, arrivals)
    assert max(len(w.slots) for w in windows) >= 6  # they really shared windows
    for _, add in arrivals:
        alone = _solo(core, add.prompt_token_ids, max_tokens=30, ignore_eos=True, **params)
        assert together[add.request_id].token_ids == alone.token_ids
        assert together[add.request_id].text == alone.text


def test_a_decoding_request_gets_a_token_in_every_window_while_a_long_prompt_is_read(
    checkpoint: Path,
) -> None:
    core = make_core(checkpoint, max_batched_tokens=256)
    # the decoding request outlives the read: the read keeps to the share, so it spans hundreds of windows
    early = request(random_prompt(10, 1), max_tokens=600, temperature=0, ignore_eos=True)
    long = request(random_prompt(2000, 2), max_tokens=4, temperature=0, ignore_eos=True)
    _, windows = run(core, [(0, early), (1, long)])
    reading = [
        w for w in windows if any(s.request_id == long.request_id and s.phase == "prompt" for s in w.slots)
    ]
    assert len(reading) >= 7  # the prompt took many windows
    for w in reading:
        early_slot = next(s for s in w.slots if s.request_id == early.request_id)
        assert early_slot.phase == "decode" and early_slot.window_tokens == 1 and w.decode_tokens == 1


def test_four_prompts_arriving_together_share_windows(checkpoint: Path) -> None:
    core = make_core(checkpoint, max_batched_tokens=512)
    adds = [request(random_prompt(300, i), max_tokens=3, temperature=0) for i in range(4)]
    _, windows = run(core, [(0, a) for a in adds])
    shared = [w for w in windows if sum(s.window_tokens > 1 for s in w.slots) >= 2]
    assert shared, "no window read two prompts"
    assert sum(w.prompt_tokens for w in windows) == 1200


def test_abort_frees_slot_and_blocks_and_the_next_request_is_unaffected(checkpoint: Path) -> None:
    core = make_core(checkpoint, parallel=1)
    victim = request(random_prompt(40, 5), max_tokens=100, temperature=0, ignore_eos=True)
    after = request(random_prompt(25, 6), max_tokens=10, temperature=0, ignore_eos=True)
    results, windows = run(core, [(0, victim), (3, after)], aborts={3: [victim.request_id]})
    assert results[victim.request_id].finish_reason == "abort"
    # windows 0, 1 and 2 ran before the abort; the token of window 2 was still being drawn, never read
    assert len(results[victim.request_id].token_ids) == 2
    assert (
        results[after.request_id].token_ids
        == _solo(core, after.prompt_token_ids, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    )
    assert windows[-1].kv_blocks_used == 0 and not core.has_work()


def test_stop_strings_are_never_leaked(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    prompt = random_prompt(12, 8)
    full = _solo(core, prompt, max_tokens=30, temperature=0, ignore_eos=True)
    stop = full.text[10:13]
    assert stop and stop in full.text
    cut = _solo(core, prompt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = _solo(
        core,
        prompt,
        max_tokens=30,
        temperature=0,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_eos_and_max_tokens(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    prompt = random_prompt(12, 9)
    full = _solo(core, prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    target = full.token_ids[5]
    stopped = _solo(core, prompt, max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[target])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    if 2 in full.token_ids:  # the tiny tokenizer's eos
        at_eos = _solo(core, prompt, max_tokens=16, temperature=0)
        assert at_eos.token_ids == full.token_ids[: full.token_ids.index(2) + 1]


def test_penalties_see_the_prompt_and_the_tokens_generated_so_far(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    sampler = core.runner.sampler
    seen = []

    sample = sampler.sample

    def spy(logits: torch.Tensor, rows: list) -> object:
        seen.extend((list(r.prompt_token_ids), list(r.output_token_ids), r.position) for r in rows)
        return sample(logits, rows)

    sampler.sample = spy  # type: ignore[method-assign]
    prompt = random_prompt(12, 10)
    done = _solo(core, prompt, max_tokens=6, temperature=0, ignore_eos=True, frequency_penalty=1.0)
    assert seen == [(prompt, done.token_ids[:i], 12 + i) for i in range(6)]


def test_logprobs_with_alternatives(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    done = _solo(core, random_prompt(12, 11), max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    assert len(done.logprobs) == 5
    for token, position in zip(done.token_ids, done.logprobs, strict=True):
        assert position.chosen.token_id == token
        assert len(position.top) == 3 and position.top[0].token_id == token  # greedy picks the top one
        assert position.top[0].logprob >= position.top[1].logprob >= position.top[2].logprob
        assert position.chosen.logprob <= 0


def test_text_streams_without_splitting_characters(checkpoint: Path) -> None:
    core = make_core(checkpoint)
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompt = tokenizer.encode("naïve café 日本 🙂")
    done = _solo(core, prompt, max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    assert done.text == tokenizer.decode(done.token_ids)


def test_requests_that_cannot_run_get_a_clear_error(checkpoint: Path) -> None:
    config = make_core(checkpoint).loaded.model.config
    # 8 slots and 8 prefix-cache checkpoints of recurrent state (none on attention-only models), 40 blocks.
    memory = 40 * kv_block_bytes(config, 16, torch.float32) + 16 * slot_state_bytes(config, torch.float32)
    core = make_core(checkpoint, kv_memory=memory, max_model_len=1000)
    too_long = complete(core, random_prompt(990, 1), max_tokens=20)
    assert too_long.finish_reason == "error" and "exceeds the context of 1000 tokens" in too_long.error
    capacity = core.scheduler.capacity_tokens()
    assert capacity == 640
    too_big = complete(core, random_prompt(capacity - 5, 1), max_tokens=10)
    assert too_big.finish_reason == "error" and "exceeds the KV pool" in too_big.error
    empty = complete(core, [], max_tokens=4)
    assert empty.error == "prompt must not be empty"
    bad = complete(core, [1, 2], max_tokens=4, top_p=0)
    assert bad.error == "top_p must be in (0, 1]"
    assert not core.has_work()


def test_pool_exhaustion_preempts_and_recomputes_exactly(checkpoint: Path) -> None:
    roomy = make_core(checkpoint)
    params = {"max_tokens": 60, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    adds = [request(random_prompt(60, 20 + i), **params) for i in range(3)]
    expected = {a.request_id: _solo(roomy, a.prompt_token_ids, **params).token_ids for a in adds}
    config = roomy.loaded.model.config  # 70 blocks of 4: 280 tokens for three requests that grow to 120 each
    memory = 70 * kv_block_bytes(config, 4, torch.float32) + 16 * slot_state_bytes(config, torch.float32)
    tight = make_core(checkpoint, kv_memory=memory, block_size=4)
    assert tight.scheduler.pool.total == 70
    results, windows = run(tight, [(0, a) for a in adds])
    assert sum(w.preempted for w in windows) >= 1
    for add in adds:
        assert results[add.request_id].token_ids == expected[add.request_id]


def test_expert_usage_counts_every_routed_token(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.engine.core.EXPERT_REPORT_S", 0.0)
    core = make_core(checkpoint)
    _, windows = run(
        core, [(0, request(random_prompt(30, 12), max_tokens=5, temperature=0, ignore_eos=True))]
    )
    config = core.loaded.model.config
    reports = [w.experts for w in windows]
    assert all(r is not None for r in reports)
    assert reports[0].layers == [i for i, moe in enumerate(config.moe_layers) if moe]
    for layer in range(len(reports[0].layers)):
        routed = sum(sum(r.routed[layer]) for r in reports)
        assert routed == sum(w.rows for w in windows) * config.num_experts_per_tok
    assert {code for r in reports for row in r.location for code in row} == {1}  # on the CPU: host RAM


def test_the_window_that_leaves_the_engine_idle_reports_every_routed_token_left(checkpoint: Path) -> None:
    """Reports come at most every EXPERT_REPORT_S seconds, and when a burst ends: none of it unreported."""
    core = make_core(checkpoint)
    _, windows = run(
        core, [(0, request(random_prompt(20, 13), max_tokens=4, temperature=0, ignore_eos=True))]
    )
    assert windows[-1].experts is not None
    routed = sum(sum(r.routed[0]) for r in (w.experts for w in windows) if r is not None)
    assert routed == sum(w.rows for w in windows) * core.loaded.model.config.num_experts_per_tok


def test_the_pool_holds_no_more_than_full_slots_can_use(checkpoint: Path) -> None:
    core = make_core(checkpoint, parallel=2, max_model_len=1000, kv_memory=256 << 20)
    assert core.scheduler.pool.total == 2 * 63  # 1000 tokens need 63 blocks of 16


def test_a_follow_up_continues_where_its_conversation_ended(checkpoint: Path) -> None:
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    cached, fresh = make_core(checkpoint), make_core(checkpoint, prefix_cache=False)
    first = random_prompt(150, 1)
    answer = complete(cached, first, **params).token_ids
    follow_up = [*first, *answer, *random_prompt(30, 2)]
    add = request(follow_up, **params)
    results, windows = run(cached, [(0, add)])
    computed_before = len(first) + len(answer) - 1  # the last token generated was never fed
    hits = sum(w.prefix_cache_hits for w in windows)
    if cached.scheduler.checkpoints is None:  # attention only: whole blocks
        assert hits == computed_before // 16 * 16
    else:  # the state where the first turn ended
        assert hits == computed_before
    assert sum(w.prompt_tokens for w in windows) == len(follow_up) - hits
    assert results[add.request_id].token_ids == complete(fresh, follow_up, **params).token_ids


def test_a_shared_system_prompt_is_read_once(checkpoint: Path) -> None:
    """Eight requests share 1,000 tokens: attention-only models read them once but for the last part-block;
    hybrid ones continue from the checkpoint the first request's last prompt piece left at 960 (a chunk
    multiple), so they read them once but for the last 40."""
    system = random_prompt(1000, 3)
    core = make_core(checkpoint, max_batched_tokens=256)
    params = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    adds = [request([*system, *random_prompt(20, 10 + i)], **params) for i in range(8)]
    results, windows = run(core, [(0, adds[0])] + [(8, add) for add in adds[1:]])
    assert all(results[a.request_id].finish_reason == "length" for a in adds)
    queries = sum(w.prefix_cache_queries for w in windows)
    hits = sum(w.prefix_cache_hits for w in windows)
    assert queries == 8 * 1020
    assert hits == 7 * (992 if core.scheduler.checkpoints is None else 960)
    assert sum(w.prompt_tokens for w in windows) == 8 * 1020 - hits
    fresh = make_core(checkpoint, prefix_cache=False)
    for add in adds[1::3]:
        assert results[add.request_id].token_ids == complete(fresh, add.prompt_token_ids, **params).token_ids


def test_no_prefix_cache_reads_everything_and_counts_no_queries(checkpoint: Path) -> None:
    core = make_core(checkpoint, prefix_cache=False)
    prompt = random_prompt(100, 4)
    complete(core, prompt, max_tokens=2, temperature=0)
    _, windows = run(core, [(0, request(prompt, max_tokens=2, temperature=0))])
    assert sum(w.prompt_tokens for w in windows) == 100
    assert sum(w.prefix_cache_queries + w.prefix_cache_hits for w in windows) == 0


def test_a_kernel_warm_up_of_the_model_or_a_stages_part_leaves_conversations_alone(checkpoint: Path) -> None:
    # On a GPU each stage warms its kernels up on the scratch block and slot; here it runs on the CPU.
    core = make_core(checkpoint, parallel=2)
    if not core.runner.paged:
        pytest.skip("the torch reference keeps no paged state")
    prompt = random_prompt(40, 5)
    first = complete(core, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    model, state = core.runner.model, core.runner.state
    layers = model.config.num_hidden_layers
    for part in (None, ModelPart(range(0, 1), True, False), ModelPart(range(1, layers), False, True)):
        warm_up_kernels(model, state, 128, part, torch.float32)
    again = complete(core, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert again.token_ids == first.token_ids  # read again from the cached blocks, which survived


def test_a_kernel_warm_up_leaves_no_count_in_an_expert_tiers_figures(checkpoint: Path) -> None:
    # what /metrics reports as routed entries and bytes copied comes from requests only
    core = make_core(checkpoint, parallel=2, expert_cache=2, adapt_every=0)
    if not core.runner.paged or not core.tiers:
        pytest.skip("needs the paged state and an expert tier")
    for tier in core.tiers:
        tier.take_counts()
    warm_up_kernels(core.runner.model, core.runner.state, 128)
    assert all(tier.take_counts().served == [0, 0, 0] for tier in core.tiers)
