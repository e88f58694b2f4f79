"""How closely greedy tokens over 8-bit keys and values follow those over bf16 ones, on the demo model.

    python benchmarks/kv_agreement.py [--device cpu|cuda] [--tokens 64] [--kv fp8 int8] [--out results.jsonl]

An engine on the demo model with bf16 weights and activations: each of the prompts below (the beginnings of
Python code, what the model was trained on) decoded greedily for `--tokens` tokens with `--kv-dtype bf16`,
then with each 8-bit dtype asked for. For each: the share of positions whose token equals bf16's (position by
position, a divergence usually changing what follows), the mean number of tokens before the first difference,
and how many prompts gave bf16's tokens throughout. One JSON line a dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.default_model import default_model_dir
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import AddRequest, SamplingParams
from benchmarks.results import emit

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef read_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    'def parse_date(text):\n    """Parse an ISO date."""\n',
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
    "def merge_sorted(a, b):\n    result = []\n",
    "class Node:\n    def __init__(self, value, children=None):\n",
    "def is_prime(n):\n    if n < 2:\n",
    "import re\n\nPATTERN = re.compile(",
    "def flatten(items):\n    for item in items:\n",
    "def binary_search(values, target):\n    low, high = 0, len(values) - 1\n",
    "class Cache:\n    def get(self, key):\n",
    "def word_count(text):\n    counts = {}\n",
    "def transpose(matrix):\n",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n",
    "def retry(func, attempts=3):\n",
]


def greedy(core: EngineCore, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's `tokens` greedy tokens, all requests in the engine at once."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"p{i}", prompt, params))
    while core.has_work():
        outputs, _ = core.step()
        for o in outputs:
            out[o.request_id] += o.token_ids
    return [out[f"p{i}"] for i in range(len(prompts))]


def agreement(expected: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same = sum(
        a == b for want, have in zip(expected, got, strict=True) for a, b in zip(want, have, strict=True)
    )
    total = sum(len(want) for want in expected)
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), len(want))
        for want, have in zip(expected, got, strict=True)
    ]
    return {
        "position_agreement": same / total,
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "identical_prompts": sum(p == len(w) for p, w in zip(prefixes, expected, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kv", nargs="+", default=["fp8", "int8"])
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    demo = default_model_dir()
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]

    def engine(kv: str) -> EngineCore:
        config = EngineConfig(device=args.device, dtype="bfloat16", kv_dtype=kv, parallel=len(prompts))
        return EngineCore(config)

    expected = greedy(engine("bf16"), prompts, args.tokens)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for kv in args.kv:
        line = {"kv_dtype": kv, "against": "bf16", "prompts": len(prompts), "tokens": args.tokens}
        line |= agreement(expected, greedy(engine(kv), prompts, args.tokens)) | {"device": device}
        emit(line, args.out)


if __name__ == "__main__":
    main()
