"""Time one training step of the demo model (tools/train_demo.py) on a fixed batch.

    python benchmarks/train_step.py [--size demo] [--steps 20] [--after-corpus]

A step is the forward of 32 windows of 512 tokens through the training path, the next-token, MTP and balance
losses, backward, gradient clipping and AdamW, timed over `--steps` after 3 untimed ones. With
`--after-corpus` it reads the training corpus (whose parsing forks a process pool) and times the step again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import train_demo as tool  # noqa: E402

from app.models.config import ModelConfig  # noqa: E402
from app.models.qwen3 import CausalLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--after-corpus", action="store_true")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    size = tool.SIZES[args.size]
    model = CausalLM(ModelConfig.from_dict(tool.model_config(size)), mtp_layers=1, backends=tool.TRAINING)
    tool.randomize(model, 0)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, size["vocab"], (tool.HYPER["batch_sequences"], size["seq"] + 1), device="cuda")

    def step() -> None:
        next_loss, mtp_loss, balance = tool.losses(model, batch)
        (next_loss + tool.MTP_WEIGHT * mtp_loss + tool.BALANCE_WEIGHT * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def timed() -> float:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - began) / args.steps

    result = {"device": torch.cuda.get_device_name(), "size": args.size, "step_s": round(timed(), 4)}
    if args.after_corpus:
        tool.corpus(128 << 20)
        result["step_s_after_corpus"] = round(timed(), 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
