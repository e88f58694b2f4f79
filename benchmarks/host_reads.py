"""How fast a GPU computes experts whose weights stay in pinned host RAM, read straight over PCIe.

    python benchmarks/host_reads.py [--hidden 2048] [--inter 768] [--experts 64] [--counts 1 2 4 8]

For one decode row and `count` experts of the given shape (bf16, pinned host RAM): the time of a pinned copy
of those experts to the device; of the experts kernel reading them in place from host memory (no copy:
zero-copy reads over PCIe); of the CPU pool computing them; and of two at once, the GPU reading (or a copy
moving) `count` experts while the CPU pool computes `count` others (they share the host's memory). Experts
rotate through `--experts` of them, more than the host's caches hold. Also the host's read rate alone (a
4 GiB tensor summed on every core): what the GPU's reads over PCIe and the CPU pool share. Prints one JSON
line; fails where a figure is above the link's measured copy rate or the host's read rate (a cache would have
served it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.cpu_experts import experts_swiglu_sum
from app.kernels.triton_moe import fused_experts


def host_read_rate(gigabytes: int = 4, repeats: int = 5) -> float:
    """Bytes per second the host's cores read from RAM together (a large fp32 tensor summed), the best of
    `repeats`."""
    big = torch.ones(gigabytes << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - began)
    return big.nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = ((args.experts, 2 * args.inter, args.hidden), (args.experts, args.hidden, args.inter))
    gate_up, down = ((torch.randn(s, dtype=torch.bfloat16) * 0.02).pin_memory() for s in shapes)
    expert_bytes = gate_up[0].nbytes + down[0].nbytes
    x = torch.randn(1, args.hidden, device=device, dtype=torch.bfloat16)
    x_host = x.float().cpu()
    staging_gu = torch.empty((max(args.counts), *gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
    staging_dn = torch.empty((max(args.counts), *down.shape[1:]), dtype=down.dtype, device=device)
    picks = iter(range(10**9))

    def experts(count: int) -> list[int]:
        return [next(picks) % args.experts for _ in range(count)]

    def copy(count: int) -> None:
        for slot, e in enumerate(experts(count)):
            staging_gu[slot].copy_(gate_up[e], non_blocking=True)
            staging_dn[slot].copy_(down[e], non_blocking=True)

    def gpu_reads(count: int) -> None:
        ids = torch.tensor([experts(count)], device=device)
        weights = torch.full((1, count), 1.0 / count, device=device, dtype=x.dtype)
        fused_experts(x, ids, weights, gate_up, down)

    def cpu_pool(count: int) -> None:
        es = torch.tensor(experts(count))
        experts_swiglu_sum(
            x_host,
            es,
            torch.arange(count + 1),
            torch.zeros(count, dtype=torch.int64),
            torch.ones(count),
            gate_up,
            down,
        )

    def timed(fn, count: int) -> float:
        fn(count)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(args.repeats):
            began = time.perf_counter()
            fn(count)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
        return best

    # a reference check: the GPU's reads from host memory give what the same experts give on the device
    ids = torch.tensor([[0, 1]], device=device)
    weights = torch.full((1, 2), 0.5, device=device, dtype=x.dtype)
    on_host = fused_experts(x, ids, weights, gate_up, down)
    on_device = fused_experts(x, ids, weights, gate_up[:2].to(device), down[:2].to(device))
    same = bool(torch.equal(on_host, on_device))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fused_experts(x, ids, weights, gate_up, down)  # compiled before the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = fused_experts(x, ids, weights, gate_up, down)
    graph.replay()
    torch.cuda.synchronize()
    report: dict = {
        "host_read_gb_s": round(host_read_rate() / 1e9, 1),
        "torch_threads": torch.get_num_threads(),
        "expert_bytes": expert_bytes,
        "host_reads_match_device": same,
        "captured_host_reads_match": bool(torch.equal(captured, on_host)),
        "rows": [],
    }
    copy_rate = 0.0
    for count in args.counts:
        row = {"experts": count}
        for name, fn in (("copy", copy), ("gpu_reads", gpu_reads), ("cpu_pool", cpu_pool)):
            seconds = timed(fn, count)
            row[f"{name}_us"] = round(seconds * 1e6, 1)
            row[f"{name}_gb_s"] = round(count * expert_bytes / seconds / 1e9, 1)
        copy_rate = max(copy_rate, row["copy_gb_s"])

        def both(n: int) -> None:
            gpu_reads(n)
            cpu_pool(n)

        def copy_and_cpu(n: int) -> None:
            copy(n)
            cpu_pool(n)

        seconds = timed(copy_and_cpu, count)
        row["copy_and_cpu_us"] = round(seconds * 1e6, 1)
        row["copy_and_cpu_gb_s"] = round(2 * count * expert_bytes / seconds / 1e9, 1)

        seconds = timed(both, count)
        row["both_us"] = round(seconds * 1e6, 1)
        row["both_gb_s"] = round(2 * count * expert_bytes / seconds / 1e9, 1)
        report["rows"].append(row)
    print(json.dumps(report))
    too_fast = [r for r in report["rows"] if r["gpu_reads_gb_s"] > 1.1 * copy_rate]
    reads = max(report["host_read_gb_s"], max(r["cpu_pool_gb_s"] for r in report["rows"]))
    too_fast += [r for r in report["rows"] if r["copy_and_cpu_gb_s"] > 1.1 * (reads + copy_rate)]
    if too_fast:
        raise SystemExit(f"reads above the link's or the host's rate: {too_fast}")


if __name__ == "__main__":
    main()
