"""Train a small Qwen3-Next-architecture demo model on the Python standard library's source.

    python tools/train_demo.py OUT_DIR [--minutes 8] [--device cuda] [--size demo|smoke]

The text is the `.py` files of the running interpreter's standard library (the Python Software Foundation
License, version 2: free to use, copy and redistribute), read in sorted order; one file in 50 is held out.
A byte-level BPE tokenizer is trained on it with `tokenizers`. The model is Strata's own `CausalLM`
(Gated DeltaNet and gated attention layers, routed experts with a shared expert, one MTP layer) on the torch
reference backends, trained with AdamW on the next token plus the token after next through the MTP head,
until the time budget ends. OUT_DIR receives an HF directory (bf16 safetensors, config, tokenizer, ChatML
template) that the normal loader opens, and `training.json` (data, licence, sizes, hyperparameters, the loss
curve, held-out losses, routing skew per layer and the MTP head's first-draft acceptance).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.default_model import CONFIG, EOS, checkpoint_tensors, randomize
from app.models.batch import ForwardBatch, SequenceSpan
from app.models.config import ModelConfig
from app.models.moe import SparseMoE
from app.models.qwen3 import CausalLM
from app.text.tiny import write_tiny_tokenizer
from app.text.tokenizer import Tokenizer

LICENSE = "Python Software Foundation License Version 2 (the Python standard library)"
HELD_OUT_EVERY = 50
MTP_WEIGHT = 0.3

# Head dimensions are powers of two, as the GPU kernels need; the demo's bf16 weights stay under 40 MB.
SIZES = {
    "demo": {
        "vocab": 4096,
        "hidden": 256,
        "head": 64,
        "layers": 8,
        "experts": 16,
        "top_k": 4,
        "moe": 128,
        "seq": 512,
    },
    "smoke": {
        "vocab": 512,
        "hidden": 64,
        "head": 16,
        "layers": 4,
        "experts": 8,
        "top_k": 2,
        "moe": 32,
        "seq": 64,
    },
}
HYPER = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 50, "weight_decay": 0.1, "batch_sequences": 32}


def corpus(limit_bytes: int) -> tuple[list[str], list[str]]:
    """Training and held-out texts: the standard library's `.py` files, in path order, up to `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out, total = [], [], 0
    for i, path in enumerate(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        (held_out if i % HELD_OUT_EVERY == 0 else train).append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return train, held_out


def model_config(size: dict) -> dict:
    """The HF config of the demo model: the default model's layout (app/default_model.py) at `size`."""
    return {
        **CONFIG,
        "vocab_size": size["vocab"],
        "hidden_size": size["hidden"],
        "intermediate_size": 2 * size["hidden"],
        "num_hidden_layers": size["layers"],
        "head_dim": size["head"],
        "linear_key_head_dim": size["head"],
        "linear_value_head_dim": size["head"],
        "num_experts": size["experts"],
        "num_experts_per_tok": size["top_k"],
        "moe_intermediate_size": size["moe"],
        "shared_expert_intermediate_size": size["moe"],
    }


class TrainingState:
    """The sequence state of one training batch: keys, values and recurrent state kept with autograd."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._linear: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._kv[(layer, span.seq)] = (k, v)  # every span starts its sequence (past 0)
        return k, v

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._linear.get((layer, seq), (None, None))

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self._linear[(layer, seq)] = (conv, recurrent)


def losses(model: CausalLM, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token and token-after-next (MTP) cross-entropy over a batch of equal-length sequences."""
    batch_size, length = sequences.shape
    inputs = sequences[:, :-1]
    batch = ForwardBatch.build(
        [(i, row.tolist(), 0) for i, row in enumerate(inputs)], TrainingState(), sequences.device
    )
    hidden = model(batch)
    logits = model.logits(hidden).view(batch_size, length - 1, -1)
    next_loss = F.cross_entropy(logits.flatten(0, 1), sequences[:, 1:].flatten())
    mtp = model.mtp_forward(hidden, sequences[:, 1:].flatten(), batch)
    mtp_logits = model.logits(mtp).view(batch_size, length - 1, -1)[:, :-1]
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), sequences[:, 2:].flatten())
    return next_loss, mtp_loss


@torch.no_grad()
def measure(model: CausalLM, sequences: torch.Tensor) -> dict:
    """Routing skew per MoE layer and the MTP head's first-draft acceptance on held-out sequences.

    Skew: the share of routed (token, expert) picks that go to the busiest 10% and 25% of a layer's experts.
    Acceptance: how often the head's greedy guess for token t+2 (from the hidden state at t and the true token
    t+1) equals the model's own greedy prediction at t+1, the test a greedy draft must pass.
    """
    layers = [
        (i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)
    ]
    for _, moe in layers:
        moe.take_routed()
    batch_size, length = sequences.shape
    batch = ForwardBatch.build(
        [(i, row.tolist(), 0) for i, row in enumerate(sequences[:, :-1])], TrainingState(), sequences.device
    )
    hidden = model(batch)
    predicted = model.logits(hidden).view(batch_size, length - 1, -1).argmax(-1)
    mtp = model.logits(model.mtp_forward(hidden, sequences[:, 1:].flatten(), batch))
    drafts = mtp.view(batch_size, length - 1, -1).argmax(-1)
    acceptance = (drafts[:, :-1] == predicted[:, 1:]).float().mean().item()
    skew = []
    for index, moe in layers:
        routed = moe.take_routed()
        assert routed is not None
        counts = routed.sort(descending=True).values.double()
        experts = counts.numel()
        share = {
            f"top_{p}pct": (counts[: math.ceil(experts * p / 100)].sum() / counts.sum()).item()
            for p in (10, 25)
        }
        skew.append({"layer": index, **share})
    return {"routing_skew": skew, "mtp_first_draft_acceptance": acceptance}


def windows(ids: list[int], length: int, rng: random.Random, count: int) -> torch.Tensor:
    """`count` random windows of `length` tokens from the token stream."""
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return torch.tensor([ids[s : s + length] for s in starts], dtype=torch.long)


def train(out: Path, minutes: float, device: str, size_name: str, limit_bytes: int, seed: int = 0) -> dict:
    """Train within `minutes` and write the model directory and training.json to `out`."""
    began = time.monotonic()
    size = SIZES[size_name]
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train_texts, held_texts = corpus(limit_bytes)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out, vocab_size=size["vocab"], texts=train_texts)
    tokenizer = Tokenizer.from_dir(out)
    separator = [EOS]
    train_ids = [t for text in train_texts for t in [*tokenizer.encode(text), *separator]]
    held_ids = [t for text in held_texts for t in [*tokenizer.encode(text), *separator]]
    config = model_config(size)
    model = CausalLM(ModelConfig.from_dict(config), mtp_layers=1)
    randomize(model, seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], betas=(0.9, 0.95)
    )
    budget = minutes * 60 - (time.monotonic() - began)
    length = size["seq"] + 1
    curve, step, trained = [], 0, time.monotonic()
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    while time.monotonic() - trained < budget:
        progress = (time.monotonic() - trained) / budget
        lr = HYPER["lr"] * min(1.0, (step + 1) / HYPER["warmup_steps"])
        lr = max(HYPER["min_lr"], lr * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        sequences = windows(train_ids, length, rng, HYPER["batch_sequences"]).to(device)
        with autocast:
            next_loss, mtp_loss = losses(model, sequences)
        loss = next_loss + MTP_WEIGHT * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        curve.append(
            {
                "step": step,
                "seconds": round(time.monotonic() - trained, 2),
                "loss": next_loss.item(),
                "mtp_loss": mtp_loss.item(),
                "lr": lr,
            }
        )
        step += 1
    model.eval()
    with torch.no_grad(), autocast:
        held = windows(held_ids, length, random.Random(seed + 1), HYPER["batch_sequences"]).to(device)
        held_next, held_mtp = losses(model, held)
        measured = measure(model, held)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS]}, indent=2))
    save_file(checkpoint_tensors(model.cpu(), torch.bfloat16), str(out / "model.safetensors"))
    stdlib = sysconfig.get_paths()["stdlib"]
    record = {
        "data": f"{len(train_texts)} training and {len(held_texts)} held-out .py files of {stdlib}",
        "license": LICENSE,
        "tokens": {"train": len(train_ids), "held_out": len(held_ids)},
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hyperparameters": {**HYPER, "mtp_weight": MTP_WEIGHT, "seed": seed, "minutes": minutes},
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "steps": step,
        "seconds": round(time.monotonic() - began, 1),
        "held_out": {"loss": held_next.item(), "mtp_loss": held_mtp.item(), **measured},
        "curve": curve,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--corpus-bytes", type=int, default=40 << 20, help="standard-library text to read")
    args = parser.parse_args()
    record = train(args.out, args.minutes, args.device, args.size, args.corpus_bytes)
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}))


if __name__ == "__main__":
    main()
