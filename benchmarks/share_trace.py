"""Trace the decode share window by window: one slot decoding, then peers' prompts arriving together.

    python benchmarks/share_trace.py [--shape q30-half] [--peers 31] [--prompt-len 512] [--no-overlap]
    python benchmarks/share_trace.py --model DIR --device cpu [--max-batched-tokens 8192] [--peers 4 ...]

Runs an in-process engine on a random-weight model of the shape (as benchmarks/gpu_bench.py), or on a
checkpoint on disk (`--model`, on `--device`), and prints, for every window while the peers' prompts are read:
its decode and prompt rows, the rows it was padded to, the cost charged when it was planned, the seconds it
took, the scheduler's prediction for a one-block window, what a window may cost (the solo decode window over
the share) and the credit after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import AddRequest, SamplingParams
from app.engine.scheduler import Window
from benchmarks.gpu_bench import PROMPT_LEN, bench_config, open_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="q30-half")
    parser.add_argument("--peers", type=int, default=31)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--model", type=Path, help="a checkpoint on disk instead of a random shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.model is not None:
        settings = {"model": str(args.model), "device": args.device, "parallel": 8, "kv_memory": 2 << 30}
        core = EngineCore(EngineConfig(**settings, max_batched_tokens=args.max_batched_tokens))
        vocab = core.loaded.model.config.vocab_size
    else:
        config = bench_config(args.shape)
        core = open_engine(config, exact=False, eager=False)
        vocab = config["vocab_size"]
    if args.no_overlap:
        core.config = msgspec.structs.replace(core.config, overlap=False)
    scheduler = core.scheduler
    generator = torch.Generator().manual_seed(7)
    trace: list[dict] = []
    observed: dict[int, float] = {}
    schedule, observe = scheduler.schedule, scheduler.observe

    def traced_schedule(*args: object, **kwargs: object) -> Window:
        credit = scheduler.credit
        window = schedule(*args, **kwargs)  # type: ignore[arg-type]
        rows = sum(len(c.tokens) for c in window.chunks)
        decode = window.decode_tokens
        solo = scheduler.solo_seconds(decode) if decode else None
        one_block = None
        if scheduler.cost.calibrated and decode:
            one_block = scheduler.cost.predict(scheduler.padded(decode + 16), decode + 1)
        trace.append(
            {
                "decode": decode,
                "prompt": window.prompt_tokens,
                "padded": scheduler.padded(rows) if window.prompt_tokens else rows,
                "credit_before_ms": 1000 * credit,
                "charged_ms": None if window.charged is None else 1000 * window.charged,
                "allowed_ms": None if solo is None else 1000 * solo / scheduler.config.decode_share,
                "one_block_ms": None if one_block is None else 1000 * one_block,
                "id": id(window),
            }
        )
        return window

    def traced_observe(window: Window, seconds: float, replayed: bool = False) -> None:
        observe(window, seconds, replayed)
        observed[id(window)] = seconds
        for row in reversed(trace):
            if row["id"] == id(window):
                row["seconds_ms"] = 1000 * seconds
                row["credit_after_ms"] = 1000 * scheduler.credit
                break

    scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    scheduler.observe = traced_observe  # type: ignore[method-assign]
    watched = torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist()
    room = core.max_model_len - PROMPT_LEN  # it decodes until its peers are read
    core.add_request(AddRequest("watched", watched, SamplingParams(max_tokens=room, temperature=0)))
    for _ in range(80):
        core.step()
    start = len(trace)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(args.peers):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
        core.add_request(AddRequest(f"peer{i}", prompt, params))
    while any(r.request_id.startswith("peer") for r in core.scheduler.requests.values()):
        core.step()
    reading = trace[start:]
    last = max(i for i, row in enumerate(reading) if row["prompt"])
    reading = reading[: last + 1]
    for row in reading:
        row.pop("id")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    seconds = sum(row.get("seconds_ms", 0.0) for row in reading)
    alone = sorted(row["seconds_ms"] for row in trace[start - 30 : start - 5] if "seconds_ms" in row)
    solo = alone[len(alone) // 2] if alone else None
    print(
        json.dumps(
            {
                "windows": len(reading),
                "prompt_windows": sum(1 for row in reading if row["prompt"]),
                "read_ms": round(seconds, 2),
                "solo_ms": solo,
                "ratio": round(len(reading) * solo / seconds, 3) if solo else None,
            }
        )
    )


if __name__ == "__main__":
    main()
