"""Tiny random checkpoints written by HF transformers' `save_pretrained`: the real on-disk layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

from app.text.tiny import write_tiny_tokenizer

VOCAB = 512

BASE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    ),
    "qwen3_next": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
    ),
}

CLASSES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}


def hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random HF model of the architecture, with norms and gates perturbed so that no weight is trivial."""
    config_cls, model_cls = CLASSES[arch]
    config = config_cls(**{**BASE[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def write_checkpoint(
    path: Path,
    arch: str,
    seed: int = 0,
    shard_size: str | None = None,
    mtp_layers: int = 0,
    **overrides: Any,
) -> Path:
    """Save a tiny random model with `save_pretrained` (sharded when `shard_size` is given) plus a tokenizer.

    With `mtp_layers`, random `mtp.*` tensors in Qwen3-Next's checkpoint layout are added as an extra shard.
    """
    model = hf_model(arch, seed, **overrides)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_tiny_tokenizer(path, vocab_size=VOCAB)
    if mtp_layers:
        add_mtp_shard(path, model.config, mtp_layers, seed)
    return path


def add_mtp_shard(path: Path, config: Qwen3NextConfig, layers: int, seed: int) -> None:
    """Write `mtp.*` tensors (fc, norms, full-attention MoE layers, one tensor per expert) as a shard."""
    torch.manual_seed(seed + 1)
    hidden = config.hidden_size
    tensors = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.05,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden) * 0.1,
        "mtp.norm.weight": torch.randn(hidden) * 0.1,
    }
    attention_layer = config.layer_types.index("full_attention")
    for i in range(layers):
        layer = Qwen3NextDecoderLayer(config, attention_layer)
        for name, value in per_expert_layout(layer.state_dict()).items():
            tensors[f"mtp.layers.{i}.{name}"] = torch.randn_like(value) * 0.05
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model-mtp.safetensors"))
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        single = path / "model.safetensors"
        single.rename(path / "model-main.safetensors")
        with safe_open(str(path / "model-main.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model-main.safetensors")}
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    index_path.write_text(json.dumps(index, indent=2))


def per_expert_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split HF's in-memory fused expert tensors into the per-expert names checkpoints use."""
    out = {}
    for name, value in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


# A ChatML template that renders tools, the calls an assistant made and the tools' answers, and opens a think
# block with `enable_thinking` (the shape of Qwen3's templates, written for the tests).
TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- 'Tools you may call, one <tool_call> block each:' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) }}
{{- '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking %}{{ '<think>\\n' }}{% endif %}
{%- endif %}
"""


def use_tools_template(path: Path) -> Path:
    """Give the checkpoint at `path` TOOLS_TEMPLATE as its chat template."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


# The structured-output tests' JSON schema: short strings, bounded numbers, a small array, no other keys.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def write_wide_checkpoint(path: Path) -> Path:
    """A one-layer qwen3_moe whose matrices' rows are whole Q4_K super-blocks (256 values)."""
    return write_checkpoint(
        path, "qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64, num_hidden_layers=1
    )
