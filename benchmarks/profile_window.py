"""Where a window's time goes: kernel times of decode windows (batch 1 and 32) and of an 8K prompt window.

    python benchmarks/profile_window.py --shape q30-half
    python benchmarks/profile_window.py --shape qnext --layers 12 --batch 1 --no-prefill --top 40
    python benchmarks/profile_window.py --model /tmp/q30-Q4_K.gguf --batch 8 --no-prefill

Builds the shape with random weights (as gpu_bench.py), or serves a GGUF file as gguf_bench.py does
(`--model`, e.g. one `gguf_bench.py write` wrote), then for each case prints the time of a whole engine step,
of the bare CUDA-graph replay (decode), and the kernels that took the most GPU time per window.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.protocol import AddRequest, SamplingParams
from benchmarks.gguf_bench import open_core
from benchmarks.gpu_bench import bench_config, open_engine
from benchmarks.shapes import shape


def kernel_times(prof: profile) -> list[tuple[str, float, int]]:
    """Every kernel and copy the profiler saw on the GPU: (name, its own GPU microseconds, launches), most
    time first."""
    events = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()]
    return sorted((e for e in events if e[1] > 0), key=lambda e: -e[1])


def _kernel_table(prof: profile, windows: int, top: int) -> None:
    """Kernels by total GPU time, per window."""
    events = kernel_times(prof)
    total = sum(us for _, us, _ in events)
    launches = sum(count for _, _, count in events) / windows
    print(f"  GPU time per window: {total / windows / 1000:.3f} ms in {launches:.0f} kernels and copies")
    for name, us, count in events[:top]:
        print(f"  {us / windows / 1000:8.3f} ms {us / total:6.1%} x{count // windows:<4} {name[:90]}")


def _decode_case(core, batch: int, vocab: int, windows: int = 10, top: int = 25) -> None:
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = torch.randint(3, vocab, (128,), generator=generator).tolist()
        core.add_request(AddRequest(f"prof{batch}-{i}", prompt, params))
        ids.append(f"prof{batch}-{i}")
    for _ in range(5):
        core.step()
    began = time.perf_counter()
    for _ in range(windows):
        core.step()
    step_ms = (time.perf_counter() - began) / windows * 1000
    graphs = core.runner.graphs
    replay_ms = float("nan")
    if graphs is not None:
        bucket = next(b for b in graphs.buckets if b.decode and b.tokens >= batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.graphs[bucket].replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 20
    print(f"decode batch {batch}: engine step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(windows):
            core.step()
    _kernel_table(prof, windows, top)
    for request_id in ids:
        core.abort_request(request_id)
    while core.has_work():
        core.step()


def _prefill_case(core, vocab: int, length: int = 8192, top: int = 25) -> None:
    prompt = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    for attempt in range(2):
        core.add_request(AddRequest(f"pre{attempt}", prompt, SamplingParams(max_tokens=1, temperature=0)))
        if attempt == 1:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                while core.has_work():
                    core.step()
        while core.has_work():
            core.step()
    print(f"prompt of {length} tokens:")
    _kernel_table(prof, 1, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="q30-half")
    parser.add_argument("--model", type=Path, help="a GGUF file to serve instead of a random shape")
    parser.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 32)")
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prefill", action="store_true", help="leave out the 8K prompt window")
    parser.add_argument("--layers", type=int, help="cut the shape to this many layers")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per case")
    args = parser.parse_args()
    if args.model:
        core = open_core(args.model)
        vocab = core.loaded.model.config.vocab_size
    else:
        config = shape(args.shape, layers=args.layers) if args.layers else bench_config(args.shape)
        core = open_engine(config, args.exact, args.enforce_eager)
        vocab = config["vocab_size"]
    for batch in args.batch or [1, 32]:
        _decode_case(core, batch, vocab, top=args.top)
    if not args.no_prefill:
        _prefill_case(core, vocab)


if __name__ == "__main__":
    main()
