"""Full-size random-weight models on one GPU: Strata's engine against the roofline and HF transformers.

    python benchmarks/gpu_bench.py --shape q30-half [--shape q30 ...] [--skip-hf] [--out results.jsonl]

For each shape: the copy bandwidth of the card, HF transformers on the same shape (built, timed, freed), then
Strata's engine in-process (Triton kernels, decode CUDA graphs) on a model built straight on the GPU with
random bf16 weights: decode tok/s at batch 1, 8 and 32 (prompts of 128 tokens), an 8K-token prompt read in one
window, TTFT and ITL, and the roofline (bytes a decode step must read over the measured bandwidth). Ends with
one JSON line per shape. Routing is that of a random router (close to uniform), the costly case for the
expert weights read per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import AddRequest, SamplingParams
from app.kernels.backends import select_backends
from app.kernels.interface import Backends
from app.loading.checkpoint import CheckpointDir
from app.loading.model import LoadedModel
from app.models.config import ModelConfig
from app.models.qwen3 import CausalLM
from app.text.tokenizer import Tokenizer
from benchmarks.hf_reference import run_reference
from benchmarks.random_checkpoint import write_config_and_tokenizer
from benchmarks.roofline import measure_copy_bandwidth, prompt_ceiling_tok_s, roofline_tok_s
from benchmarks.shapes import fit_layers, param_bytes, shape

DECODE_BATCHES = (1, 8, 32)
PROMPT_LEN = 128
DECODE_STEPS = 64
PREFILL_LEN = 8192
WEIGHT_BUDGET = 118e9  # what a shape's weights may take of a 141 GB card, leaving room for KV and activations


def write_model_dir(path: Path, config: dict[str, Any]) -> None:
    """config.json, a weightless safetensors file and a word-level tokenizer covering the vocabulary.

    The weights are built in memory (`build_model`); the directory gives the engine its name and tokenizer
    (it detokenizes every generated token).
    """
    from safetensors.torch import save_file

    write_config_and_tokenizer(path, config)
    save_file({}, str(path / "model.safetensors"))


def build_model(config: dict[str, Any], backends: Backends, device: str) -> CausalLM:
    """The model built on the GPU in bf16 with random weights (std 0.02), norms as initialised."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = CausalLM(ModelConfig.from_dict(config), backends=backends)
    finally:
        torch.set_default_dtype(previous)
    model.model.rotary.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def _decode(core: EngineCore, batch: int, vocab: int) -> dict[str, float]:
    """`batch` requests of PROMPT_LEN tokens read together, then DECODE_STEPS decode windows timed."""
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist()
        core.add_request(AddRequest(f"d{batch}-{i}", prompt, params))
    windows = []
    while core.has_work():
        began = time.perf_counter()
        _, stats = core.step()
        step_s = time.perf_counter() - began
        if stats is not None and stats.prompt_tokens == 0 and stats.decode_tokens == batch:
            windows.append(stats.duration_s)
    steady = windows[1:]  # the first decode window may still carry one-off work
    return {
        "tok_s": batch * len(steady) / sum(steady),
        "itl_ms_median": 1000 * statistics.median(steady),
        "finish_step_ms": 1000 * step_s,  # the whole step in which every request ends (and is parked)
    }


def _prefill(core: EngineCore, vocab: int) -> dict[str, float]:
    """One PREFILL_LEN-token prompt read in one window: tokens/s of that window, and time to first token.

    Each attempt reads a prompt of its own: a repeated one would be served by the prefix cache.
    """
    results = {}
    for attempt in range(2):  # the first run compiles kernels for the shapes of a long prompt
        generator = torch.Generator().manual_seed(10_000 + attempt)
        prompt = torch.randint(3, vocab, (PREFILL_LEN,), generator=generator).tolist()
        began = time.perf_counter()
        rejected = core.add_request(
            AddRequest(f"p{attempt}", prompt, SamplingParams(max_tokens=1, temperature=0))
        )
        if rejected:
            raise RuntimeError(rejected[0].error)
        duration, hits = 0.0, 0
        while core.has_work():
            _, stats = core.step()
            if stats is not None:
                duration += stats.duration_s
                hits += stats.prefix_cache_hits
        if hits:
            raise RuntimeError(f"the timed prompt was served {hits} tokens from the prefix cache")
        results = {"tok_s": PREFILL_LEN / duration, "ttft_s": time.perf_counter() - began}
    return results


def _peers_read(core: EngineCore, vocab: int, peers: int, prompt_len: int) -> dict[str, float]:
    """A request decoding alone, then `peers` prompts of `prompt_len` tokens arriving together.

    Its solo tok/s over 64 windows before they arrive, its tok/s until the last peer's first token (it
    gets one token per window), both in whole engine steps, and how long windows with prompt rows took, how
    much of it the host was busy, and how many replayed a graph.
    """
    generator = torch.Generator().manual_seed(1000 + peers)
    watched = torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist()
    long_answer = SamplingParams(max_tokens=8000, temperature=0, ignore_eos=True)
    core.add_request(AddRequest("watched", watched, long_answer))
    solo: list[float] = []
    while len(solo) < 64:
        _, stats = core.step()
        if stats is not None and stats.prompt_tokens == 0:
            solo.append(stats.step_s)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(peers):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        core.add_request(AddRequest(f"peer{peers}-{i}", prompt, params))
    during, prompt_windows, host, replayed, hits = [], [], [], 0, 0
    while any(s.phase == "prompt" for s in stats.slots) or stats.waiting or not during:
        _, got = core.step()
        if got is None:
            continue
        stats = got
        during.append(stats.step_s)
        hits += stats.prefix_cache_hits
        if stats.prompt_tokens:
            prompt_windows.append(stats.step_s)
            host.append(stats.host_s)
            replayed += core.runner.last_replayed
    if hits:
        raise RuntimeError(f"peers' prompts were served {hits} tokens from the prefix cache")
    core.abort_request("watched")
    while core.has_work():
        core.step()
    solo_rate = len(solo[1:]) / sum(solo[1:])
    rate = len(during) / sum(during)
    return {
        "solo_tok_s": solo_rate,
        "during_tok_s": rate,
        "ratio": rate / solo_rate,
        "read_s": sum(during),
        "prompt_windows": len(prompt_windows),
        "prompt_window_ms_median": 1000 * statistics.median(prompt_windows),
        "prompt_window_host_ms_median": 1000 * statistics.median(host),
        "prompt_windows_replayed": replayed,
    }


def open_engine(
    config: dict[str, Any],
    exact: bool,
    eager: bool,
    kv_dtype: str = "auto",
    context: int = PREFILL_LEN,
    kv_memory: int = 8 << 30,
    kv_resident: int | None = None,
    expert_resident: int | None = None,
    model: CausalLM | None = None,
) -> EngineCore:
    """An in-process engine core on a random-weight model of the shape, built straight on the GPU (prompts
    of up to `context` tokens, keys and values of `kv_dtype` in `kv_memory` bytes, of which `kv_resident`
    tokens on the device when given; with `expert_resident`, that many experts a layer on the device and the
    others in pinned host RAM, adapting as `strata serve` does by default). `model`: one `bench_model` built
    with the same arguments, for another engine on the same weights."""
    device = "cuda"
    if model is None:
        model = bench_model(config, exact, expert_resident)
    path = Path(tempfile.mkdtemp(prefix="strata-bench-")) / "random"
    write_model_dir(path, config)
    loaded = LoadedModel(model, Tokenizer.from_dir(path), CheckpointDir(path), (), torch.device(device))
    engine = EngineConfig(
        model=str(path),
        device=device,
        dtype="bfloat16",
        parallel=max(DECODE_BATCHES),
        max_batched_tokens=PREFILL_LEN,
        kv_memory=kv_memory,
        kv_dtype=kv_dtype,
        kv_resident=kv_resident,
        max_model_len=context + 64,
        exact=exact,
        enforce_eager=eager,
    )
    return EngineCore(engine, loaded)


def bench_model(config: dict[str, Any], exact: bool, expert_resident: int | None = None) -> CausalLM:
    """The shape's random-weight model on the GPU, with `expert_resident` experts a layer on the device and
    the others in pinned host RAM when given (`open_engine`)."""
    backends = select_backends("auto", "cuda", exact=exact)
    if expert_resident is None:
        return build_model(config, backends, "cuda")
    from benchmarks.expert_tier import build_tiered_model

    return build_tiered_model(config, expert_resident, backends, spare=0)


def run_strata(config: dict[str, Any], exact: bool, eager: bool) -> dict[str, Any]:
    """Start an engine core on the random model, and time decode and prefill."""
    began = time.perf_counter()
    core = open_engine(config, exact, eager)
    torch.cuda.synchronize()
    vocab = config["vocab_size"]
    result: dict[str, Any] = {"backends": core.backends.name, "start_s": time.perf_counter() - began}
    for batch in DECODE_BATCHES:
        result[f"decode_bs{batch}"] = _decode(core, batch, vocab)
    result["prefill_8k"] = _prefill(core, vocab)
    result["peers_512"] = _peers_read(core, vocab, max(DECODE_BATCHES) - 1, 512)
    result["peers_8k"] = _peers_read(core, vocab, 4, PREFILL_LEN)
    shutil.rmtree(core.loaded.checkpoint.path.parent, ignore_errors=True)
    del core
    torch.cuda.empty_cache()
    return result


def bench_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The named shape with `layers` layers, or cut to as many as fit WEIGHT_BUDGET when it does not fit."""
    config = shape(name, layers=layers)
    if param_bytes(config) > WEIGHT_BUDGET:
        config = shape(name, layers=fit_layers(config, WEIGHT_BUDGET))
    return config


def bench_shape(
    name: str, skip_hf: bool, exact: bool, eager: bool, layers: int | None = None
) -> dict[str, Any]:
    """Every figure for one shape, as one flat JSON-ready dict."""
    config = bench_config(name, layers)
    bandwidth = measure_copy_bandwidth("cuda")
    line: dict[str, Any] = {
        "shape": name,
        "layers": config["num_hidden_layers"],
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "weights_gb": param_bytes(config) / 1e9,
    }
    for batch in DECODE_BATCHES:
        line[f"roofline_bs{batch}_tok_s"] = roofline_tok_s(
            config, batch, PROMPT_LEN + DECODE_STEPS, bandwidth
        )
    if not skip_hf:
        hf = run_reference(config, "cuda", batches=(1, 8), prefill_len=PREFILL_LEN)
        line["hf_decode_bs1_tok_s"] = hf["decode_tok_s"][1]
        line["hf_decode_bs8_tok_s"] = hf["decode_tok_s"][8]
        line["hf_prefill_8k_tok_s"] = hf["prefill_tok_s"]
        torch.cuda.empty_cache()
    ours = run_strata(config, exact, eager)
    line["backends"] = ours["backends"]
    line["start_s"] = ours["start_s"]
    for batch in DECODE_BATCHES:
        line[f"decode_bs{batch}_tok_s"] = ours[f"decode_bs{batch}"]["tok_s"]
        line[f"itl_bs{batch}_ms"] = ours[f"decode_bs{batch}"]["itl_ms_median"]
        line[f"finish_step_bs{batch}_ms"] = ours[f"decode_bs{batch}"]["finish_step_ms"]
    line["prefill_8k_tok_s"] = ours["prefill_8k"]["tok_s"]
    for case in ("peers_512", "peers_8k"):
        line.update({f"{case}_{key}": value for key, value in ours[case].items()})
    line["ttft_8k_s"] = ours["prefill_8k"]["ttft_s"]
    line["roofline_ratio_bs1"] = line["decode_bs1_tok_s"] / line["roofline_bs1_tok_s"]
    line["prompt_ceiling_tok_s"] = prompt_ceiling_tok_s(config, PREFILL_LEN)
    check_ceilings(line)
    if "hf_decode_bs1_tok_s" in line:
        line["speedup_vs_hf_bs1"] = line["decode_bs1_tok_s"] / line["hf_decode_bs1_tok_s"]
    return line


def check_ceilings(line: dict[str, Any]) -> None:
    """Fail on a figure the card cannot reach: a benchmark bug (a cache hit, a skipped step), not a result."""
    above = [
        f"decode at batch {b}: {line[f'decode_bs{b}_tok_s']:.0f} > {line[f'roofline_bs{b}_tok_s']:.0f} tok/s"
        for b in DECODE_BATCHES
        if line[f"decode_bs{b}_tok_s"] > line[f"roofline_bs{b}_tok_s"]
    ]
    if line["prefill_8k_tok_s"] > line["prompt_ceiling_tok_s"]:
        above.append(f"8K prompt: {line['prefill_8k_tok_s']:.0f} > {line['prompt_ceiling_tok_s']:.0f} tok/s")
    if above:
        raise SystemExit(f"figures above what the card can do ({'; '.join(above)}): {json.dumps(line)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", required=True, help="q30, q30-half or qnext (repeatable)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    parser.add_argument("--exact", action="store_true", help="run the engine with --exact")
    parser.add_argument("--enforce-eager", action="store_true", help="run the engine without CUDA graphs")
    parser.add_argument("--layers", type=int, help="cut every shape to this many layers")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA device")
    for name in args.shape:
        line = json.dumps(bench_shape(name, args.skip_hf, args.exact, args.enforce_eager, args.layers))
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(line + "\n")


if __name__ == "__main__":
    main()
