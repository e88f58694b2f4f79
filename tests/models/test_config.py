"""config.json parsing: every field-name generation and layer-selection rule real checkpoints use."""

from __future__ import annotations

import pytest

from app.models.config import ConfigError, ModelConfig

BASE = {"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 8}


def test_qwen3_next_defaults_follow_transformers() -> None:
    config = ModelConfig.from_dict(BASE)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert config.rope.partial_rotary_factor == 0.25 and config.rotary_dim == 64
    assert config.norm_topk_prob and config.gated_attention and config.offset_norm


def test_full_attention_interval_and_layer_types() -> None:
    assert (
        ModelConfig.from_dict({**BASE, "full_attention_interval": 2}).layer_types
        == (
            "linear_attention",
            "full_attention",
        )
        * 4
    )
    with pytest.raises(ConfigError, match="layer_types must list 8"):
        ModelConfig.from_dict({**BASE, "layer_types": ["full_attention"]})


def test_moe_layers_follow_sparse_step_and_mlp_only_layers() -> None:
    config = ModelConfig.from_dict({**BASE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.moe_layers == (False, True, False, False, False, True, False, True)


def test_rope_fields_old_and_new() -> None:
    old = ModelConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen3_moe",
            "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        }
    )
    new = ModelConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen3_moe",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        }
    )
    assert old.rope == new.rope
    assert old.rope.rope_type == "yarn" and old.rope.theta == 1e6 and old.rope.partial_rotary_factor == 1.0


def test_unsupported_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_dict({**BASE, "model_type": "qwen3_moe", "use_sliding_window": True})
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelConfig.from_dict({**BASE, "model_type": "mixtral"})
