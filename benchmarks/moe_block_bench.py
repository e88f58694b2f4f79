"""Times Qwen3-Next's sparse MoE block (512 experts, 10 picks, a shared expert, hidden 2048, experts of 512)
on a CUDA device: the Triton set's fused block (app/kernels/triton_moe_block.py, or the `moe_block` of other
modules named with --kernels) and the block's pieces, replayed from one CUDA graph of several layers' blocks
as decode windows run them.

    python benchmarks/moe_block_bench.py [--rows 1 8 16] [--layers 6] [--profile]

Each layer has its own weights, so that no layer's experts are read from L2 by the next. Reports the time a
block takes and the bandwidth it reaches on the weights it must read (the expected distinct experts, the
shared expert and the router), refused as a defect where above the card's copy bandwidth.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels.backends import select_backends
from app.models.config import ModelConfig
from app.models.moe import SparseMoE
from benchmarks.roofline import expected_experts, graph_us, measure_copy_bandwidth
from benchmarks.shapes import shape

QNEXT = shape("qnext", 1)
EXPERTS, TOP_K = QNEXT["num_experts"], QNEXT["num_experts_per_tok"]
HIDDEN, INTER = QNEXT["hidden_size"], QNEXT["moe_intermediate_size"]
KERNELS = ("app.kernels.triton_moe_block",)


def _config() -> ModelConfig:
    """Qwen3-Next-80B-A3B's config (benchmarks/shapes.py), one layer."""
    return ModelConfig.from_dict(QNEXT)


def _blocks(layers: int) -> list[SparseMoE]:
    """`layers` blocks with random bf16 weights of the checkpoints' scale, routers skewed by nothing."""
    backends = select_backends("triton", "cuda")
    config = _config()
    blocks = []
    for _ in range(layers):
        block = SparseMoE(config, backends.experts, backends.route, backends.linear, backends.moe_block)
        block = block.to("cuda", torch.bfloat16)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        blocks.append(block)
    return blocks


def _block_us(blocks: list[SparseMoE], x: torch.Tensor, replays: int) -> float:
    """Mean microseconds of one block, the blocks run one after another in one CUDA graph."""
    with torch.inference_mode():
        return graph_us([lambda block=block: block(x) for block in blocks], replays) / len(blocks)


def _kernel_table(blocks: list[SparseMoE], x: torch.Tensor) -> list[tuple[str, float]]:
    """(kernel, microseconds a block) of one eager pass over the blocks, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for block in blocks:
            block(x)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows = [(e.key, e.device_time_total / len(blocks)) for e in events]
    return sorted(rows, key=lambda r: -r[1])[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also each kernel's time (eager, profiler)")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), help="modules whose moe_block to time")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bandwidth = measure_copy_bandwidth("cuda")
    blocks = _blocks(args.layers)
    expert_bytes = 3 * HIDDEN * INTER * 2
    kernels = {name.rsplit(".", 1)[1]: importlib.import_module(name).moe_block for name in args.kernels}
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        needed = (expected_experts(EXPERTS, TOP_K, rows) + 1) * expert_bytes + EXPERTS * HIDDEN * 2
        for name, kernel in {"pieces": None, **kernels}.items():
            for block in blocks:
                block.block_kernel = kernel
            ms = _block_us(blocks, x, args.replays) / 1e3
            table = _kernel_table(blocks, x) if args.profile else []
            reached = needed / (ms / 1e3)
            line = {
                "rows": rows,
                "variant": name,
                "block_us": round(ms * 1e3, 2),
                "tb_s": round(reached / 1e12, 3),
                "of_copy": round(reached / bandwidth, 3),
            }
            if reached > bandwidth:
                line["defect"] = "above the copy bandwidth: weights read from L2"
            print(json.dumps(line))
            for kernel_name, us in table:
                print(f"    {us:8.2f} us  {kernel_name[:90]}")
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
