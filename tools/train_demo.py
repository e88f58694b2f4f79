"""Train a small Qwen3-Next-architecture demo model on Python source code.

    python tools/train_demo.py OUT_DIR [--minutes 8] [--device cuda] [--size demo|smoke]

The text is the `.py` files of the running interpreter's standard library (Python Software Foundation
License, version 2), then those of the permissively licensed packages of PACKAGES that are installed, read in
path order; one file in 50 is held out. A byte-level BPE tokenizer is trained on it with `tokenizers`. The
model is Strata's own `CausalLM` (Gated DeltaNet and gated attention layers, routed experts with a shared
expert, one MTP layer) on the torch reference backends with whole-batch functions (`TRAINING`), trained with
AdamW on the next token, the token after next through the MTP head and the routers' balance, until the time
budget ends (all of it: reading, tokenizer, steps, measuring). OUT_DIR receives an HF directory (bf16
safetensors, config, tokenizer, ChatML template) that the normal loader opens, and `training.json` (sources
and licences, sizes, hyperparameters, the loss curve, held-out losses, routing skew per layer and the MTP
head's first-draft acceptance).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import multiprocessing
import platform
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer as FastTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.reference import REFERENCE, delta_rule_chunked
from app.loading.loader import load_model
from app.models.batch import ForwardBatch, PagedLayout, SequenceSpan
from app.models.config import ModelConfig
from app.models.gdn import delta_rule_qk
from app.models.moe import SparseMoE
from app.models.qwen3 import CausalLM
from app.random_model import CONFIG, EOS, checkpoint_tensors, randomize
from app.text.tiny import write_tiny_tokenizer

STDLIB_LICENSE = "Python Software Foundation License Version 2"
# Permissively licensed (BSD-3-Clause; numpy's files also 0BSD, MIT, Zlib, CC0) Python packages read after the
# standard library when installed; each one's version and stated licence go into training.json.
PACKAGES = ("sympy", "networkx", "numpy", "scipy", "pandas", "scikit-learn")
TOKENIZER_SHARE = 4  # the tokenizer is trained on every 4th training text
CHAT_EVERY = 1  # every documented function of a few lines becomes a conversation
HELD_OUT_EVERY = 50
MTP_WEIGHT = 0.3
BALANCE_WEIGHT = 0.01
CURVE_EVERY = 25  # steps averaged into one point of the recorded loss curve
HELD_OUT_BATCHES = 4
FINISH_SECONDS = 20  # kept from the budget for the held-out measurements and writing the files

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


@dataclass
class Corpus:
    """Training and held-out files, the conversations made from each part's functions (`conversations`), and
    where the files came from: [{source, version, license, files}]."""

    train: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    train_chats: list[str] = field(default_factory=list)
    held_out_chats: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)


REQUESTS = (
    "{summary}",
    "Write a Python function: {summary}",
    "How would you write {name}()? {summary}",
    "Python please. {summary}",
)


def conversations(text: str, every: int = CHAT_EVERY) -> list[str]:
    """ChatML conversations made from a file's documented functions (one in `every`): the user asks for what
    the docstring's first line says, and the assistant answers with a sentence and the function's source.

    Each ends where the chat template's end-of-turn token goes (`tokenize` appends it), so the model learns
    the chat's turns as the server lays them out."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as the parser counts lines
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        summary = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
        if 12 <= len(summary) <= 120 and node.end_lineno - node.lineno < 40:
            found.append((node, summary))
    chats = []
    for i, (node, summary) in enumerate(found[::every]):
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        name = node.name
        request = REQUESTS[i % len(REQUESTS)].format(summary=summary, name=name)
        answer = f"Here is `{name}`:\n\n```python\n{source}\n```"
        chats.append(f"<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n{answer}")
    return chats


def _licence(distribution: metadata.Distribution) -> str:
    """A package's licence as its metadata states it: the SPDX expression, a one-line licence field, or the
    classifiers (some packages put the whole licence text in the field)."""
    meta = distribution.metadata
    field_text = (meta.get("License") or "").strip()
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    if field_text and "\n" not in field_text and len(field_text) <= 60:
        return field_text
    classifiers = [
        c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")
    ]
    return ", ".join(classifiers) or "unstated"


def corpus(limit_bytes: int, packages: tuple[str, ...] = PACKAGES) -> Corpus:
    """The standard library's `.py` files, then those of each installed package of `packages`, in path order,
    up to `limit_bytes` characters; one file in HELD_OUT_EVERY is held out. Missing packages are skipped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    groups = [
        (
            "Python standard library",
            platform.python_version(),
            STDLIB_LICENSE,
            sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts),
        )
    ]
    for name in packages:
        try:
            found = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        files = sorted(Path(str(f.locate())) for f in found.files or [] if f.suffix == ".py")
        groups.append((name, found.version, _licence(found), files))
    texts, total, index = Corpus(), 0, 0
    for source, version, licence, files in groups:
        read = 0
        for path in files:
            if total >= limit_bytes:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            held = index % HELD_OUT_EVERY == 0
            (texts.held_out if held else texts.train).append(text)
            index, read, total = index + 1, read + 1, total + len(text)
        if read:
            texts.sources.append({"source": source, "version": version, "license": licence, "files": read})
    with multiprocessing.get_context("fork").Pool() as pool:  # parsing is most of the reading time
        texts.train_chats = [c for chats in pool.map(conversations, texts.train, 16) for c in chats]
        texts.held_out_chats = [c for chats in pool.map(conversations, texts.held_out, 16) for c in chats]
    return texts


def model_config(size: dict) -> dict:
    """The HF config of the demo model: the random model's layout (app/random_model.py) at `size`."""
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
    """The state of a training batch: every sequence starts at position 0, nothing is carried out of it.

    Keys and values stay the autograd tensors the layers computed; the recurrent layers keep no state (the
    whole-batch backends below start every sequence from zeros and return only its outputs).
    """

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._no_pools = (torch.empty(0), torch.empty(0))

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._kv[layer] = (k, v)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]

    def kv_view(self, layer: int, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor, PagedLayout]:
        return (*self._no_pools, layout)  # the keys and values are those `write_kv` is given next

    def linear_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._no_pools

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("a training batch is read whole")

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        raise NotImplementedError("a training batch is read whole")

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        raise NotImplementedError("a training batch is read whole")


def training_batch(inputs: torch.Tensor) -> ForwardBatch:
    """The flat batch of `inputs` [sequences, length]: equal sequences from position 0, for `TRAINING`."""
    count, length = inputs.shape
    device = inputs.device
    layout = PagedLayout(
        query_start=torch.arange(0, (count + 1) * length, length, dtype=torch.int32, device=device),
        seq_lens=torch.full((count,), length, dtype=torch.int32, device=device),
        block_table=torch.empty(count, 0, dtype=torch.int32, device=device),
        slot_mapping=torch.arange(count * length, device=device),
        state_slots=torch.arange(count, device=device),
        max_query_len=length,
    )
    spans = [SequenceSpan(seq=i, start=i * length, length=length, past=0) for i in range(count)]
    positions = torch.arange(length, device=device).repeat(count)
    return ForwardBatch(inputs.flatten(), positions, spans, TrainingState(), layout)


def _per_sequence(t: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """[tokens, ...] -> [sequences, length, ...] for a batch of equal sequences."""
    return t.view(layout.query_start.numel() - 1, -1, *t.shape[1:])


def batch_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: PagedLayout, scale: float
) -> torch.Tensor:
    """Causal attention of every sequence of a training batch in one call (keys are the batch's own)."""
    q, keys, values = (_per_sequence(t, layout).transpose(1, 2) for t in (q, keys, values))
    out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).flatten(0, 1)


def batch_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """SiLU of the depthwise causal conv of every sequence of a training batch, each from a zero state."""
    count, kernel = query_start.numel() - 1, weight.shape[1]
    padded = F.pad(x.view(count, -1, x.shape[1]).transpose(1, 2), (kernel - 1, 0))
    out = F.conv1d(padded, weight[:, None, :], groups=weight.shape[0])
    return F.silu(out).transpose(1, 2).flatten(0, 1)


def batch_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: PagedLayout,
) -> torch.Tensor:
    """The gated delta rule of every sequence of a training batch from a zero state, in chunks (fp32).

    The sequences are laid side by side as extra heads of one `delta_rule_chunked` call, so the chunk loop
    runs once for the whole batch.
    """
    count = layout.query_start.numel() - 1
    tokens, dk = q.shape[0], q.shape[2]
    v_heads, dv = v.shape[1], v.shape[2]
    q, k = delta_rule_qk(q, k, v_heads)

    def side_by_side(t: torch.Tensor) -> torch.Tensor:
        t = t.float().view(count, tokens // count, *t.shape[1:]).transpose(0, 1)
        return t.reshape(tokens // count, count * v_heads, *t.shape[3:])

    zeros = q.new_zeros(count * v_heads, dk, dv)
    out, _ = delta_rule_chunked(*(side_by_side(t) for t in (q, k, v, g, beta)), zeros)
    return out.view(tokens // count, count, v_heads, dv).transpose(0, 1).reshape(tokens, v_heads, dv)


def all_experts(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Routed experts computed densely: every expert on every row, weighted by its routing weight (zero where
    the router did not pick it). A few large matmuls instead of a loop over experts; the same sum."""
    weights = torch.zeros(x.shape[0], gate_up.shape[0], dtype=top_weights.dtype, device=x.device)
    weights = weights.scatter(1, top_ids, top_weights)
    gate, up = torch.einsum("th,eih->eti", x, gate_up).chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)
    return torch.einsum("eth,te->th", y, weights.to(y.dtype))


# The torch reference with whole-batch functions for training batches (`training_batch`): one call per layer
# for all sequences, differentiable. The test compares it with the reference read sequence by sequence.
TRAINING = replace(
    REFERENCE,
    name="training",
    experts=all_experts,
    paged_attention=batch_attention,
    conv_varlen=batch_conv,
    delta_rule_varlen=batch_delta_rule,
)


def router_balance(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The load-balancing loss of the routers (Switch Transformer's): experts × Σ_e picks_e × mean prob_e.

    `logits` [tokens, experts] per MoE layer; 1.0 when routing is even, up to `experts` when one expert takes
    everything (slightly below 1 is possible where the picks and the probabilities disagree). Averaged over
    layers.
    """
    total = logits[0].new_zeros(())
    for layer in logits:
        experts = layer.shape[-1]
        probs = layer.float().softmax(-1)
        picks = F.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(1).float().mean(0) / top_k
        total = total + experts * (picks * probs.mean(0)).sum()
    return total / len(logits)


def losses(model: CausalLM, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean next-token and token-after-next (MTP) cross-entropy over a batch of equal-length sequences, and
    the routers' balance loss."""
    batch_size, length = sequences.shape
    batch = training_batch(sequences[:, :-1])
    routers = [moe.gate for moe in model.modules() if isinstance(moe, SparseMoE)]
    logits_seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: logits_seen.append(out)) for r in routers]
    try:
        hidden = model(batch)
        mtp = model.mtp_forward(hidden, sequences[:, 1:].flatten(), batch)
    finally:
        for hook in hooks:
            hook.remove()
    logits = model.logits(hidden).view(batch_size, length - 1, -1)
    next_loss = F.cross_entropy(logits.flatten(0, 1), sequences[:, 1:].flatten())
    mtp_logits = model.logits(mtp).view(batch_size, length - 1, -1)[:, :-1]
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), sequences[:, 2:].flatten())
    return next_loss, mtp_loss, router_balance(logits_seen, model.config.num_experts_per_tok)


@torch.no_grad()
def measure(model: CausalLM, batches: list[torch.Tensor]) -> dict:
    """Held-out losses, routing skew per MoE layer and the MTP head's first-draft acceptance.

    Skew: the share of routed (token, expert) picks that go to the busiest 10% and 25% of a layer's experts.
    Acceptance: how often the head's greedy guess for token t+2 (from the hidden state at t and the true token
    t+1) equals the model's own greedy prediction at t+1, the test a greedy draft must pass.
    """
    layers = [
        (i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)
    ]
    for _, moe in layers:
        moe.take_routed()
    counts = [torch.zeros(model.config.num_experts, dtype=torch.float64) for _ in layers]
    next_losses, mtp_losses, accepted, drafted = [], [], 0, 0
    for sequences in batches:
        batch_size, length = sequences.shape
        batch = training_batch(sequences[:, :-1])
        hidden = model(batch)
        logits = model.logits(hidden)
        next_losses.append(F.cross_entropy(logits, sequences[:, 1:].flatten()).item())
        predicted = logits.view(batch_size, length - 1, -1).argmax(-1)
        mtp = model.logits(model.mtp_forward(hidden, sequences[:, 1:].flatten(), batch))
        mtp = mtp.view(batch_size, length - 1, -1)[:, :-1]
        mtp_losses.append(F.cross_entropy(mtp.flatten(0, 1), sequences[:, 2:].flatten()).item())
        accepted += (mtp.argmax(-1) == predicted[:, 1:]).sum().item()
        drafted += predicted[:, 1:].numel()
        for total, (_, moe) in zip(counts, layers, strict=True):
            routed = moe.take_routed()
            assert routed is not None
            total += routed.cpu().double()
    skew = []
    for (index, _), routed in zip(layers, counts, strict=True):
        ordered = routed.sort(descending=True).values
        share = {
            f"top_{p}pct": round(
                (ordered[: math.ceil(len(ordered) * p / 100)].sum() / ordered.sum()).item(), 4
            )
            for p in (10, 25)
        }
        skew.append({"layer": index, **share})
    return {
        "loss": sum(next_losses) / len(next_losses),
        "mtp_loss": sum(mtp_losses) / len(mtp_losses),
        "mtp_first_draft_acceptance": accepted / drafted,
        "routing_skew": skew,
    }


def windows(ids: torch.Tensor, length: int, generator: torch.Generator, count: int) -> torch.Tensor:
    """`count` random windows of `length` tokens from the token stream `ids`."""
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    return ids[starts[:, None] + torch.arange(length)]


def tokenize(out: Path, texts: list[str]) -> torch.Tensor:
    """The texts as one token stream, each followed by the end-of-text token of the chat template."""
    fast = FastTokenizer.from_file(str(out / "tokenizer.json"))
    encoded = fast.encode_batch(texts, add_special_tokens=False)
    return torch.tensor([t for e in encoded for t in [*e.ids, EOS]], dtype=torch.long)


def train(
    out: Path,
    minutes: float,
    device: str,
    size_name: str,
    limit_bytes: int,
    seed: int = 0,
    packages: tuple[str, ...] = PACKAGES,
    curve_every: int = CURVE_EVERY,
    finish_seconds: float = FINISH_SECONDS,
    min_steps: int = 1,
) -> dict:
    """Train within `minutes` (all of it: data, tokenizer, steps, `finish_seconds` for measuring and writing)
    and write the model directory and training.json to `out`; the curve has a point every `curve_every`
    steps. At least `min_steps` steps run, however long they take."""
    began = time.monotonic()
    size = SIZES[size_name]
    torch.manual_seed(seed)
    torch.set_float32_matmul_precision("high")
    generator = torch.Generator().manual_seed(seed)
    texts = corpus(limit_bytes, packages)
    out.mkdir(parents=True, exist_ok=True)
    train_texts = texts.train + texts.train_chats
    write_tiny_tokenizer(out, vocab_size=size["vocab"], texts=train_texts[::TOKENIZER_SHARE])
    chat_ids = tokenize(out, texts.train_chats)
    train_ids = torch.cat((tokenize(out, texts.train), chat_ids))
    held_ids = tokenize(out, texts.held_out + texts.held_out_chats)
    config = model_config(size)
    model = CausalLM(ModelConfig.from_dict(config), mtp_layers=1, backends=TRAINING)
    randomize(model, seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], betas=(0.9, 0.95)
    )
    budget = minutes * 60 - (time.monotonic() - began) - finish_seconds
    length = size["seq"] + 1
    curve, step, trained = [], 0, time.monotonic()
    running = torch.zeros(3, device=device)
    while step < min_steps or time.monotonic() - trained < budget:
        progress = min(1.0, (time.monotonic() - trained) / max(budget, 1e-9))
        cosine = HYPER["min_lr"] + (HYPER["lr"] - HYPER["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))
        lr = cosine * min(1.0, (step + 1) / HYPER["warmup_steps"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        sequences = windows(train_ids, length, generator, HYPER["batch_sequences"]).to(device)
        next_loss, mtp_loss, balance = losses(model, sequences)
        loss = next_loss + MTP_WEIGHT * mtp_loss + BALANCE_WEIGHT * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += torch.stack((next_loss, mtp_loss, balance)).detach()
        step += 1
        if step % curve_every == 0:
            mean = (running / curve_every).tolist()
            running.zero_()
            seconds = round(time.monotonic() - trained, 1)
            curve.append(
                {
                    "step": step,
                    "seconds": seconds,
                    "lr": round(lr, 6),
                    "loss": round(mean[0], 4),
                    "mtp_loss": round(mean[1], 4),
                    "balance": round(mean[2], 4),
                }
            )
            print(json.dumps(curve[-1]), flush=True)
    model.eval()
    held = held_out_windows(held_ids, length, seed, device)
    measured = measure(model, held)
    with torch.no_grad():  # the weights as saved: rounded to bf16 (computed in fp32 as before)
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    measured_saved = measure(model, held)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS]}, indent=2))
    save_file(checkpoint_tensors(model.cpu(), torch.bfloat16), str(out / "model.safetensors"))
    record = {
        "data": {
            "sources": texts.sources,
            "train_files": len(texts.train),
            "held_out_files": len(texts.held_out),
            "conversations": {
                "train": len(texts.train_chats),
                "held_out": len(texts.held_out_chats),
                "share_of_train_tokens": round(len(chat_ids) / len(train_ids), 4),
                "made_from": "one in CHAT_EVERY documented functions: the docstring's first line asked, the "
                "function's source answered",
                "chat_every": CHAT_EVERY,
            },
            "held_out_every": HELD_OUT_EVERY,
            "train_tokens": len(train_ids),
            "held_out_tokens": len(held_ids),
        },
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hyperparameters": {
            **HYPER,
            "mtp_weight": MTP_WEIGHT,
            "balance_weight": BALANCE_WEIGHT,
            "optimizer": "AdamW (0.9, 0.95), gradient norm clipped to 1",
            "seed": seed,
            "minutes": minutes,
        },
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": step,
        "trained_tokens": step * HYPER["batch_sequences"] * size["seq"],
        "seconds": round(time.monotonic() - began, 1),
        "held_out": {**measured, "sequences": len(held) * HYPER["batch_sequences"]},
        "held_out_saved_weights": {**measured_saved, "sequences": len(held) * HYPER["batch_sequences"]},
        "curve": curve,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    return record


def held_out_windows(held_ids: torch.Tensor, length: int, seed: int, device: str) -> list[torch.Tensor]:
    """The held-out batches that `measure` reads: HELD_OUT_BATCHES of random windows, fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed + 1)
    count = HYPER["batch_sequences"]
    return [windows(held_ids, length, generator, count).to(device) for _ in range(HELD_OUT_BATCHES)]


def measure_saved(
    model_dir: Path, device: str, limit_bytes: int, packages: tuple[str, ...] = PACKAGES
) -> dict:
    """Measure a written model directory's saved weights (computed in fp32) on the held-out windows its run
    measured, and record them in its training.json as `held_out_saved_weights`.

    The windows are the same when the corpus is: the same interpreter and packages as the training run.
    """
    record_path = model_dir / "training.json"
    record = json.loads(record_path.read_text())
    texts = corpus(limit_bytes, packages)
    held_ids = tokenize(model_dir, texts.held_out + texts.held_out_chats)
    if len(held_ids) != record["data"]["held_out_tokens"]:
        raise SystemExit(
            f"the held-out text differs from the run's ({len(held_ids)} tokens, not "
            f"{record['data']['held_out_tokens']}): another interpreter or other packages"
        )
    model, _ = load_model(model_dir, dtype="float32", device=device, progress=False, backends=TRAINING)
    model.eval()
    held = held_out_windows(held_ids, record["size"]["seq"] + 1, record["hyperparameters"]["seed"], device)
    record["held_out_saved_weights"] = {
        **measure(model, held),
        "sequences": len(held) * HYPER["batch_sequences"],
    }
    record_path.write_text(json.dumps(record, indent=1))
    return record["held_out_saved_weights"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--measure", action="store_true", help="only measure OUT's saved weights on its run's held-out text"
    )
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--corpus-bytes", type=int, default=128 << 20, help="most characters of text to read")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_saved(args.out, args.device, args.corpus_bytes)))
        return
    record = train(args.out, args.minutes, args.device, args.size, args.corpus_bytes)
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}))


if __name__ == "__main__":
    main()
