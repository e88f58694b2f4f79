"""Our models against HF transformers on tiny random checkpoints: prefill logits and greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, write_checkpoint
from contiguous_state import ContiguousState
from engine_helpers import complete, make_core

from app.loading.loader import load_model
from app.models.batch import ForwardBatch

VARIANTS = {
    "qwen3_moe": [
        ("base", {}, None),
        ("sparse-step-2", {"decoder_sparse_step": 2}, None),
        ("mlp-only-layers", {"mlp_only_layers": [0, 2]}, None),
        ("norm-topk", {"norm_topk_prob": True}, None),
        ("tied", {"tie_word_embeddings": True}, None),
        ("head-dim", {"head_dim": 24, "num_key_value_heads": 1}, None),
        (
            "yarn",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 128,
                }
            },
            None,
        ),
        ("linear-rope", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}, None),
        ("sharded", {}, "60KB"),
    ],
    "qwen3_next": [
        ("base", {}, None),
        ("sparse-step-2", {"decoder_sparse_step": 2}, None),
        ("mlp-only-layers", {"mlp_only_layers": [1, 3]}, None),
        ("no-norm-topk", {"norm_topk_prob": False}, None),
        ("tied", {"tie_word_embeddings": True}, None),
        (
            "partial-half",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
            None,
        ),
        ("head-dim", {"head_dim": 24}, None),
        (
            "yarn-partial",  # the long-context form of Qwen3-Next's configs (a quarter rotary, yarn x4)
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e7,
                    "partial_rotary_factor": 0.25,
                    "original_max_position_embeddings": 128,
                }
            },
            None,
        ),
        ("layer-types", {"layer_types": ["linear_attention", "full_attention"] * 2}, None),
        ("gdn-heads-equal", {"linear_num_value_heads": 2, "linear_key_head_dim": 8}, None),
        ("sharded", {}, "60KB"),
    ],
}

CASES = [(arch, name, overrides, shard) for arch, rows in VARIANTS.items() for name, overrides, shard in rows]


def _ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed))


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize(("arch", "name", "overrides", "shard"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_prefill_logits_and_greedy_tokens_match_transformers(
    tmp_path: Path, arch: str, name: str, overrides: dict, shard: str | None
) -> None:
    write_checkpoint(tmp_path, arch, shard_size=shard, **overrides)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    reference = hf_model(arch, **overrides)
    ours, _ = load_model(tmp_path, dtype="float32", progress=False)

    ids = _ids(150)  # crosses the 64-token chunk boundary of the Gated DeltaNet prompt form
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = ours.logits(ours(ForwardBatch.build([(0, ids.tolist(), 0)], ContiguousState())))
    assert _relative_error(got, expected) < 1e-4

    prompt = _ids(20, seed=2)
    with torch.no_grad():
        hf_tokens = reference.generate(
            prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 20:].tolist()
    our_tokens = complete(
        make_core(tmp_path), prompt.tolist(), max_tokens=32, temperature=0, ignore_eos=True
    ).token_ids
    assert our_tokens == hf_tokens


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_older_config_field_names_give_the_same_model(tmp_path: Path, arch: str) -> None:
    """Real checkpoints carry rope_theta / rope_scaling / partial_rotary_factor / full_attention_interval /
    num_experts at the top level instead of the newer rope_parameters / layer_types / num_local_experts."""
    rope = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "original_max_position_embeddings": 256}
    if arch == "qwen3_next":
        rope["partial_rotary_factor"] = 0.25
    write_checkpoint(tmp_path, arch, rope_parameters=dict(rope))
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    if arch == "qwen3_next":
        config["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        assert config.pop("layer_types") == ["linear_attention"] * 3 + ["full_attention"]
        config["full_attention_interval"] = 4
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts"))
    config_path.write_text(json.dumps(config))

    reference = hf_model(arch, rope_parameters=dict(rope))
    ours, _ = load_model(tmp_path, dtype="float32", progress=False)
    ids = _ids(80)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = ours.logits(ours(ForwardBatch.build([(0, ids.tolist(), 0)], ContiguousState())))
    assert _relative_error(got, expected) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_bfloat16_drifts_no_more_than_transformers_in_bfloat16(tmp_path: Path, arch: str) -> None:
    write_checkpoint(tmp_path, arch)
    reference = hf_model(arch)
    ids = _ids(100)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        reference_bf16 = reference.to(torch.bfloat16)(ids[None]).logits[0].float()
    ours, _ = load_model(tmp_path, dtype="bfloat16", progress=False)
    got = ours.logits(ours(ForwardBatch.build([(0, ids.tolist(), 0)], ContiguousState())))

    def mean_error(x: torch.Tensor) -> float:
        return float((x - expected).abs().mean() / expected.abs().mean())

    assert mean_error(got) < 1.5 * mean_error(reference_bf16)
