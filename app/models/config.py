"""Model configuration read from an HF `config.json`, normalised across field-name generations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.errors import StrataError

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3_next")
ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# Hugging Face's defaults for the fields a config.json may leave out, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "max_position_embeddings": 32768,
    },
    "qwen3_next": {
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 5632,
        "moe_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "max_position_embeddings": 32768,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
    },
}


class ConfigError(StrataError):
    """The model's config.json is missing, unreadable or describes an unsupported model."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: base, scaling type and its arguments, rotated share of head_dim."""

    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one model, with every variant real Qwen3-MoE / Qwen3-Next checkpoints use."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_layers: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None

    @property
    def gated_attention(self) -> bool:
        """Qwen3-Next's q_proj also yields a per-head output gate."""
        return self.model_type == "qwen3_next"

    @property
    def offset_norm(self) -> bool:
        """Qwen3-Next's RMSNorm scales by (1 + weight)."""
        return self.model_type == "qwen3_next"

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dimensions that RoPE rotates."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed JSON of a config.json; raises ConfigError on an unsupported model."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = ",".join(raw.get("architectures") or []) or "?"
            raise ConfigError(
                f"unsupported architecture {archs} (model_type {model_type!r}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("use_sliding_window"):
            raise ConfigError("unsupported: use_sliding_window is true in config.json")
        if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
            raw = {**raw, "num_experts": raw["num_local_experts"]}
        get = _Fields(raw, _DEFAULTS[model_type])
        hidden = get.require("hidden_size")
        layers = get.require("num_hidden_layers")
        heads = get("num_attention_heads")
        return cls(
            model_type=model_type,
            vocab_size=get.require("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim") or hidden // heads,
            intermediate_size=get("intermediate_size"),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            rope=_rope(raw, get),
            layer_types=_layer_types(model_type, raw, layers),
            moe_layers=_moe_layers(get, layers),
            num_experts=get("num_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=get("linear_key_head_dim", 128),
            linear_value_head_dim=get("linear_value_head_dim", 128),
            linear_num_key_heads=get("linear_num_key_heads", 16),
            linear_num_value_heads=get("linear_num_value_heads", 32),
            mtp_layers=raw.get("num_nextn_predict_layers", raw.get("mtp_num_hidden_layers")),
            eos_token_ids=_id_list(raw.get("eos_token_id")),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


class _Fields:
    """Reads config fields with per-architecture defaults."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.raw = raw
        self.defaults = defaults

    def __call__(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name)
        if value is None:
            value = self.defaults.get(name, default)
        return value

    def require(self, name: str) -> Any:
        if self.raw.get(name) is None:
            raise ConfigError(f"config.json has no {name}")
        return self.raw[name]


def _rope(raw: dict[str, Any], get: _Fields) -> RopeConfig:
    """Merge `rope_parameters` (newer) with `rope_theta`, `rope_scaling`, `partial_rotary_factor` (older)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", None) or get("partial_rotary_factor", 1.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ("default", "linear", "yarn", "llama3"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} in config.json")
    if rope_type in ("yarn", "llama3"):
        params.setdefault("original_max_position_embeddings", get("max_position_embeddings"))
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, partial_rotary_factor=float(partial), params=params
    )


def _layer_types(model_type: str, raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    if model_type != "qwen3_next":
        return (ATTENTION,) * layers
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval") or 4
        types = [LINEAR_ATTENTION if (i + 1) % interval else ATTENTION for i in range(layers)]
    if len(types) != layers or any(t not in (ATTENTION, LINEAR_ATTENTION) for t in types):
        raise ConfigError(
            f"config.json layer_types must list {layers} of {ATTENTION!r} / {LINEAR_ATTENTION!r}"
        )
    return tuple(types)


def _moe_layers(get: _Fields, layers: int) -> tuple[bool, ...]:
    """Which layers have routed experts: `mlp_only_layers` and `decoder_sparse_step` as in HF."""
    dense = set(get("mlp_only_layers") or [])
    step = get("decoder_sparse_step", 1) or 1
    experts = get("num_experts")
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))


def _id_list(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
