"""A GGUF model file (llama.cpp's format) as a checkpoint: its metadata as an HF config, its tensors under HF
names.

Read with the `gguf` package's reader (memory-mapped); the model's metadata becomes the config.json fields
the model is built from, and each HF tensor name maps to a GGUF tensor (an expert's projection to its slice
of the layer's stacked `ffn_*_exps` tensor). F32, F16 and BF16 tensors are views of the mapped file; Q8_0,
Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS and IQ3_S tensors are dequantized when read (app/kernels/gguf_quants.py),
so the model holds them widened to its dtype. Other quant types, and architectures other than `qwen3moe`,
are refused with a one-line error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.kernels.gguf_quants import DEQUANTIZE, dequantize
from app.loading.safetensors import CheckpointError
from app.models.config import ModelConfig

ARCHITECTURES = {"qwen3moe": "qwen3_moe"}  # GGUF general.architecture -> HF model_type
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # read as views of the file

# HF config field <- GGUF metadata key (after "<arch>.")
_CONFIG_KEYS = {
    "num_hidden_layers": "block_count",
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
}

# HF tensor name (a regex over layer i and expert e) -> GGUF tensor name
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
}


SHARD = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split


def is_gguf(path: Path | str) -> bool:
    """Whether `path` names a GGUF file (by its suffix)."""
    return Path(path).suffix == ".gguf"


def gguf_shards(path: Path) -> list[Path]:
    """The files of a GGUF model: the one file, or every shard of a split one (`NAME-00001-of-0000N.gguf`,
    given any of them)."""
    match = SHARD.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    shards = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise CheckpointError(f"{path.name} is one of {count} files; {missing[0]} is missing")
    return shards


def model_name(path: Path) -> str:
    """A GGUF model's name as users see it: its file's, without the suffix or a split file's numbering."""
    match = SHARD.match(path.name)
    return match["stem"] if match is not None else path.stem


class GGUFCheckpoint:
    """A GGUF model (one file, or the shards of a split one) with the interface of `CheckpointDir`: `config`,
    `names()`, `shape()`, `tensor()`."""

    def __init__(self, path: Path | str) -> None:
        import gguf  # the reader is only needed for GGUF files

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"model file {self.path} does not exist")
        self.files = gguf_shards(self.path)
        readers = []
        for file in self.files:
            try:
                readers.append(gguf.GGUFReader(file))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot read GGUF file {file}: {e}") from None
        self.metadata: dict[str, Any] = {}
        for reader in reversed(readers):  # the first shard's metadata wins
            self.metadata.update({name: field.contents() for name, field in reader.fields.items()})
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"unsupported GGUF architecture {arch!r} in {self.path.name}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self.arch = arch
        self._tensors = {t.name: (t, i) for i, reader in enumerate(readers) for t in reader.tensors}
        for name, (tensor, _) in self._tensors.items():
            if tensor.tensor_type.name not in (*PLAIN, *DEQUANTIZE):
                raise CheckpointError(
                    f"unsupported quant type {tensor.tensor_type.name} of {name} in {self.path.name}; "
                    f"supported: {', '.join((*PLAIN, *DEQUANTIZE))}"
                )
        self.raw_config = self._config()
        self.config = ModelConfig.from_dict(self.raw_config)
        self._storages = [
            torch.UntypedStorage.from_file(str(file), shared=False, nbytes=file.stat().st_size)
            for file in self.files
        ]
        self._names = self._hf_names()

    def _config(self) -> dict[str, Any]:
        meta, prefix = self.metadata, f"{self.arch}."
        config: dict[str, Any] = {"model_type": ARCHITECTURES[self.arch]}
        for field, key in _CONFIG_KEYS.items():
            value = meta.get(prefix + key)
            if isinstance(value, float):  # stored as float32: its shortest decimal, as config.json would hold
                value = float(str(np.float32(value)))
            if value is not None:
                config[field] = value
        tokens = meta.get("tokenizer.ggml.tokens")
        embed = self._tensors.get("token_embd.weight")
        config["vocab_size"] = int(embed[0].shape[1]) if embed is not None else len(tokens or ())
        config["tie_word_embeddings"] = "output.weight" not in self._tensors
        config["norm_topk_prob"] = bool(meta.get(prefix + "expert_weights_norm", True))
        # `--dtype auto`: float32 for an all-F32 file, else bfloat16 (what 16-bit and quantized ones widen to)
        kinds = {t.tensor_type.name for t, _ in self._tensors.values()}
        config["dtype"] = "float32" if kinds <= {"F32"} else "bfloat16"
        if "tokenizer.ggml.eos_token_id" in meta:
            config["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
        return config

    def _hf_names(self) -> dict[str, tuple[str, int | None]]:
        """HF tensor name -> (GGUF tensor name, expert index or None), for every tensor the model reads."""
        names: dict[str, tuple[str, int | None]] = {}
        for hf, name in _GLOBAL.items():
            if name in self._tensors:
                names[hf] = (name, None)
        for i in range(self.config.num_hidden_layers):
            for hf, name in _LAYER.items():
                if f"blk.{i}.{name}" in self._tensors:
                    names[f"model.layers.{i}.{hf}"] = (f"blk.{i}.{name}", None)
            for e in range(self.config.num_experts or 0):
                for projection, name in _EXPERT.items():
                    if f"blk.{i}.{name}" in self._tensors:
                        names[f"model.layers.{i}.mlp.experts.{e}.{projection}.weight"] = (
                            f"blk.{i}.{name}",
                            e,
                        )
        return names

    def names(self) -> list[str]:
        """Every tensor the file holds, by its HF name."""
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (HF order: the reverse of GGUF's), without touching its data."""
        source, expert = self._names[name]
        shape = tuple(int(d) for d in reversed(self._tensors[source][0].shape))
        return shape[1:] if expert is not None else shape

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor: a view of the mapped file (F32, F16, BF16) or its values dequantized (quant types); an
        expert's projection reads only its own slice of the layer's stacked tensor."""
        source, expert = self._names[name]
        tensor, file = self._tensors[source]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        start, size = int(tensor.data_offset), int(tensor.n_bytes)
        if expert is not None:
            size //= shape[0]
            start += expert * size
            shape = shape[1:]
        raw = torch.empty(0, dtype=torch.uint8).set_(self._storages[file], start, (size,))
        kind = tensor.tensor_type.name
        if kind in DEQUANTIZE:
            return dequantize(kind, raw, shape)
        dtype = PLAIN[kind]
        if start % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).reshape(shape)

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the file's tokenizer metadata."""
        return self.config.eos_token_ids
