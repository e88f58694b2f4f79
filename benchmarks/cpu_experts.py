"""The CPU expert pool's native kernel against this host's memory bandwidth.

    python benchmarks/cpu_experts.py [--hidden 2048] [--inter 768] [--experts 48] [--rows 1 4 16]
                                     [--kinds fp32 bf16 int8 q8_0 q4_k q5_k q6_k iq4_xs iq3_xxs iq3_s]
                                     [--per-call 1 2 4 8 --gap-us 0 500]

Measures the host's copy bandwidth (a 512 MiB tensor copied, bytes read plus written; the best of before and
after the kernels), and runs one expert's SwiGLU for each expert of a layer in turn (more expert bytes than
the caches hold, so every call reads its weights from RAM) for each kind of weights asked for (default: all
of fp32, bf16, int8 and the GGUF block types the kernel reads in place, random blocks), and reports per
call: time, bytes of weights read per second and that as a share of the copy bandwidth. Fails when a figure
is above READ_OVER_COPY times the measured bandwidth (a cache, not RAM, would have served it). Prints one
JSON line.

`--per-call K ...` also times one row through K different experts in one call (`experts_swiglu_sum`, as the
expert tier's host step calls the CPU pool for a layer's misses), each call `--gap-us` microseconds after the
last (the host busy meanwhile, as it is waiting for the device): what a call costs beside its experts' bytes
(the thread team's start, its wake-up after a gap, the last thread's tail), which a tier's miss plan must
weigh.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.backends import CPU_HELD_BLOCKS
from app.kernels.cpu_experts import expert_swiglu, experts_swiglu_sum, native_available, threads
from app.kernels.gguf_quants import random_blocks, to_held

# the kinds measured, by the name the figures carry: torch dtypes, or GGUF types' names (random blocks)
KINDS: dict[str, torch.dtype | str] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    **{held.lower(): held for held in CPU_HELD_BLOCKS},
}


# Reading alone may beat a copy's bytes read plus written: a copy's writes first read their lines (write
# allocation), so a copy moves about three bytes for the two it counts. On the GPU machine's host the kernel
# read bf16 experts, eight a call, at 119 GB/s beside a copy's 106. A cache would serve far more.
READ_OVER_COPY = 1.5


def copy_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second of a large host copy (read + write), the best of `repeats`."""
    source = torch.ones(megabytes << 18, dtype=torch.float32)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return 2 * source.nbytes / best


def expert_weights(
    kind: torch.dtype | str, experts: int, hidden: int, inter: int
) -> list[tuple[torch.Tensor, ...]]:
    """`experts` experts' random weights (int8 with per-row scales; a GGUF type's name: random blocks)."""
    made = []
    for e in range(experts):
        if isinstance(kind, str):
            shapes = ((2 * inter, hidden), (hidden, inter))
            made.append(
                tuple(to_held(kind, random_blocks(kind, shape, 2 * e + i)) for i, shape in enumerate(shapes))
            )
        elif kind == torch.int8:
            gate_up = torch.randint(-127, 128, (2 * inter, hidden), dtype=torch.int8)
            down = torch.randint(-127, 128, (hidden, inter), dtype=torch.int8)
            made.append((gate_up, down, torch.rand(2 * inter) * 1e-3, torch.rand(hidden) * 1e-3))
        else:
            made.append(
                (
                    (torch.randn(2 * inter, hidden) * 0.02).to(kind),
                    (torch.randn(hidden, inter) * 0.02).to(kind),
                )
            )
    return made


def time_kernel(weights: list[tuple], rows: int, hidden: int, rounds: int = 3) -> float:
    """Seconds per expert call, cycling through every expert `rounds` times after one warm-up round."""
    x = torch.randn(rows, hidden)
    for w in weights:
        expert_swiglu(x, *w)
    began = time.perf_counter()
    for _ in range(rounds):
        for w in weights:
            expert_swiglu(x, *w)
    return (time.perf_counter() - began) / (rounds * len(weights))


def time_calls(stacked: list[torch.Tensor], per_call: int, hidden: int, gap_s: float) -> float:
    """Seconds per call of one row through `per_call` experts of `stacked` (gate_up, down and any scales,
    [experts, ...]) at once, each call `gap_s` after the last (busy), cycling through every expert three
    times after one warm-up round."""
    experts = stacked[0].shape[0]
    x = torch.randn(1, hidden)
    entries = (torch.arange(per_call + 1), torch.zeros(per_call, dtype=torch.int64), torch.ones(per_call))
    firsts = range(0, experts - per_call + 1, per_call)
    calls = [torch.arange(first, first + per_call) for first in firsts]
    total, timed = 0.0, 0
    for round_ in range(4):
        for chosen in calls:
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
            began = time.perf_counter()
            experts_swiglu_sum(x, chosen, *entries, *stacked)
            if round_:
                total, timed = total + time.perf_counter() - began, timed + 1
    return total / timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--per-call", type=int, nargs="*", default=[], help="experts a call, one row each")
    parser.add_argument("--gap-us", type=float, nargs="+", default=[0.0], help="between --per-call calls")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    timings = {}
    calls: dict[str, tuple[int, float]] = {}  # name -> (bytes a call, seconds a call)
    for name in args.kinds:
        weights = expert_weights(KINDS[name], args.experts, args.hidden, args.inter)
        per_expert = sum(t.nbytes for t in weights[0])
        timings[name] = (per_expert, {rows: time_kernel(weights, rows, args.hidden) for rows in args.rows})
        stacked = [torch.stack(parts) for parts in zip(*weights, strict=True)] if args.per_call else []
        for count in args.per_call:
            for gap in args.gap_us:
                seconds = time_calls(stacked, count, args.hidden, gap * 1e-6)
                calls[f"{name}_call{count}_gap{gap:g}"] = (count * per_expert, seconds)
        del weights, stacked
    bandwidth = max(bandwidth, copy_bandwidth())  # the best of before and after: the machine may be shared
    line: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d"),
        "native": native_available(),
        "threads": threads(),
        "hidden": args.hidden,
        "inter": args.inter,
        "experts": args.experts,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
    }
    above = []
    for name, (per_expert, by_rows) in timings.items():
        for rows, seconds in by_rows.items():
            rate = per_expert / seconds
            line[f"{name}_rows{rows}_us"] = round(seconds * 1e6, 1)
            line[f"{name}_rows{rows}_gb_s"] = round(rate / 1e9, 2)
            line[f"{name}_rows{rows}_share"] = round(rate / bandwidth, 3)
            if rate > READ_OVER_COPY * bandwidth:
                above.append(f"{name} at {rows} rows: {rate / 1e9:.1f} GB/s")
    for key, (read, seconds) in calls.items():
        line[f"{key}_us"] = round(seconds * 1e6, 1)
        line[f"{key}_gb_s"] = round(read / seconds / 1e9, 2)
        if read / seconds > READ_OVER_COPY * bandwidth:
            above.append(f"{key}: {read / seconds / 1e9:.1f} GB/s")
    print(json.dumps(line))
    if above:
        raise SystemExit(f"faster than the host's memory ({'; '.join(above)}): the weights came from a cache")


if __name__ == "__main__":
    main()
