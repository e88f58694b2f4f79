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

from app.kernels.gguf_quants import i_quant_tables

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
# qwen3next (llama.cpp's Qwen3NextModel): other names, and what the converter does to the values
_NEXT_NAMES = {
    **_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
_EXPERT = re.compile(r"(?:model|mtp)\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_LAYER = re.compile(r"(model|mtp)\.layers\.(\d+)\.(.+)")
_MTP_HEAD = re.compile(r"mtp\.(fc|pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight")


BLOCK = {"Q8_0": 32, **dict.fromkeys(("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ3_S"), 256)}  # the
# values a block of the quant types the writer knows
# A mix's type for most matrices and for the down projections (llama.cpp's Q4_K_M gives ffn_down Q6_K).
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K")}


def tensor_type(name: str, quant: str) -> str:
    """The quant type a file of `quant` (a type, or a mix) gives this tensor if it is quantized; `name` is
    the GGUF or the HF name."""
    if quant not in MIXES:
        return quant
    most, down = MIXES[quant]
    return down if "ffn_down" in name or "down_proj" in name else most


def _quantized(name: str, shape: tuple[int, ...], quant: str) -> bool:
    """Whether a file of `quant` holds this tensor quantized: matrices whose rows are whole blocks (as
    llama.cpp, which keeps the rest and the conv weight in float)."""
    block = BLOCK.get(tensor_type(name, quant))
    return block is not None and len(shape) >= 2 and shape[-1] % block == 0 and "conv1d" not in name


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Q6_K blocks [..., columns / 256 * 210] uint8 of float values [..., columns]: per group of 16 a
    signed 6-bit code (stored plus 32) under an int8 scale of the super-block's d (a plain quantizer)."""
    rows = values.shape[:-1]
    x = values.reshape(-1, 16, 16).astype(np.float32)
    group = np.abs(x).max(-1) / 31
    d = (group.max(-1) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    sc = np.clip(np.rint(group / safe), 0, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = np.clip(np.rint(x / np.where(step == 0, 1, step)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # halves of 128 values, quarters of 32
    low = np.concatenate(
        [q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], 2
    )
    high = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    parts = [low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(*rows, -1)


def _k_codes(values: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K's and Q5_K's codes of float values [..., columns]: per group of 32 an unsigned code up to `top`
    between its minimum (at most 0) and its maximum, the groups' scales and minimums in 6 bits of a
    super-block's d and dmin (a plain quantizer; llama.cpp's searches for better scales). Returns d, dmin
    [blocks] fp16, the 12 packed bytes of scales and minimums [blocks, 12] and the codes [blocks, 8, 32]."""
    x = values.reshape(-1, 8, 32).astype(np.float32)
    low, high = np.minimum(x.min(-1), 0), x.max(-1)
    scale, least = (high - low) / top, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (least.max(-1) / 63).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    safe_min = np.where(dmin == 0, 1, dmin).astype(np.float32)[:, None]
    sc = np.clip(np.rint(scale / safe), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(least / safe_min), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint((x + shift) / np.where(step == 0, 1, step)), 0, top).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return d, dmin, packed, q


def _k_blocks(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    """A K-quant's blocks: d, dmin, the packed scales, then `rest` (bytes [blocks, n] each)."""
    return np.concatenate(
        [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, *rest], 1
    )


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """Codes [blocks, 8, 32] as 128 bytes a block: per stretch of 64, the first 32 in the low nibbles."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K blocks [..., columns / 256 * 144] uint8 of float values [..., columns] (`_k_codes` up to 15)."""
    d, dmin, packed, q = _k_codes(values, 15)
    return _k_blocks(d, dmin, packed, _nibble_bytes(q)).reshape(*values.shape[:-1], -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """Q5_K blocks [..., columns / 256 * 176] uint8 (`_k_codes` up to 31): the fifth bits (bit g of byte l:
    code l of group g), then the nibbles as Q4_K's."""
    d, dmin, packed, q = _k_codes(values, 31)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    return _k_blocks(d, dmin, packed, fifth, _nibble_bytes(q)).reshape(*values.shape[:-1], -1)


def _nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The index of the nearest row of `levels` [n, width] to each row of x [..., width] (squared distance,
    less x's own squares: one matrix product)."""
    return ((levels * levels).sum(-1) - 2 * x @ levels.T).argmin(-1)


def _lattice_codes(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """For each row of x [..., 4], a grid entry (an index into grid [n, 4]): each value rounded to the nearest
    of the levels the grid's entries are made of, then that lattice point's nearest entry, looked up in a
    table of every point (a valid code, a little coarser than the nearest entry to x itself, and a search of
    a few thousand points where x may have millions of rows)."""
    levels = np.unique(grid)
    at = np.abs(x[..., None] - levels).argmin(-1)  # each value's nearest level
    points = np.stack(np.meshgrid(*[levels] * 4, indexing="ij"), -1).reshape(-1, 4)
    table = _nearest(points, grid)
    return table[(at * len(levels) ** np.arange(3, -1, -1)).sum(-1)]


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [..., columns / 256 * 136] uint8: per group of 32 a scale (0..31 steps of d above 32)
    and each value's nearest of IQ4_NL's levels (a plain quantizer)."""
    levels = i_quant_tables()["iq4"].numpy()
    x = values.reshape(-1, 8, 32).astype(np.float32)
    group = np.abs(x).max(-1) / 113
    d = (group.max(-1) / 31).astype(np.float16)
    sc = np.clip(np.rint(group / np.where(d == 0, 1, d).astype(np.float32)[:, None]), 1, 31).astype(np.int64)
    step = d.astype(np.float32)[:, None, None] * sc[..., None]
    codes = _nearest((x / np.where(step == 0, 1, step))[..., None], levels[:, None])  # [blocks, 8, 32]
    biased = sc + 32
    high = ((biased >> 4) << (2 * np.arange(8))).sum(1).astype(np.uint16)
    low = (biased[:, 0::2] & 15) | ((biased[:, 1::2] & 15) << 4)
    qs = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).reshape(-1, 128)
    parts = [d.reshape(-1, 1).view(np.uint8), high.reshape(-1, 1).view(np.uint8), low, qs]
    return np.concatenate([p.astype(np.uint8) for p in parts], 1).reshape(*values.shape[:-1], -1)


def _grid_codes(x: np.ndarray, multiplier: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values x [blocks, 8, 32] under a multiplier a group [blocks, 8]: each 4 values' grid entry [blocks, 8,
    8] (the one nearest the point of the grid's own levels nearest them: `_lattice_codes`) and the sign bits
    [blocks, 8, 4] of each 8 values (bit j: value j negative)."""
    scaled = np.abs(x) / np.where(multiplier == 0, 1, multiplier)[..., None]
    ids = _lattice_codes(scaled.reshape(*x.shape[:2], 8, 4), grid)
    negative = (x < 0).reshape(*x.shape[:2], 4, 8)
    return ids, (negative << np.arange(8)).sum(-1)


def quantize_iq3_xxs(values: np.ndarray) -> np.ndarray:
    """IQ3_XXS blocks [..., columns / 256 * 98] uint8: per group of 32 a 4-bit scale, each 4 magnitudes'
    nearest grid entry, and signs whose count of negatives in each 8 is made even (the smallest one
    flipped)."""
    grid = i_quant_tables()["IQ3_XXS"].numpy()
    x = values.reshape(-1, 8, 32).astype(np.float32)
    group = np.abs(x).max(-1) / 62
    d = (group.max(-1) / 7.75).astype(np.float16)
    wide = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    s = np.clip(np.rint(group / wide * 2 - 0.5), 0, 15).astype(np.int64)
    parts = x.reshape(-1, 8, 4, 8).copy()
    odd = ((parts < 0).sum(-1) % 2 == 1)[..., None]
    smallest = np.abs(parts).argmin(-1)[..., None] == np.arange(8)
    parts = np.where(odd & smallest, -parts, parts)
    ids, signs = _grid_codes(parts.reshape(-1, 8, 32), d.astype(np.float32)[:, None] * (0.5 + s) * 0.5, grid)
    words = (((signs & 127) << (7 * np.arange(4))).sum(-1) | (s << 28)).astype(np.uint32)
    parts_out = [d.reshape(-1, 1).view(np.uint8), ids.reshape(-1, 64).astype(np.uint8), words.view(np.uint8)]
    return np.concatenate(parts_out, 1).reshape(*values.shape[:-1], -1)


def quantize_iq3_s(values: np.ndarray) -> np.ndarray:
    """IQ3_S blocks [..., columns / 256 * 110] uint8: per group of 32 a 4-bit scale s (1 + 2 s steps of d),
    each 4 magnitudes' nearest of the 512 grid entries, and the signs."""
    grid = i_quant_tables()["IQ3_S"].numpy()
    x = values.reshape(-1, 8, 32).astype(np.float32)
    group = np.abs(x).max(-1) / 15
    d = (group.max(-1) / 31).astype(np.float16)
    wide = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    s = np.clip(np.rint((group / wide - 1) / 2), 0, 15).astype(np.int64)
    ids, signs = _grid_codes(x, d.astype(np.float32)[:, None] * (1 + 2 * s), grid)
    ninth = ((ids >> 8) << np.arange(8)).sum(-1)
    scales = s[:, 0::2] | (s[:, 1::2] << 4)
    parts = [d.reshape(-1, 1).view(np.uint8), ids.reshape(-1, 64) & 255, ninth, signs.reshape(-1, 32), scales]
    return np.concatenate([p.astype(np.uint8) for p in parts], 1).reshape(*values.shape[:-1], -1)


_QUANTIZERS = {
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "IQ4_XS": quantize_iq4_xs,
    "IQ3_XXS": quantize_iq3_xxs,
    "IQ3_S": quantize_iq3_s,
}  # the gguf package quantizes Q8_0 only of these


def _quantize(value: np.ndarray, kind: str) -> np.ndarray:
    """A matrix as `kind`'s blocks (uint8 rows)."""
    if kind in _QUANTIZERS:
        return _QUANTIZERS[kind](value)
    return gguf.quants.quantize(value, gguf.GGMLQuantizationType[kind])


def _stored_as_one_plus(name: str) -> bool:
    """Whether qwen3next's converter stores this norm as 1 + weight: every norm but the gated one, the MTP
    head's too (renamed enorm / hnorm before the converter looks at the name)."""
    gated = name.endswith("linear_attn.norm.weight")
    return (name.endswith("norm.weight") and not gated) or name.startswith("mtp.pre_fc_norm_")


def converted(name: str, value: np.ndarray) -> np.ndarray:
    """What llama.cpp's qwen3next converter stores for an HF tensor (in_proj_qkvz aside): norms as 1 + weight
    (not the Gated DeltaNet's gated norm), A_log as -exp(A_log), the conv weight without its middle axis."""
    if _stored_as_one_plus(name):
        return value + np.float32(1)
    if name.endswith(".A_log"):
        return -np.exp(value)
    if name.endswith("conv1d.weight"):
        return value.squeeze(1)
    return value


def _split_qkvz(value: np.ndarray, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """HF's in_proj_qkvz (per key head: q, k, its value heads' v, z) as llama.cpp's attn_qkv (every q, then
    every k, then every v) and attn_gate (every z)."""
    heads, qk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vz = config["linear_value_head_dim"] * config["linear_num_value_heads"] // heads
    per_head = value.reshape(heads, 2 * qk + 2 * vz, -1)
    q, k, v, z = np.split(per_head, [qk, 2 * qk, 2 * qk + vz], axis=1)
    hidden = value.shape[-1]
    return np.concatenate([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]), z.reshape(
        -1, hidden
    )


def _tensors(hf_dir: Path, config: dict[str, Any], whole_qkvz: bool = False) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names (a layer's experts stacked [experts, out, in]);
    qwen3next's converted as llama.cpp's converter does, its MTP layer as the block after the last (with
    `whole_qkvz`, in_proj_qkvz kept whole as `ssm_in`, as older files have it)."""
    nxt = config["model_type"] == "qwen3_next"
    names, layers = (_NEXT_NAMES if nxt else _NAMES), config["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                value = f.get_tensor(name).float().numpy()
                value = converted(name, value) if nxt else value
                block = None
                if m := _LAYER.match(name):
                    block, rest = int(m[2]) + (layers if m[1] == "mtp" else 0), m[3]
                if m := _EXPERT.match(name):
                    experts.setdefault(f"blk.{block}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = value
                elif block is not None and rest == "linear_attn.in_proj_qkvz.weight" and whole_qkvz:
                    out[f"blk.{block}.ssm_in.weight"] = value
                elif block is not None and rest == "linear_attn.in_proj_qkvz.weight":
                    out[f"blk.{block}.attn_qkv.weight"], out[f"blk.{block}.attn_gate.weight"] = _split_qkvz(
                        value, config
                    )
                elif block is not None:
                    out[f"blk.{block}.{names[rest]}"] = value
                elif _MTP_HEAD.match(name):
                    out[f"blk.{layers}.{names[name]}"] = value
                else:
                    out[names[name]] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(
    hf_dir: Path, path: Path, quant: str = "F32", split: int = 0, whole_qkvz: bool = False
) -> Path:
    """Write the tiny qwen3_moe or qwen3_next checkpoint in `hf_dir` as one GGUF file; with `quant` "Q8_0"
    or a type of `_QUANTIZERS` (plain quantizers) its matrices of whole blocks are of that type, with
    "Q4_K_M" Q4_K and the down projections Q6_K (norms, vectors and the rest stay F32, as llama.cpp keeps
    them); with `split`, as files of at most that many tensors (`NAME-0000i-of-0000N.gguf`, as llama.cpp's
    gguf-split names them; returns the first)."""
    config = json.loads((hf_dir / "config.json").read_text())
    nxt = config["model_type"] == "qwen3_next"
    mtp = len({n.split(".")[2] for n in _safetensor_names(hf_dir) if n.startswith("mtp.layers.")})
    writer = gguf.GGUFWriter(path, "qwen3next" if nxt else "qwen3moe", split_max_tensors=split)
    writer.add_block_count(config["num_hidden_layers"] + mtp)
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
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if nxt:
        partial = config["rope_parameters"]["partial_rotary_factor"]
        writer.add_rope_dimension_count(int(config["head_dim"] * partial))
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        interval = [t == "full_attention" for t in config["layer_types"]].index(True) + 1
        writer.add_full_attention_interval(interval)
        if mtp:
            writer.add_nextn_predict_layers(mtp)
    else:
        writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    _add_tokenizer(writer, hf_dir)
    for name, value in _tensors(hf_dir, config, whole_qkvz).items():
        if _quantized(name, value.shape, quant):
            kind = tensor_type(name, quant)
            writer.add_tensor(name, _quantize(value, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return shards[0] if split else path


def _safetensor_names(hf_dir: Path) -> list[str]:
    names: list[str] = []
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.extend(f.keys())
    return names


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


def same_values_copy(hf_dir: Path, out_dir: Path, quant: str = "F32") -> Path:
    """A copy of the HF checkpoint holding the values a GGUF of it holds, as the loader reads them back: with
    `quant` a type `write_gguf` takes or the mix "Q4_K_M" its quantized matrices' values; for qwen3next the
    converter's changes undone in float32 ((1 + w) - 1 for the norms, log(exp(A_log))), which need not give
    back the same bits."""
    out_dir.mkdir(parents=True, exist_ok=True)
    nxt = json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_next"
    tensors: dict[str, Any] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                value = f.get_tensor(name).float()
                if _quantized(name, tuple(value.shape), quant):
                    kind = tensor_type(name, quant)
                    q = _quantize(value.numpy(), kind)
                    values = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[kind])
                    value = torch.from_numpy(values.copy())
                if nxt and name.endswith(".A_log"):
                    value = torch.log(-torch.from_numpy(converted(name, value.numpy())))
                elif nxt and _stored_as_one_plus(name):
                    value = torch.from_numpy(converted(name, value.numpy())) - 1
                tensors[name] = value.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf_dir / extra).exists():
            (out_dir / extra).write_bytes((hf_dir / extra).read_bytes())
    return out_dir
