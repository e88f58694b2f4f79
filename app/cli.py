"""The `strata` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from app.errors import StrataError


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory (default: the tiny built-in demo model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weight dtype (auto: the checkpoint's)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="strata", description="Serve Mixture-of-Experts language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from a prompt")
    _add_model_options(gen)
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: 'Hello')")
    prompt.add_argument("--prompt-token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token_ids and text")
    return parser


def run_generate(args: argparse.Namespace) -> None:
    """`strata generate`: load the model, read the prompt, print the continuation."""
    import torch

    from app.default_model import default_model_dir
    from app.generate import SamplingParams, generate_tokens
    from app.loading.model import open_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise StrataError("--device cuda: no CUDA device is available")
    if args.chat and args.prompt_token_ids is not None:
        raise StrataError("--chat takes --prompt text, not --prompt-token-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos
    )
    params.validate()
    loaded = open_model(args.model or default_model_dir(), dtype=args.dtype, device=device)
    tokenizer = loaded.tokenizer
    if args.prompt_token_ids is not None:
        prompt = args.prompt_token_ids
    elif args.chat:
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt or "Hello"}])
    else:
        prompt = tokenizer.encode(args.prompt or "Hello")
    ids = list(generate_tokens(loaded.model, prompt, params, loaded.eos_token_ids))
    text = tokenizer.decode(ids)
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text}, ensure_ascii=False))
    else:
        print(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `strata` console script; errors end as one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
