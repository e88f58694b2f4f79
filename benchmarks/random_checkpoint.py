"""Full-size random-weight HF directories on disk, for benchmarks that start `strata serve` like a user would.

    python benchmarks/random_checkpoint.py --shape q30-half /tmp/q30-half [--layers N] [--context TOKENS]
        [--drawn-on-load]

Writes config.json, a word-level tokenizer covering the vocabulary, and one safetensors shard per decoder
layer (plus one for the rest) with `model.safetensors.index.json`, under HF's tensor names (one tensor per
expert). Weights are drawn on the GPU when there is one: N(0, 0.02) for matrices, the ranges trained models
have for the Gated DeltaNet decays, and norms as initialised (1, or 0 for Qwen3-Next's (1 + w) norms). With
`--drawn-on-load` no weight file is written: the directory's weights are drawn as they load
(app/loading/random_weights.py), for shapes larger than the disk (Qwen3-Next-80B-A3B's 48 layers, 160 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.loading.random_weights import draw, tensor_shapes, write_marker
from app.models.config import ModelConfig
from benchmarks.byte_tokenizer import write_byte_tokenizer
from benchmarks.shapes import shape


def write_config_and_tokenizer(path: Path, config: dict[str, Any]) -> None:
    """config.json and a word-level tokenizer ("t0" .. "tN") covering the vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def write_random_checkpoint(path: Path, config: dict[str, Any], seed: int = 0) -> int:
    """Write the directory; returns the bytes of weights written."""
    from safetensors.torch import save_file

    write_config_and_tokenizer(path, config)
    model_config = ModelConfig.from_dict(config)
    shapes = tensor_shapes(model_config, int(config.get("num_nextn_predict_layers", 0)))
    shards: dict[str, list[str]] = defaultdict(list)
    for name in shapes:
        parts = name.split(".")
        shards[f"layer-{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"].append(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map, written = {}, 0
    for shard, names in sorted(shards.items()):
        tensors = {}
        for name in names:
            value = draw(name, shapes[name], model_config.offset_norm, generator)
            tensors[name] = value.to(torch.bfloat16).cpu()
            written += tensors[name].numel() * 2
        file = f"{shard}.safetensors"
        save_file(tensors, str(path / file))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": written}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--shape", default="q30-half", help="q30, q30-half or qnext")
    parser.add_argument("--layers", type=int, help="cut the shape to this many layers")
    parser.add_argument("--context", type=int, help="positions the model takes (the weights being random)")
    parser.add_argument(
        "--byte-tokenizer",
        action="store_true",
        help="a byte-level BPE tokenizer of the vocabulary's size (benchmarks/byte_tokenizer.py) instead of "
        "the word-level one, for structured output",
    )
    parser.add_argument("--drawn-on-load", action="store_true", help="no weight files: drawn as they load")
    args = parser.parse_args()
    began = time.perf_counter()
    config = shape(args.shape, layers=args.layers)
    if args.context:
        config["max_position_embeddings"] = args.context
    if args.drawn_on_load:
        write_config_and_tokenizer(args.path, config)
        write_marker(args.path)
        written = 0
    else:
        written = write_random_checkpoint(args.path, config)
    if args.byte_tokenizer:
        write_byte_tokenizer(args.path, config["vocab_size"])
    print(f"wrote {written / 1e9:.1f} GB to {args.path} in {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
