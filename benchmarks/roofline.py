"""Memory-bandwidth roofline of one decode step, and a device-to-device copy bandwidth probe.

A decode step of a MoE model at small batch is bound by the bytes it has to read from device memory:

* every weight that is not a routed expert, once per step (attention / Gated DeltaNet projections, norms,
  routers, shared experts, dense MLPs), however many sequences are in the batch;
* the lm_head, once (for tied embeddings that is the embedding matrix);
* one embedding row per sequence;
* the routed experts that at least one token of the step picks. With `E` experts, top-`k` routing and `B`
  tokens routed uniformly at random, one token misses a given expert with probability `1 - k/E`, all `B`
  tokens (independently) with `(1 - k/E)**B`, so by linearity of expectation the number of distinct experts
  read per MoE layer is `E * (1 - (1 - k/E)**B)`: exactly `k` at `B = 1`, tending to `E` as `B` grows.
  Trained routers are skewed, which hits fewer distinct experts; the uniform count is the upper end, so the
  roofline derived from it is the lower (conservative) end;
* for each full-attention layer, the K and V of the `context` cached tokens of every sequence, plus
  writing the new token's K and V;
* for each Gated DeltaNet layer, the recurrent state of every sequence (fp32, heads x key dim x value dim),
  read and written back, and the short-convolution state (model dtype), read and written back.

Activations, router logits and the sampled ids are a few MB at most and are left out.
`roofline_tok_s` divides the bandwidth by these bytes: the generated tokens per second that no engine can
beat on that device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    from benchmarks.shapes import SHAPES, fit_layers, param_breakdown, param_counts, shape
except ImportError:  # run as a script from inside benchmarks/
    from shapes import SHAPES, fit_layers, param_breakdown, param_counts, shape  # type: ignore[no-redef]

H200_COPY_BANDWIDTH = 4.26e12
"""Device-to-device copy bandwidth (read + write) measured on one H200, bytes/s."""
H200_HBM_BANDWIDTH = 4.8e12
"""The H200's memory bandwidth by its specification, bytes/s: no decode step reads faster."""
H200_BF16_FLOPS = 989e12
"""The H200's dense bf16 tensor-core peak (its datasheet), FLOP/s."""
PCIE5_X16_BANDWIDTH = 64e9
"""A PCIe 5.0 x16 link's raw rate one way, bytes/s: nothing streamed from host RAM arrives faster (the H200
machine measured 55 GB/s host-to-device from pinned memory)."""

RECURRENT_STATE_BYTES = 4
"""Gated DeltaNet recurrent states are kept in fp32."""


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit when `tokens` tokens each pick `top_k` of `num_experts` uniformly."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_bytes(
    config: dict[str, Any], batch: int, context: int, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None
) -> dict[str, float]:
    """The bytes one decode step of `batch` sequences with `context` cached tokens reads, per part.

    Keys: `weights` (all non-routed weights), `lm_head`, `embedding_rows`, `routed_experts`, `kv_cache`,
    `linear_state`. `kv_dtype_bytes` defaults to `dtype_bytes`.
    """
    counts = param_counts(config)
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]

    non_routed = (
        counts.attention * counts.attention_layers
        + counts.linear_attention * counts.linear_layers
        + counts.layer_norms * counts.layers
        + counts.final_norm
        + (counts.router + counts.shared_expert) * counts.moe_layers
        + counts.dense_mlp * counts.dense_layers
    )
    experts = expected_experts(config.get("num_experts") or 0, config.get("num_experts_per_tok") or 0, batch)

    kv_per_token = 2 * config["num_key_value_heads"] * head_dim * kv_bytes
    kv_cache = counts.attention_layers * batch * (context + 1) * kv_per_token

    linear_state = 0
    if counts.linear_layers:
        value_heads = config["linear_num_value_heads"]
        recurrent = (
            value_heads
            * config["linear_key_head_dim"]
            * config["linear_value_head_dim"]
            * RECURRENT_STATE_BYTES
        )
        conv_channels = (
            2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            + value_heads * config["linear_value_head_dim"]
        )
        conv = conv_channels * (config["linear_conv_kernel_dim"] - 1) * dtype_bytes
        linear_state = counts.linear_layers * batch * 2 * (recurrent + conv)

    return {
        "weights": float(non_routed * dtype_bytes),
        "lm_head": float(config["vocab_size"] * hidden * dtype_bytes),
        "embedding_rows": float(batch * hidden * dtype_bytes),
        "routed_experts": counts.moe_layers * experts * counts.expert * dtype_bytes,
        "kv_cache": float(kv_cache),
        "linear_state": float(linear_state),
    }


def bytes_per_step(config: dict[str, Any], batch: int, context: int, dtype_bytes: int = 2) -> int:
    """Bytes one decode step of `batch` sequences of `context` cached tokens must read (see module doc)."""
    return round(sum(step_bytes(config, batch, context, dtype_bytes).values()))


def roofline_tok_s(
    config: dict[str, Any], batch: int, context: int, bandwidth_bytes_s: float, dtype_bytes: int = 2
) -> float:
    """Upper bound on aggregate generated tokens/s: `batch` tokens per step, steps bound by bandwidth."""
    return batch * bandwidth_bytes_s / bytes_per_step(config, batch, context, dtype_bytes)


def prompt_ceiling_tok_s(
    config: dict[str, Any], prompt_len: int, peak_flops: float = H200_BF16_FLOPS
) -> float:
    """Upper bound on tokens/s reading one `prompt_len`-token prompt: each token multiplies through every
    weight it uses (the non-expert ones and its top-k experts) at two FLOPs a weight, and its full-attention
    layers score and mix the half of the prompt it sees on average (4 FLOPs per head dimension and key). The
    LM head, the Gated DeltaNet rule and elementwise work are left out: the true ceiling is lower."""
    counts = param_counts(config)
    parts = counts.totals()
    used = sum(parts.values()) - parts["embedding"] - parts["lm_head"] - parts["routed_experts"]
    used += config["num_experts_per_tok"] * counts.expert * counts.moe_layers
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    attention = 4 * config["num_attention_heads"] * head_dim * (prompt_len / 2) * counts.attention_layers
    return peak_flops / (2 * used + attention)


def measure_copy_bandwidth(
    device: str | torch.device, size_bytes: int = 2 * 1024**3, repeats: int = 10, warmup: int = 3
) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting both the read and the write.

    Copies one `size_bytes` tensor into another; the median over `repeats` timed copies after `warmup`
    untimed ones. On CUDA the copies are timed with events, elsewhere with the wall clock. Needs twice
    `size_bytes` free on the device: measure before loading models.
    """
    device = torch.device(device)
    numel = size_bytes // 4
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    for _ in range(warmup):
        dst.copy_(src)
    seconds: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            began = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - began)
    del src, dst
    return moved / statistics.median(seconds)


def report(
    bandwidth_bytes_s: float = H200_COPY_BANDWIDTH,
    context: int = 1024,
    batches: tuple[int, ...] = (1, 8, 32),
    budget_bytes: float = 120e9,
) -> str:
    """A text table of weights, bytes per step and roofline tok/s for every shape in `SHAPES`."""
    lines = [f"bandwidth {bandwidth_bytes_s / 1e12:.2f} TB/s, context {context}, bf16"]
    configs = []
    for name in SHAPES:
        configs.append((name, shape(name)))
        if configs[-1][1]["model_type"] == "qwen3_next":
            layers = fit_layers(name, budget_bytes)
            configs.append((f"{name} cut to {budget_bytes / 1e9:.0f} GB", shape(name, layers=layers)))
    for name, config in configs:
        parts = param_breakdown(config)
        lines.append(
            f"{name}: {config['num_hidden_layers']} layers, weights {parts['total'] / 1e9:.2f} GB "
            f"(routed experts {parts['routed_experts'] / 1e9:.2f} GB)"
        )
        for batch in batches:
            step = bytes_per_step(config, batch, context)
            lines.append(
                f"  batch {batch:>3}: {step / 1e9:7.3f} GB/step, {step / batch / 1e9:7.3f} GB/token, "
                f"roofline {roofline_tok_s(config, batch, context, bandwidth_bytes_s):8.1f} tok/s"
            )
    return "\n".join(lines)


def main() -> None:
    """Print `report` for the given bandwidth and context."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=float, default=H200_COPY_BANDWIDTH, help="bytes/s")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    print(report(args.bandwidth, args.context, tuple(args.batches)))


def replayed_ms(calls: list[Callable[[], object]], replays: int = 40) -> float:
    """Mean milliseconds of one call, each of `calls` (one a weight set, so that repeats do not read their
    weights from L2) captured in a CUDA graph after a first run that compiles, the graphs replayed in turn."""
    graphs = []
    for call in calls:
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(replays):
        graphs[i % len(graphs)].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_us(steps: list[Callable[[], object]], replays: int = 20) -> float:
    """Mean microseconds of one replay of a graph of `steps`, run in order."""
    for step in steps:
        step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1000


if __name__ == "__main__":
    main()
