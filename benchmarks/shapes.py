"""Full-size model shapes for benchmarks, as HF `config.json` dicts, and their weight counts.

The shapes are those of the released checkpoints; benchmarks fill them with random weights, so nothing is
downloaded. `shape("q30-half")` gives a fresh dict; `layers=` cuts a shape down (Qwen3-Next keeps its
3 linear-attention : 1 full-attention pattern). `param_counts` counts every weight the way HF transformers'
`Qwen3MoeForCausalLM` / `Qwen3NextForCausalLM` lay them out, per part and per layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

_Q30: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}

_QNEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "rope_theta": 10000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}

SHAPES: dict[str, tuple[dict[str, Any], int | None]] = {
    "q30": (_Q30, None),
    "q30-half": (_Q30, 24),
    "qnext": (_QNEXT, None),
}
"""Shape name -> (base config, layer count override)."""

# What `tiny` changes: every size, nothing about the architecture's structure.
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
        "max_window_layers": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3_next": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def shape(name: str, layers: int | None = None) -> dict[str, Any]:
    """A fresh config dict of the named shape (see `SHAPES`), with `layers` decoder layers if given."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    base, default_layers = SHAPES[name]
    return with_layers(base, layers or default_layers or base["num_hidden_layers"])


def with_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """A copy of `config` with `layers` decoder layers; layer types follow the full-attention interval."""
    if layers < 1:
        raise ValueError(f"layers must be positive, got {layers}")
    out = copy.deepcopy(config)
    out["num_hidden_layers"] = layers
    out["mlp_only_layers"] = [i for i in out.get("mlp_only_layers") or [] if i < layers]
    if "max_window_layers" in out:
        out["max_window_layers"] = layers
    if out["model_type"] == "qwen3_next":
        interval = out.get("full_attention_interval") or 4
        out["layer_types"] = [LINEAR_ATTENTION if (i + 1) % interval else ATTENTION for i in range(layers)]
    return out


def tiny(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with every size shrunk (a few experts, hidden 64), for CPU smoke checks."""
    small = {**copy.deepcopy(config), **_TINY[config["model_type"]]}
    return with_layers(small, small["num_hidden_layers"])


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each decoder layer's token mixer: `full_attention` or `linear_attention`."""
    layers = config["num_hidden_layers"]
    if config["model_type"] != "qwen3_next":
        return [ATTENTION] * layers
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    interval = config.get("full_attention_interval") or 4
    return [LINEAR_ATTENTION if (i + 1) % interval else ATTENTION for i in range(layers)]


def moe_layers(config: dict[str, Any]) -> list[bool]:
    """Which decoder layers have routed experts (`mlp_only_layers` and `decoder_sparse_step` as in HF)."""
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    experts = config.get("num_experts") or 0
    return [
        i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])
    ]


@dataclass(frozen=True)
class ParamCounts:
    """Weight counts (elements, not bytes): whole-model tensors, per-layer parts, and how many layers of each.

    Per-layer fields count one layer of that kind: `attention` a full-attention token mixer (projections
    and q/k norms), `linear_attention` a Gated DeltaNet mixer, `router` / `routed_experts` /
    `shared_expert` (with its sigmoid gate) one MoE block, `expert` one routed expert, `dense_mlp`
    the MLP of a layer without experts, `layer_norms` the two RMSNorms every layer has.
    """

    embedding: int
    lm_head: int
    final_norm: int
    attention: int
    linear_attention: int
    layer_norms: int
    router: int
    expert: int
    routed_experts: int
    shared_expert: int
    dense_mlp: int
    attention_layers: int
    linear_layers: int
    moe_layers: int
    dense_layers: int

    @property
    def layers(self) -> int:
        """Number of decoder layers."""
        return self.attention_layers + self.linear_layers

    def totals(self) -> dict[str, int]:
        """Whole-model element counts per part (each per-layer part times its number of layers)."""
        return {
            "embedding": self.embedding,
            "lm_head": self.lm_head,
            "attention": self.attention * self.attention_layers,
            "linear_attention": self.linear_attention * self.linear_layers,
            "norms": self.layer_norms * self.layers + self.final_norm,
            "router": self.router * self.moe_layers,
            "routed_experts": self.routed_experts * self.moe_layers,
            "shared_expert": self.shared_expert * self.moe_layers,
            "dense_mlp": self.dense_mlp * self.dense_layers,
        }

    @property
    def total(self) -> int:
        """Every weight of the model."""
        return sum(self.totals().values())


def param_counts(config: dict[str, Any]) -> ParamCounts:
    """Count the weights of an HF Qwen3-MoE / Qwen3-Next model of this config, part by part."""
    hidden = config["hidden_size"]
    vocab = config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    bias = bool(config.get("attention_bias"))
    is_next = config["model_type"] == "qwen3_next"

    q_out = heads * head_dim * (2 if is_next else 1)
    kv_out = kv_heads * head_dim
    attention = hidden * (q_out + 2 * kv_out) + heads * head_dim * hidden + 2 * head_dim
    if bias:
        attention += q_out + 2 * kv_out + hidden

    linear = 0
    if is_next:
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value_heads = config["linear_num_value_heads"]
        value_dim = value_heads * config["linear_value_head_dim"]
        linear = (
            hidden * (2 * key_dim + 2 * value_dim)
            + hidden * 2 * value_heads
            + (2 * key_dim + value_dim) * config["linear_conv_kernel_dim"]
            + 2 * value_heads
            + config["linear_value_head_dim"]
            + value_dim * hidden
        )

    experts = config.get("num_experts") or 0
    expert = 3 * hidden * config["moe_intermediate_size"]
    shared = 0
    if is_next:
        shared = 3 * hidden * (config.get("shared_expert_intermediate_size") or 0) + hidden

    types = layer_types(config)
    moe = moe_layers(config)
    return ParamCounts(
        embedding=vocab * hidden,
        lm_head=0 if config.get("tie_word_embeddings") else vocab * hidden,
        final_norm=hidden,
        attention=attention,
        linear_attention=linear,
        layer_norms=2 * hidden,
        router=experts * hidden,
        expert=expert,
        routed_experts=experts * expert,
        shared_expert=shared,
        dense_mlp=3 * hidden * config.get("intermediate_size", 0),
        attention_layers=types.count(ATTENTION),
        linear_layers=types.count(LINEAR_ATTENTION),
        moe_layers=sum(moe),
        dense_layers=len(moe) - sum(moe),
    )


def param_bytes(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of all weights of the model at `dtype_bytes` per element (2 for bf16)."""
    return param_counts(config).total * dtype_bytes


def param_breakdown(config: dict[str, Any], dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes per part of the whole model (see `ParamCounts.totals`), plus `total`."""
    parts = {name: count * dtype_bytes for name, count in param_counts(config).totals().items()}
    parts["total"] = sum(parts.values())
    return parts


def fit_layers(
    shape_or_config: str | dict[str, Any], budget_bytes: float, dtype_bytes: int = 2, multiple: int = 4
) -> int:
    """The largest multiple of `multiple` layers (at most the shape's own count) whose weights fit the budget.

    Only weights are counted: leave room in `budget_bytes` for the KV cache, recurrent states and activations.
    """
    config = shape(shape_or_config) if isinstance(shape_or_config, str) else shape_or_config
    best = 0
    for layers in range(multiple, config["num_hidden_layers"] + 1, multiple):
        if param_bytes(with_layers(config, layers), dtype_bytes) <= budget_bytes:
            best = layers
    if best == 0:
        raise ValueError(f"not even {multiple} layers fit in {budget_bytes / 1e9:.1f} GB")
    return best
