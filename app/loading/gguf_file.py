"""A GGUF model file (llama.cpp's format) as a checkpoint: its metadata as an HF config, its tensors under HF
names.

Read with the `gguf` package's reader (memory-mapped); the model's metadata becomes the config.json fields
the model is built from, and each HF tensor name maps to GGUF tensors (an expert's projection to its slice
of the layer's stacked `ffn_*_exps` tensor) and to how llama.cpp's converter changed them, undone when read:
for `qwen3next` its norms hold 1 + weight, `ssm_a` holds -exp(A_log), the conv weight lost its middle axis,
`in_proj_qkvz` is split into `attn_qkv` (every head's q, then k, then v) and `attn_gate` (z), and the MTP
layer is the block after the last. F32, F16 and BF16 tensors are views of the mapped file; Q8_0, Q4_K, Q5_K,
Q6_K, IQ4_XS, IQ3_XXS and IQ3_S tensors are dequantized when read (app/kernels/gguf_quants.py), so the model
holds them widened to its dtype, except where the loader holds a tensor as its blocks (`held_blocks`: a view
of the mapped file, Q8_0's reordered, read in place by the kernels of a backend set that reads that type).
Other quant types, and architectures other than `qwen3moe` and `qwen3next`, are refused with a one-line
error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.kernels.gguf_quants import DEQUANTIZE, dequantize, to_held
from app.kernels.interface import HELD_BLOCKS
from app.loading.safetensors import CheckpointError
from app.models.config import ModelConfig

ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next"}  # general.architecture -> model_type
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # read as views of the file

# HF config field <- GGUF metadata key (after "<arch>.")
_CONFIG_KEYS = {
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
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "linear_conv_kernel_dim": "ssm.conv_kernel",
    "linear_key_head_dim": "ssm.state_size",
    "linear_num_key_heads": "ssm.group_count",
    "linear_num_value_heads": "ssm.time_step_rank",
    "full_attention_interval": "full_attention_interval",
}


@dataclass(frozen=True)
class Undo:
    """How llama.cpp's converter changed a tensor, undone: its values and its shape (from the GGUF
    tensors', in HF order)."""

    values: Callable[[list[torch.Tensor]], torch.Tensor]
    shape: Callable[[list[tuple[int, ...]]], tuple[int, ...]] = lambda shapes: shapes[0]


MINUS_ONE = Undo(lambda t: t[0].float() - 1)  # qwen3next's norms are stored as 1 + weight
LOG_NEGATED = Undo(lambda t: torch.log(-t[0].float()))  # ssm_a holds -exp(A_log)
CONV = Undo(lambda t: t[0].unsqueeze(1), lambda s: (s[0][0], 1, s[0][1]))  # [channels, kernel] -> [c, 1, k]
ONE_ROW = Undo(lambda t: t[0].reshape(1, -1), lambda s: (1, math.prod(s[0])))  # the shared expert's gate


@dataclass(frozen=True)
class Source:
    """Where an HF tensor lies in the file: its GGUF tensors (an expert's slice of each where `expert` is
    set; of that, rows [rows[0], rows[1]) where `rows` is), and what undoes the converter's change."""

    names: tuple[str, ...]
    expert: int | None = None
    rows: tuple[int, int] | None = None
    undo: Undo | None = None


# HF tensor name -> GGUF tensor name (and the change undone); layer names after "model.layers.N." / "blk.N."
_GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", None),
    "lm_head.weight": ("output.weight", None),
}
_ATTENTION = {
    "self_attn.q_proj.weight": "attn_q.weight",  # qwen3next: every head's q, then its gate, as in HF
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_MOE_LAYER = {
    **{hf: (name, None) for hf, name in _ATTENTION.items()},
    "input_layernorm.weight": ("attn_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", None),
}
_NEXT_LAYER = {
    **{hf: (name, None) for hf, name in _ATTENTION.items()},
    "input_layernorm.weight": ("attn_norm.weight", MINUS_ONE),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", MINUS_ONE),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", MINUS_ONE),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", MINUS_ONE),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", None),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", None),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", None),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", ONE_ROW),
    "linear_attn.in_proj_qkvz.weight": ("ssm_in.weight", None),  # older files kept HF's layout
    "linear_attn.in_proj_ba.weight": ("ssm_ba.weight", None),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", CONV),
    "linear_attn.dt_bias": ("ssm_dt.bias", None),
    "linear_attn.A_log": ("ssm_a", LOG_NEGATED),
    "linear_attn.norm.weight": ("ssm_norm.weight", None),  # the gated norm is plain: not stored as 1 + w
    "linear_attn.out_proj.weight": ("ssm_out.weight", None),
}
_LAYERS = {"qwen3moe": _MOE_LAYER, "qwen3next": _NEXT_LAYER}
_FINAL_NORM = {"qwen3moe": None, "qwen3next": MINUS_ONE}
_MTP = {  # qwen3next's MTP head, in the first block after the main model's layers
    "mtp.fc.weight": ("nextn.eh_proj.weight", None),
    "mtp.pre_fc_norm_embedding.weight": ("nextn.enorm.weight", MINUS_ONE),
    "mtp.pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", MINUS_ONE),
    "mtp.norm.weight": ("nextn.shared_head_norm.weight", MINUS_ONE),
}
_EXPERT = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
}
_GATE_UP = "ffn_gate_up_exps.weight"  # gate and up stacked in one tensor (gate rows first), where written


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
        mtp = int(meta.get(prefix + "nextn_predict_layers", 0))  # counted in block_count
        config["num_hidden_layers"] = int(meta.get(prefix + "block_count", 0)) - mtp
        if mtp:
            config["mtp_num_hidden_layers"] = mtp
        inner, value_heads = meta.get(prefix + "ssm.inner_size"), meta.get(prefix + "ssm.time_step_rank")
        if inner and value_heads:
            config["linear_value_head_dim"] = int(inner) // int(value_heads)
        rotary, head_dim = meta.get(prefix + "rope.dimension_count"), config.get("head_dim")
        if rotary and head_dim:
            config["partial_rotary_factor"] = int(rotary) / int(head_dim)
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

    def _hf_names(self) -> dict[str, Source]:
        """HF tensor name -> its source, for every tensor the model reads that the file holds."""
        have = self._tensors.__contains__
        names = {hf: Source((name,), undo=undo) for hf, (name, undo) in _GLOBAL.items() if have(name)}
        if have("output_norm.weight"):
            names["model.norm.weight"] = Source(("output_norm.weight",), undo=_FINAL_NORM[self.arch])
        layers = self.config.num_hidden_layers
        for i in range(layers):
            names.update(self._layer(f"model.layers.{i}.", f"blk.{i}."))
        for k in range(self.config.mtp_layers or 0):
            names.update(self._layer(f"mtp.layers.{k}.", f"blk.{layers + k}."))
        if self.config.mtp_layers:
            head = f"blk.{layers}."
            for hf, (name, undo) in _MTP.items():
                if have(head + name):
                    names[hf] = Source((head + name,), undo=undo)
        return names

    def _layer(self, hf: str, blk: str) -> dict[str, Source]:
        """The sources of one decoder layer's tensors (HF prefix `hf`, GGUF prefix `blk`)."""
        have = self._tensors.__contains__
        names = {
            hf + h: Source((blk + g,), undo=u) for h, (g, u) in _LAYERS[self.arch].items() if have(blk + g)
        }
        if have(blk + "attn_qkv.weight") and have(blk + "attn_gate.weight"):
            parts = (blk + "attn_qkv.weight", blk + "attn_gate.weight")
            names[hf + "linear_attn.in_proj_qkvz.weight"] = Source(parts, undo=self._qkvz())
        for e in range(self.config.num_experts or 0):
            for projection, name in _EXPERT.items():
                if have(blk + name):
                    names[f"{hf}mlp.experts.{e}.{projection}.weight"] = Source((blk + name,), expert=e)
            if have(blk + _GATE_UP):
                rows = self.config.moe_intermediate_size
                for projection, part in (("gate_proj", (0, rows)), ("up_proj", (rows, 2 * rows))):
                    names[f"{hf}mlp.experts.{e}.{projection}.weight"] = Source((blk + _GATE_UP,), e, part)
        return names

    def _qkvz(self) -> Undo:
        """HF's `in_proj_qkvz` (per key head: its q, k, then its value heads' v and z) from llama.cpp's
        `attn_qkv` (every key head's q, then every k, then every v) and `attn_gate` (z)."""
        c = self.config
        heads, qk, vz = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        vz *= c.linear_num_value_heads // heads  # a key head's share of the value heads

        def values(tensors: list[torch.Tensor]) -> torch.Tensor:
            qkv, gate = tensors
            hidden = qkv.shape[-1]
            q, k, v = qkv.split([heads * qk, heads * qk, heads * vz])
            parts = [q.view(heads, qk, hidden), k.view(heads, qk, hidden), v.view(heads, vz, hidden)]
            return torch.cat([*parts, gate.view(heads, vz, hidden)], 1).reshape(-1, hidden)

        return Undo(values, lambda shapes: (shapes[0][0] + shapes[1][0], shapes[0][1]))

    def names(self) -> list[str]:
        """Every tensor the file holds, by its HF name."""
        return list(self._names)

    def _shape(self, name: str, source: Source) -> tuple[int, ...]:
        """A GGUF tensor's shape in HF order (the reverse of GGUF's), for the part `source` reads."""
        shape = tuple(int(d) for d in reversed(self._tensors[name][0].shape))
        if source.expert is not None:
            shape = shape[1:]
        if source.rows is not None:
            shape = (source.rows[1] - source.rows[0], *shape[1:])
        return shape

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without touching its data."""
        source = self._names[name]
        shapes = [self._shape(part, source) for part in source.names]
        return source.undo.shape(shapes) if source.undo is not None else shapes[0]

    def _raw(self, name: str, expert: int | None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One GGUF tensor's bytes (an expert's slice of them) as a view of the mapped file, and its shape in
        HF order."""
        tensor, file = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        start, size = int(tensor.data_offset), int(tensor.n_bytes)
        if expert is not None:
            size //= shape[0]
            start += expert * size
            shape = shape[1:]
        return torch.empty(0, dtype=torch.uint8).set_(self._storages[file], start, (size,)), shape

    def _read(self, name: str, source: Source) -> torch.Tensor:
        """One GGUF tensor's values (the part `source` reads): a view of the mapped file, or dequantized."""
        raw, shape = self._raw(name, source.expert)
        kind = self._tensors[name][0].tensor_type.name
        if kind in DEQUANTIZE:
            values = dequantize(kind, raw, shape)
        else:
            dtype = PLAIN[kind]
            values = (
                (raw.clone() if raw.storage_offset() % dtype.itemsize else raw).view(dtype).reshape(shape)
            )
        return values if source.rows is None else values[source.rows[0] : source.rows[1]]

    def held_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A tensor's quant type and its blocks, [rows, row bytes] uint8 in the layout kernels hold them in
        (`gguf_quants.to_held`: a view of the mapped file, an expert's slice of its stacked tensor, but for
        Q8_0's, reordered in a copy), where it is of a type kernels may read in place (HELD_BLOCKS) and read
        as it lies; else None."""
        source = self._names[name]
        kind = self._tensors[source.names[0]][0].tensor_type.name
        if len(source.names) != 1 or source.undo is not None or kind not in HELD_BLOCKS:
            return None
        raw, shape = self._raw(source.names[0], source.expert)
        blocks = raw.view(shape[0], -1)
        return kind, to_held(kind, blocks if source.rows is None else blocks[source.rows[0] : source.rows[1]])

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor: a view of the mapped file (F32, F16, BF16) or its values dequantized (quant types), with
        the converter's change undone; an expert's projection reads only its own slice of the layer's
        stacked tensor."""
        source = self._names[name]
        parts = [self._read(part, source) for part in source.names]
        return source.undo.values(parts) if source.undo is not None else parts[0]

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the file's tokenizer metadata."""
        return self.config.eos_token_ids
