"""Where a drafting window's time goes on a GPU: the demo model's requests decoded in-process, the runner's
launch, the eager forward, the Gated DeltaNet layers and the MTP head's pass each timed with the device
synchronised around them (so the figures add host and device time; the totals are slower than a free run).

    python benchmarks/drafts_window.py [--spec off|ngram|mtp] [--concurrency 4] [--profile]

With --profile the timed run is not synchronised but profiled instead: the device's kernels by total time,
and how many ran a window. With --first the first run after the engine's start is looked at instead (where
a stall at the first requests would be): its first windows' times, every Triton kernel compiled during it,
and the host's functions by cumulative time.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_helpers import make_core, random_prompt, request, run

from app.default_model import default_model_dir
from app.engine.core import EngineCore
from app.engine.cuda_graphs import WindowGraphs
from app.engine.mtp_drafts import MtpDrafter
from app.engine.runner import ModelRunner
from app.models.gdn import GatedDeltaNet

SECTIONS = [
    (EngineCore, "step", "step"),
    (ModelRunner, "launch", "launch"),
    (ModelRunner, "_eager", "eager forward"),
    (WindowGraphs, "run", "replayed window"),
    (GatedDeltaNet, "forward", "Gated DeltaNet layer"),
    (MtpDrafter, "guess", "MTP head's pass"),
]


def timed(owner: type, name: str, key: str, spent: dict[str, list[float]]) -> None:
    """Wrap `owner.name` so that each call's synchronised time adds to spent[key]."""
    inner: Callable = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        torch.cuda.synchronize()
        began = time.perf_counter()
        result = inner(*args, **kwargs)
        torch.cuda.synchronize()
        spent[key].append(time.perf_counter() - began)
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", default="mtp")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--first", action="store_true")
    args = parser.parse_args()
    core = make_core(
        default_model_dir(), device="cuda", dtype="bfloat16", parallel=8, kv_memory=1 << 30, spec=args.spec
    )

    def requests(seed: int) -> list:
        return [
            (
                0,
                request(
                    random_prompt(64, seed + i), max_tokens=args.output_len, temperature=0, ignore_eos=True
                ),
            )
            for i in range(args.concurrency)
        ]

    if args.first:
        first_run(core, requests(0))
        return
    run(core, requests(0))  # the graphs are captured: the timers go in after the first run (no sync there)
    if args.profile:
        profile(core, requests(100))
        return
    spent: dict[str, list[float]] = collections.defaultdict(list)
    for owner, name, key in SECTIONS:
        timed(owner, name, key, spent)
    began = time.perf_counter()
    _, windows = run(core, requests(100))
    print(f"{args.spec}: {len(windows)} windows in {time.perf_counter() - began:.3f} s")
    for key, times in spent.items():
        print(f"  {key}: {len(times)} calls, {1000 * sum(times) / len(times):.2f} ms each")


def first_run(core: EngineCore, arrivals: list) -> None:
    """The first run after the start: its first windows' times, the Triton kernels compiled during it, and
    the host's 25 costliest functions by cumulative time."""
    import cProfile
    import pstats

    import triton

    compiled: list[str] = []

    def on_compile(**kwargs: object) -> bool:
        compiled.append(f"{kwargs.get('fn')}: {kwargs.get('repr')}")
        return False

    triton.knobs.runtime.jit_cache_hook = on_compile
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    _, windows = run(core, arrivals)
    torch.cuda.synchronize()
    profiler.disable()
    print(f"first run: {len(windows)} windows in {time.perf_counter() - began:.3f} s")
    for w in windows[:8]:
        rows = f"{w.prompt_tokens} prompt + {w.decode_tokens} decode rows"
        print(f"  window {w.window}: {1000 * w.duration_s:.2f} ms, {rows}")
    print(f"{len(compiled)} Triton compiles:")
    for line in compiled:
        print("  " + line)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def profile(core: EngineCore, arrivals: list) -> None:
    """Run `arrivals` under the torch profiler; print the device's kernels by total time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, windows = run(core, arrivals)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    busy = sum(e.device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    each = launches / len(windows)
    print(f"{len(windows)} windows: device busy {busy / 1000:.1f} ms, {each:.0f} kernels a window")
    for e in kernels[:25]:
        print(f"  {e.device_time_total / 1000:8.2f} ms {e.count:6d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
