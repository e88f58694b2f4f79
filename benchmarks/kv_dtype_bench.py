"""A long prompt and the decode after it on one GPU, per KV dtype: what 8-bit keys and values cost and give.

    python benchmarks/kv_dtype_bench.py [--shape q30-half] [--contexts 32768 131072] [--kv auto fp8 int8]
        [--kv-resident TOKENS] [--expert-resident N] [--out results.jsonl]

For each KV dtype: an engine on gpu_bench's random-weight model of the shape (built once on the GPU for all
of them, Triton kernels, decode graphs; its context raised to the longest asked for, the weights being
random), then for each context one prompt of that many tokens read in windows of 8,192 (prompt tok/s over the
windows' time, time to first token) and 64 greedy decode windows of that request alone (tok/s, median ITL),
with the KV bytes a token takes. With `--kv-resident`, only that many tokens of the pool live on the device
and the rest stream in from host RAM (each run reports the share of block reads served from VRAM); with
`--expert-resident`, N experts a layer live on the device and the others in host RAM (the expert tier,
adapting as `strata serve` does; an untimed request first, so that its residents follow the routing), so
that both caps of a small card hold. A prompt served from the prefix cache, or a decode faster than the card
could read the request's keys and values at its specified bandwidth (or, for the part in host RAM, than a
PCIe 5.0 x16 link carries it), stops the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.core import EngineCore
from app.engine.paged_state import kv_block_bytes
from app.engine.protocol import AddRequest, SamplingParams
from app.models.qwen3 import CausalLM
from benchmarks.gpu_bench import bench_config, bench_model, open_engine
from benchmarks.results import emit
from benchmarks.roofline import H200_HBM_BANDWIDTH, PCIE5_X16_BANDWIDTH

DECODE_STEPS = 64
# Untimed, before the timed contexts of a tiered model: a first engine on freshly built weights would
# otherwise pay the tier's adaptation from its cold start in its first decode (2026-12-06: int8, first,
# decoded at 98 tok/s after 32K, its median step 4.7 ms; fp8 and bf16 after it 253 and 248)
WARM_UP_PROMPT = 4096


def _long_request(core: EngineCore, context: int, vocab: int, seed: int) -> dict[str, float]:
    """One prompt of `context` tokens, then DECODE_STEPS decode windows of it alone."""
    prompt = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    rejected = core.add_request(AddRequest(f"long{seed}", prompt, params))
    if rejected:
        raise RuntimeError(rejected[0].error)
    read_s, ttft_s, hits, decode = 0.0, 0.0, 0, []
    reads = [0, 0]  # decode windows' KV block reads from VRAM and from host RAM
    while core.has_work():
        _, stats = core.step()
        if stats is None:
            continue
        hits += stats.prefix_cache_hits
        if not stats.prompt_tokens:
            reads[0] += stats.kv_vram_reads
            reads[1] += stats.kv_host_reads
        if stats.prompt_tokens:
            read_s += stats.duration_s
            ttft_s = time.perf_counter() - began
        else:
            decode.append(stats.duration_s)
    if hits:
        raise RuntimeError(f"the timed prompt was served {hits} tokens from the prefix cache")
    steady = decode[1:]
    return {
        "prompt_tok_s": context / read_s,
        "ttft_s": ttft_s,
        "decode_tok_s": len(steady) / sum(steady),
        "itl_ms_median": 1000 * statistics.median(steady),
        "decode_vram_read_share": reads[0] / sum(reads) if any(reads) else 1.0,
        "decode_host_blocks_per_token": reads[1] / len(decode),
    }


def _longest(contexts: list[int]) -> int:
    """The most positions a request takes: the longest prompt and its decode."""
    return max(contexts) + DECODE_STEPS + 2


def bench_shape(shape: str, contexts: list[int]) -> dict[str, Any]:
    """The shape's config, its positions raised to the longest context asked for (the engine's limit)."""
    return {**bench_config(shape), "max_position_embeddings": _longest(contexts) + 64}


def bench(
    shape: str,
    kv: str,
    contexts: list[int],
    resident: int | None = None,
    experts: int | None = None,
    model: CausalLM | None = None,
) -> dict[str, Any]:
    """Every context's figures over `kv` keys and values, on `model` (the shape's `bench_model`) if given."""
    config = bench_shape(shape, contexts)
    began = time.perf_counter()
    core = open_engine(
        config,
        exact=False,
        eager=False,
        kv_dtype=kv,
        context=_longest(contexts),
        kv_memory=24 << 30,
        kv_resident=resident,
        expert_resident=experts,
        model=model,
    )
    print(f"{shape} {kv}: engine ready in {time.perf_counter() - began:.0f} s", flush=True)
    model_config = core.loaded.model.config
    kv_dtype = core.runner.state.keys.dtype
    block = kv_block_bytes(model_config, 16, kv_dtype)
    per_token = block / 16
    line: dict[str, Any] = {
        "shape": shape,
        "layers": config["num_hidden_layers"],
        "kv_dtype": kv,
        "cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_bytes_per_token": per_token,
        "kv_resident": resident,
        "expert_resident": experts,
        "device": torch.cuda.get_device_name(),
    }
    if experts is not None:  # the tier's residents follow the routing before anything is timed
        _long_request(core, WARM_UP_PROMPT, config["vocab_size"], seed=len(contexts))
    for n, context in enumerate(contexts):
        result = _long_request(core, context, config["vocab_size"], seed=n)
        ceiling = H200_HBM_BANDWIDTH / (per_token * context)
        streamed = result["decode_host_blocks_per_token"] * block
        if streamed:
            ceiling = min(ceiling, PCIE5_X16_BANDWIDTH / streamed)
        if result["decode_tok_s"] > ceiling:
            rate = result["decode_tok_s"]
            raise RuntimeError(f"decode at {context} ran {rate:.0f} tok/s, above its KV's {ceiling:.0f}")
        line[f"ctx_{context}"] = result
        print(shape, kv, context, json.dumps(result), flush=True)
    shutil.rmtree(core.loaded.checkpoint.path.parent, ignore_errors=True)
    del core
    gc.collect()  # the next engine's KV pool and graphs need the memory this one's held
    torch.cuda.empty_cache()
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="q30-half")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--kv", nargs="+", default=["auto", "fp8", "int8"])
    parser.add_argument("--kv-resident", type=int, help="tokens of the pool on the device (the rest in RAM)")
    parser.add_argument("--expert-resident", type=int, help="experts a layer on the device (the rest in RAM)")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    began = time.perf_counter()
    model = bench_model(bench_shape(args.shape, args.contexts), False, args.expert_resident)
    print(f"{args.shape}: weights built in {time.perf_counter() - began:.0f} s", flush=True)
    for kv in args.kv:  # an engine each on the same weights (the tier's residents as the last one left them)
        line = bench(args.shape, kv, args.contexts, args.kv_resident, args.expert_resident, model)
        emit(line, args.out)


if __name__ == "__main__":
    main()
