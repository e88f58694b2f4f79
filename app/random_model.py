"""A tiny random qwen3_next checkpoint: the layout the demo model is trained from, and random weights for
benchmarks that need a model of a given shape rather than a trained one.

It is an ordinary HF directory (config.json, safetensors with one tensor per expert, tokenizer, chat template)
loaded by the normal path; it babbles.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.kernels.reference import REFERENCE
from app.loading.loader import tensor_sources
from app.models.config import ModelConfig
from app.models.qwen3 import CausalLM
from app.text.tiny import write_tiny_tokenizer

VOCAB = 512
EOS = 2  # <|im_end|> of the tiny tokenizer

CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "eos_token_id": EOS,
    "torch_dtype": "bfloat16",
}


def write_random_model(path: Path, seed: int = 0) -> None:
    """Write the checkpoint into a temporary sibling, then move it into place (safe if two start at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        (staging / "config.json").write_text(json.dumps(CONFIG, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS]}, indent=2))
        write_tiny_tokenizer(staging, vocab_size=VOCAB)
        config = ModelConfig.from_dict(CONFIG)
        model = CausalLM(config, mtp_layers=CONFIG["num_nextn_predict_layers"], backends=REFERENCE)
        randomize(model, seed)
        save_file(checkpoint_tensors(model, torch.bfloat16), str(staging / "model.safetensors"))
        os.replace(staging, path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def randomize(model: CausalLM, seed: int) -> None:
    """Random weights in the ranges trained models have (decays in (0, 1), unit-centred norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1, 16, generator=generator).log())
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            elif "norm" in name:
                continue
            else:
                fan_in = param.shape[-1] if param.dim() > 1 else 1
                param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)


def checkpoint_tensors(model: CausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights under HF checkpoint names (one tensor per expert), as contiguous `dtype` tensors."""
    params = dict(model.named_parameters())
    return {
        name: params[source.param][source.index].detach().to(dtype).contiguous()
        for name, source in tensor_sources(model).items()
    }
