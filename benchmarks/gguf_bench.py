"""Quantized GGUF files on one GPU: a random-weight Qwen3-30B-A3B-shaped file of one quant type, served by
Strata's engine (its blocks dequantized in the kernels' programs) and timed as llama.cpp is on the same file.

    python benchmarks/gguf_bench.py write --kind Q4_K --out /tmp/q30-Q4_K.gguf [--layers 24]
    python benchmarks/gguf_bench.py strata --model /tmp/q30-Q4_K.gguf [--expert-cache 32]
        [--expert-placement spread|layers] [--pcie-frac F] [--phases] [--out out.jsonl]

`write`: every matrix of the shape as random blocks of the type (values about +-0.05; the router and the
norms in F32, as llama.cpp's converter keeps them), a byte-level BPE tokenizer of the shape's vocabulary, the
metadata llama.cpp's `qwen3moe` reads. `strata`: the file loaded as `strata serve` loads it, then decode
tok/s at batch 1, 8 and 32 and an 8K-token prompt read in one window (benchmarks/gpu_bench.py's timings),
beside the roofline of the bytes a step reads at the measured copy bandwidth (a figure above the card's
specified bandwidth stops the run). With `--expert-cache N` every MoE layer keeps N experts on the card (an
expert tier: the others' blocks in pinned host RAM, misses computed by the CPU pool or copied over PCIe), and
each figure says where its routed entries were served (`--expert-placement` and `--pcie-frac` as `strata
serve` takes them); `--phases` times batch-1 decode only, with the host's time a tiered layer by phase and
the device's by kernel (benchmarks/expert_tier.py's `--phases`). benchmarks/llama_cpp.sh times llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.kernels.gguf_quants import DEQUANTIZE, random_blocks
from app.models.placement import PLACEMENTS
from benchmarks.byte_tokenizer import write_byte_tokenizer
from benchmarks.gpu_bench import DECODE_BATCHES, PREFILL_LEN, _decode, _prefill
from benchmarks.roofline import H200_HBM_BANDWIDTH, measure_copy_bandwidth
from benchmarks.shapes import shape


def _matrices(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """llama.cpp's name -> HF-order shape of every matrix of a qwen3moe model (experts stacked)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    out = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        out |= {
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate_exps.weight": (experts, inter, hidden),
            f"blk.{i}.ffn_up_exps.weight": (experts, inter, hidden),
            f"blk.{i}.ffn_down_exps.weight": (experts, hidden, inter),
        }
    return out


def _vectors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The F32 tensors: norms (ones) and the router (random)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out: dict[str, tuple[int, ...]] = {"output_norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        out |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q_norm.weight": (head_dim,),
            f"blk.{i}.attn_k_norm.weight": (head_dim,),
            f"blk.{i}.ffn_gate_inp.weight": (config["num_experts"], hidden),
        }
    return out


def _add_tokenizer(writer: Any, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens (the last one the end of text) as GGUF's token metadata."""
    with tempfile.TemporaryDirectory() as scratch:
        write_byte_tokenizer(Path(scratch), vocab_size - 1)
        model = json.loads((Path(scratch) / "tokenizer.json").read_text())["model"]
    tokens = [*sorted(model["vocab"], key=model["vocab"].__getitem__), "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_eos_token_id(len(tokens) - 1)


def matrix_type(name: str, kind: str) -> str:
    """The quant type of matrix `name` in a file of `kind`: a type, or Q4_K_M (Q4_K, the down projections
    and the LM head Q6_K, as llama.cpp's mix gives them)."""
    if kind != "Q4_K_M":
        return kind
    return "Q6_K" if "ffn_down" in name or name == "output.weight" else "Q4_K"


def write_file(path: Path, kind: str, layers: int, seed: int = 0) -> dict[str, Any]:
    """Write the q30 shape cut to `layers` as a GGUF file of quant type `kind` (or the Q4_K_M mix); returns
    the config."""
    import gguf
    import numpy as np

    config = shape("q30", layers=layers)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(config.get("rope_theta", 1e6)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    _add_tokenizer(writer, config["vocab_size"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, (name, dims) in enumerate(_matrices(config).items()):
        kind_here = matrix_type(name, kind)
        blocks = random_blocks(kind_here, dims, seed + i, device=device).cpu().numpy()
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind_here])
    g = torch.Generator().manual_seed(seed)
    for name, dims in _vectors(config).items():
        router = name.endswith("ffn_gate_inp.weight")
        value = torch.randn(dims, generator=g) * 0.02 if router else torch.ones(dims)
        writer.add_tensor(name, value.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config


def step_bytes(core: EngineCore, batch: int) -> float:
    """The bytes a decode step of `batch` rows must read at least: every weight but the embedding and the
    routed experts, plus the experts `batch` tokens pick at random (expected distinct picks a layer)."""
    model = core.loaded.model
    config = model.config
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= embed.numel() * embed.element_size()
    experts = 0
    for layer in model.model.layers:  # a tier's experts in host RAM too: a step reads them from there
        experts += sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters())
    share = 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch
    return total - experts * (1 - share)


class ServedShares:
    """Where the tiers served the routed entries between two `take` calls: the counts the engine's own expert
    reports carried (a report takes the tiers' counts: the Monitor's) plus what the tiers still hold. Counts
    the windows of `core.step`, which it wraps."""

    PLACES = ("vram", "cpu", "pcie")  # TierCounts.served's order

    def __init__(self, core: EngineCore) -> None:
        self.core, self.counts = core, [0] * len(self.PLACES)
        step = core.step

        def counted() -> Any:
            outputs, stats = step()
            if stats is not None and stats.experts is not None:
                self.counts = [a + b for a, b in zip(self.counts, stats.experts.served_total(), strict=True)]
            return outputs, stats

        core.step = counted  # type: ignore[method-assign]

    def take(self) -> dict[str, float]:
        """The shares since the last call (none without a tier)."""
        held = [t.take_counts().served for t in self.core.tiers]
        counts = [sum(column) for column in zip(self.counts, *held, strict=True)]
        self.counts = [0] * len(self.PLACES)
        total = sum(counts)
        if not total:
            return {}
        return {f"{where}_share": counts[i] / total for i, where in enumerate(self.PLACES)}


def open_core(path: Path, expert_cache: int | None = None, **tier: Any) -> EngineCore:
    """An engine core on the GPU serving the file (`expert_cache` experts a layer on it, frozen, laid out and
    split as `tier`'s EngineConfig fields say), for up to the largest decode batch timed and an 8K prompt."""
    engine = EngineConfig(
        model=str(path),
        expert_cache=expert_cache,
        adapt_every=0,
        **tier,
        device="cuda",
        dtype="bfloat16",
        parallel=max(DECODE_BATCHES),
        max_batched_tokens=PREFILL_LEN,
        kv_memory=8 << 30,
        max_model_len=PREFILL_LEN + 64,
    )
    return EngineCore(engine)


def run_strata(
    path: Path, expert_cache: int | None = None, phases: bool = False, **tier: Any
) -> dict[str, Any]:
    """Load the file into an engine core on the GPU (`open_core`) and time decode and an 8K prompt, or with
    `phases` batch-1 decode by phase (a tier's)."""
    began = time.perf_counter()
    core = open_core(path, expert_cache, **tier)
    torch.cuda.synchronize()
    vocab = core.loaded.model.config.vocab_size
    held = sum(p.numel() for p in core.loaded.model.parameters() if p.dtype == torch.uint8)
    bandwidth = measure_copy_bandwidth("cuda")
    result: dict[str, Any] = {
        "backends": core.backends.name,
        "start_s": time.perf_counter() - began,
        "held_gb": held / 1e9,
        "weights_gb": sum(p.numel() * p.element_size() for p in core.loaded.model.parameters()) / 1e9,
        "copy_gb_s": bandwidth / 1e9,
    }
    costs = core.tiers[0].costs if core.tiers else None
    if costs is not None:  # the miss costs the tier measured at start
        result |= {
            "pcie_gb_s": costs.pcie_bytes_s / 1e9,
            "cpu_gb_s": costs.cpu_bytes_s / 1e9,
            "cpu_call_us": costs.cpu_call_s * 1e6,
        }
    if phases:
        if not core.tiers:
            raise SystemExit("--phases times a tier's layers: give --expert-cache")
        from benchmarks.expert_tier import phases as phase_times

        return result | phase_times(core, core.tiers, vocab, warm=4)
    served = ServedShares(core)
    for batch in DECODE_BATCHES:
        served.take()
        timed = _decode(core, batch, vocab) | served.take()
        timed["roofline_tok_s"] = batch * bandwidth / step_bytes(core, batch)
        if timed["tok_s"] > batch * H200_HBM_BANDWIDTH / step_bytes(core, batch):
            raise RuntimeError(f"batch {batch}: {timed['tok_s']:.0f} tok/s reads faster than the card can")
        result[f"decode_bs{batch}"] = timed
    served.take()
    result["prefill_8k"] = _prefill(core, vocab) | served.take()
    return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write")
    write.add_argument("--kind", choices=[*DEQUANTIZE, "Q4_K_M"], required=True)
    write.add_argument("--out", type=Path, required=True)
    write.add_argument("--layers", type=int, default=24)
    strata = sub.add_parser("strata")
    strata.add_argument("--model", type=Path, required=True)
    strata.add_argument("--expert-cache", type=int, help="experts a layer on the card (an expert tier)")
    strata.add_argument("--expert-placement", default="spread", choices=PLACEMENTS)
    strata.add_argument("--pcie-frac", type=float, help="force this share of the misses over PCIe")
    strata.add_argument("--phases", action="store_true", help="batch-1 decode by phase")
    strata.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        began = time.perf_counter()
        write_file(args.out, args.kind, args.layers)
        size = args.out.stat().st_size
        print(f"wrote {args.out} ({size / 1e9:.2f} GB) in {time.perf_counter() - began:.0f} s", flush=True)
        return
    line = {
        "model": args.model.name,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "expert_cache": args.expert_cache,
        "expert_placement": args.expert_placement,
        "pcie_frac": args.pcie_frac,
        **run_strata(
            args.model,
            args.expert_cache,
            args.phases,
            expert_placement=args.expert_placement,
            pcie_frac=args.pcie_frac,
        ),
    }
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
