"""Tiny GGUF files written with the `gguf` package from a tiny HF checkpoint, as llama.cpp's converter lays
them out: llama.cpp's tensor names (each layer's experts stacked), metadata keys, and the tokenizer as tokens,
merges and token types. The names are restated here, not imported from the loader, so that a wrong name there
fails the tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
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
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names, a layer's experts stacked [experts, out, in]."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                value = f.get_tensor(name).float().numpy()
                if m := _EXPERT.match(name):
                    experts.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = value
                elif m := _LAYER.match(name):
                    out[f"blk.{m[1]}.{_NAMES[m[2]]}"] = value
                else:
                    out[_NAMES[name]] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(hf_dir: Path, path: Path, quant: str = "F32", split: int = 0) -> Path:
    """Write the tiny qwen3_moe checkpoint in `hf_dir` as one GGUF file; with `quant` "Q8_0" its matrices are
    Q8_0 (norms stay F32, as llama.cpp keeps them); with `split`, as files of at most that many tensors
    (`NAME-0000i-of-0000N.gguf`, as llama.cpp's gguf-split names them; returns the first)."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "qwen3moe", split_max_tensors=split)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _add_tokenizer(writer, hf_dir)
    for name, value in _tensors(hf_dir).items():
        if quant == "Q8_0" and value.ndim >= 2:
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return shards[0] if split else path


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_chat_template(config["chat_template"])


def dequantized_copy(hf_dir: Path, out_dir: Path) -> Path:
    """A copy of the HF checkpoint whose matrices hold their Q8_0 values (what a Q8_0 GGUF of it holds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                value = f.get_tensor(name).float()
                if value.dim() >= 2:
                    q = gguf.quants.quantize(value.numpy(), gguf.GGMLQuantizationType.Q8_0)
                    value = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())
                tensors[name] = value.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf_dir / extra).exists():
            (out_dir / extra).write_bytes((hf_dir / extra).read_bytes())
    return out_dir
