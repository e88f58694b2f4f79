"""One tiered MoE layer of full size on the GPU: the time of a forward, by where its misses run.

    python benchmarks/tier_layer.py [--resident 96] [--rows 1] [--pcie-frac F] [--profile]

A Qwen3-30B-A3B MoE layer (128 experts, 2048 x 768) with `resident` experts on the device and the others in
pinned host RAM, run on uniform random routing `--iters` times: ms per forward, and what the machine's
measured costs predict for it (the slower of the PCIe copies and the CPU pool's share). `--profile` adds the
host's own time by function (cProfile), to find where a forward's time goes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.backends import select_backends
from app.kernels.cpu_experts import background_finish, experts_swiglu_sum, threads
from app.kernels.interface import Backends
from app.models.expert_tier import TieredExperts, use_staging

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def build(resident: int, backends: Backends) -> TieredExperts:
    finish = background_finish()  # the engine's default: the pool's run beside the copies' queueing
    tier = TieredExperts(EXPERTS, HIDDEN, INTER, backends.experts, resident, experts_swiglu_sum, 0, finish)
    generator = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = (
        torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
        for shape in ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER))
    )
    tier.fill(gate_up, down, torch.device("cuda"))
    return tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resident", type=int, default=96)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--pcie-frac", type=float)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    backends = select_backends("auto", "cuda")
    tier = build(args.resident, backends)
    costs = use_staging([tier], args.pcie_frac, link=backends.tier_link)
    assert costs is not None
    torch.set_num_threads(1)  # as the engine does with a tier on a GPU
    generator = torch.Generator().manual_seed(1)
    inputs = []
    for _ in range(args.iters + 20):
        ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(args.rows)])
        weights = torch.rand(args.rows, TOP_K, generator=generator)
        inputs.append((torch.randn(args.rows, HIDDEN).to("cuda", torch.bfloat16), ids.cuda(), weights.cuda()))
    for x, ids, weights in inputs[:20]:
        tier(x, ids, weights)
    torch.cuda.synchronize()
    tier.take_counts()
    profiler = cProfile.Profile() if args.profile else None
    began = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for x, ids, weights in inputs[20:]:
        tier(x, ids, weights)
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.disable()
    seconds = (time.perf_counter() - began) / args.iters
    counts = tier.take_counts()
    (vram, cpu, pcie), copied = counts.served, counts.pcie_bytes
    line = {
        "resident": args.resident,
        "rows": args.rows,
        "pcie_frac": args.pcie_frac,
        "cpu_threads": threads(),
        "torch_threads": torch.get_num_threads(),
        "ms_per_forward": round(seconds * 1e3, 3),
        "pcie_gb_s": round(costs.pcie_bytes_s / 1e9, 1),
        "cpu_gb_s": round(costs.cpu_bytes_s / 1e9, 1),
        "cpu_row_us": round(costs.cpu_row_s * 1e6, 1),
        "cpu_call_us": round(costs.cpu_call_s * 1e6, 1),
        "entries_per_forward": [round(v / args.iters, 2) for v in (vram, cpu, pcie)],
        "copied_mb_per_forward": round(copied / args.iters / 1e6, 2),
    }
    print(json.dumps(line), flush=True)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
        print(out.getvalue()[-3500:])


if __name__ == "__main__":
    main()
