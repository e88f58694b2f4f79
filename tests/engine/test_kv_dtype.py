"""The engine with keys and values in 8 bits (`--kv-dtype int8|fp8`): batching, parking and the prefix cache
stay exact over them, the pool holds about twice bf16's blocks (four times fp32's, less the scales), and
their greedy tokens follow the full-precision cache's; and the context settings' errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_parked_follow_up_continues, complete, make_core, random_prompt, request, run

from app.engine.paged_state import kv_block_bytes, slot_state_bytes
from app.errors import StrataError

GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_eight_conversations_over_8_bit_kv_together_equal_each_alone(checkpoint: Path, kv: str) -> None:
    core = make_core(checkpoint, kv_dtype=kv, parallel=8, max_batched_tokens=96, decode_share=0.01)
    arrivals = [(i, request(random_prompt(15 + 23 * i, i), **GREEDY)) for i in range(8)]
    together, windows = run(core, arrivals)
    assert max(len(w.slots) for w in windows) >= 6
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(core, add.prompt_token_ids, **GREEDY).token_ids


def test_8_bit_kv_follows_the_full_precision_caches_greedy_tokens(checkpoint: Path) -> None:
    """Agreement of 6 prompts x 24 greedy tokens with the fp32 cache's on a random tiny model (whose logits
    are close: a broken scale would agree almost nowhere); measured 0.89-0.97 for int8, 0.65-0.77 for e4m3."""
    full = make_core(checkpoint)
    prompts = [random_prompt(40 + 50 * i, i) for i in range(6)]
    expected = [complete(full, p, **GREEDY).token_ids for p in prompts]
    for kv, least in (("int8", 0.85), ("fp8", 0.6)):
        core = make_core(checkpoint, kv_dtype=kv)
        got = [complete(core, p, **GREEDY).token_ids for p in prompts]
        same = sum(
            a == b for want, have in zip(expected, got, strict=True) for a, b in zip(want, have, strict=True)
        )
        assert same / (6 * GREEDY["max_tokens"]) >= least, kv


def test_a_parked_follow_up_over_int8_kv_continues_as_if_it_never_left(checkpoint: Path) -> None:
    assert_parked_follow_up_continues(checkpoint, torch.int8, kv_dtype="int8")


def test_an_8_bit_pool_holds_the_blocks_its_bytes_allow_in_the_same_memory(checkpoint: Path) -> None:
    config = make_core(checkpoint).loaded.model.config
    wide, narrow = kv_block_bytes(config, 16, torch.float32), kv_block_bytes(config, 16, torch.float8_e4m3fn)
    assert narrow * 4 * config.head_dim == wide * (config.head_dim + 16)
    memory = 40 * wide + 16 * slot_state_bytes(config, torch.float32)
    blocks = {
        kv: make_core(checkpoint, kv_dtype=kv, kv_memory=memory).runner.state.blocks
        for kv in ("auto", "int8")
    }
    assert 30 <= blocks["auto"] <= 40
    assert blocks["int8"] >= blocks["auto"] * wide // narrow - 1


def test_a_bf16_cache_beside_fp32_activations_is_a_one_line_error(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--kv-dtype bf16 needs bf16 activations"):
        make_core(checkpoint, kv_dtype="bf16")


def test_a_context_beyond_the_models_positions_is_a_one_line_error(checkpoint: Path) -> None:
    with pytest.raises(StrataError, match="--max-model-len 4097 is beyond this model's 4096 positions"):
        make_core(checkpoint, max_model_len=4097)
