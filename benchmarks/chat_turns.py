"""Users taking turns in long chats with KV beyond VRAM: where the KV blocks each window reads come from.

    python benchmarks/chat_turns.py --model DIR [--device cuda] [--users 8 --active 2 --rounds 12]
        [--first 4096 --message 256 --answer 64] [--kv-resident 16384] [--kv-gib 4] [--park-gib 0]
        [--stay-put] [--out results.jsonl]

`--users` conversations, each opened by `--first` random tokens and answered with `--answer` greedy tokens;
in round r the `--active` users from r * active on (round robin) send their next turn together (their
conversation so far, its answers and `--message` new tokens) and the round ends when all are answered. The
other users think meanwhile: their conversations stay in the prefix cache, on the card or in host RAM (and,
with `--park-gib`, parked: a model with Gated DeltaNet layers continues only where its state was kept). Per
round: the share of KV block reads served from VRAM, the prompt tokens the prefix cache served, first-token
time p50 / max and the active users' decode tok/s; then a summary line over every round but the first
`--users / --active` (each user's first turn). `--stay-put` leaves every block where it was first given
(blocks do not move between host RAM and the card), for comparison. One JSON line a round and a summary;
on a GPU it fails where a round's decode beats the card's roofline for its users and context (a figure the
card cannot give is a defect of the measurement).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import AddRequest, SamplingParams
from app.engine.scheduler import Scheduler
from benchmarks.results import emit
from benchmarks.roofline import measure_copy_bandwidth, roofline_tok_s


def answer_round(core: EngineCore, prompts: dict[str, list[int]], answer: int) -> dict[str, Any]:
    """Send the prompts together and step until every one is answered; their answers and what it took."""
    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    sent = time.perf_counter()
    for name, prompt in prompts.items():
        core.add_request(AddRequest(name, prompt, params))
    answers: dict[str, list[int]] = {name: [] for name in prompts}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    vram = host = hits = 0
    while core.has_work():
        outputs, stats = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            answers[out.request_id] += out.token_ids
        if stats is not None:
            vram, host = vram + stats.kv_vram_reads, host + stats.kv_host_reads
            hits += stats.prefix_cache_hits
    decode = [(answer - 1) / (last[n] - first[n]) for n in prompts if last[n] > first[n]]
    return {
        "answers": answers,
        "vram_share": vram / (vram + host) if vram + host else 1.0,
        "kv_vram_reads": vram,
        "kv_host_reads": host,
        "cached_prompt_tokens": hits,
        "prompt_tokens": sum(map(len, prompts.values())),
        "ttft_p50_s": statistics.median(first[n] - sent for n in prompts),
        "ttft_max_s": max(first[n] - sent for n in prompts),
        "decode_tok_s_per_user": statistics.mean(decode) if decode else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an HF directory on disk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--active", type=int, default=2, help="users sending a turn in each round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--first", type=int, default=4096, help="tokens of each user's opening prompt")
    parser.add_argument("--message", type=int, default=256, help="new tokens of each later turn")
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--kv-resident", type=int, default=16384)
    parser.add_argument("--kv-gib", type=float, default=4.0, help="GiB of the KV pool (--kv-memory)")
    parser.add_argument("--park-gib", type=float, default=0.0, help="GiB of host RAM for parked chats")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--stay-put", action="store_true", help="blocks never move between RAM and card")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.stay_put:
        Scheduler._place = lambda self, window: None  # type: ignore[method-assign]
    config = EngineConfig(
        model=str(args.model),
        device=args.device,
        parallel=max(args.active, 1),
        kv_memory=int(args.kv_gib * (1 << 30)),
        kv_resident=args.kv_resident,
        max_batched_tokens=args.max_batched_tokens,
        park_memory=int(args.park_gib * (1 << 30)),
    )
    core = EngineCore(config)
    vocab = core.loaded.model.config.vocab_size
    rng = random.Random(args.seed)
    chats = {f"user{u}": [rng.randrange(10, vocab) for _ in range(args.first)] for u in range(args.users)}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    names = ("users", "active", "first", "message", "answer", "kv_resident", "park_gib")
    setting = {k: getattr(args, k) for k in names}
    setting |= {"stay_put": args.stay_put, "device": device, "model": args.model.name}
    model_config = json.loads((args.model / "config.json").read_text())
    bandwidth = measure_copy_bandwidth(args.device) if args.device == "cuda" else None
    later: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        names = [f"user{(round_ * args.active + i) % args.users}" for i in range(args.active)]
        prompts = {f"{n}-turn{round_}": chats[n] for n in names}
        result = answer_round(core, prompts, args.answer)
        for name in names:
            chats[name] = chats[name] + result["answers"].pop(f"{name}-turn{round_}")
            chats[name] += [rng.randrange(10, vocab) for _ in range(args.message)]
        del result["answers"]
        line = {"round": round_, **result, **setting}
        if bandwidth is not None:
            context = max(map(len, chats.values()))
            ceiling = roofline_tok_s(model_config, args.active, context, bandwidth)
            line["roofline_tok_s_per_user"] = ceiling / args.active
            if (line["decode_tok_s_per_user"] or 0.0) > line["roofline_tok_s_per_user"]:
                raise SystemExit(f"decode above the card's roofline: {line}")
        if round_ * args.active >= args.users:
            later.append(line)
        emit(line, args.out)
    if later:
        vram, host = sum(r["kv_vram_reads"] for r in later), sum(r["kv_host_reads"] for r in later)
        summary = {
            "summary": "rounds after every user's first turn",
            "rounds": len(later),
            "vram_share": vram / (vram + host) if vram + host else 1.0,
            "cached_share": sum(r["cached_prompt_tokens"] for r in later)
            / sum(r["prompt_tokens"] for r in later),
            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in later),
            "decode_tok_s_per_user": statistics.mean(r["decode_tok_s_per_user"] or 0.0 for r in later),
            **setting,
        }
        emit(summary, args.out)


if __name__ == "__main__":
    main()
