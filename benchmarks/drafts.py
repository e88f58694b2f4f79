"""Drafts against none: aggregate tok/s and tokens a decoding slot gains a window, per draft source and
concurrency, one JSON line each (`strata bench`'s scenario: random prompts, greedy, ignore_eos).

    python benchmarks/drafts.py [--model DIR] [--concurrency 1 4 8] [--spec off ngram mtp]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.bench import run_bench
from app.default_model import default_model_dir
from app.engine.config import EngineConfig

KEYS = (
    "spec",
    "concurrency",
    "aggregate_tok_s",
    "per_request_tok_s_mean",
    "tokens_per_slot_window",
    "draft_tokens",
    "draft_tokens_accepted",
    "windows",
    "step_ms_p50_decode_windows",
    "itl_p50_s",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--spec", nargs="+", default=["off", "ngram", "mtp"])
    parser.add_argument("--spec-tokens", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", help="append the whole summaries to this JSON-lines file")
    args = parser.parse_args()
    for concurrency in args.concurrency:  # each source beside the others at one concurrency: less drift
        for spec in args.spec:
            config = EngineConfig(
                model=args.model, parallel=max(args.concurrency), spec=spec, spec_tokens=args.spec_tokens
            )
            summary = {"spec": spec, **run_bench(config, concurrency, args.prompt_len, args.output_len)}
            print(json.dumps({k: summary.get(k) for k in KEYS}), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
