"""The expert tier on one GPU: decode and prompt speed with some or no experts resident, against all resident.

    python benchmarks/expert_tier.py [--shape q30-half] [--resident 0 32] [--routing uniform zipf]
        [--adapt frozen blocking async] [--adapt-every 16] [--pcie-frac F] [--phases] [--out results.jsonl]
        [--batches 1 8 16] [--prompts 2048 8192] [--no-whole] [--profile-prompts]

Builds the shape with random bf16 weights on the GPU, keeps every routed expert in pinned host RAM, and for
each routing, each resident count and each adaptation mode (frozen; blocking or asynchronous swaps every
`--adapt-every` windows) starts an in-process engine core and measures: decode tok/s at batch 1, 8 and 16
(an adapting tier after 6 adaptations' worth of warm-up windows, so it has followed the routing),
a 2K- and an 8K-token prompt read (tok/s, each prompt new: no prefix-cache hit), and where the timed windows'
routed entries were served (VRAM / CPU / PCIe shares). The all-resident model (every expert on the GPU, CUDA
graphs) runs first for each routing, as the reference speed (`--no-whole`: not). `--batches` and `--prompts`
choose the decode batches and prompt lengths timed (`--prompts` with none: no prompt timed); with
`--profile-prompts` each prompt length is read once more under the profiler (device time by kernel or copy,
host time by operation).

Routing: `uniform` is the random router's (close to uniform); `zipf` adds to each layer's router logits a bias
that makes expert e (in a random order per layer) about as likely as 1 / rank: the top quarter of the experts
then takes about three quarters of the picks; `demo` does the same with the shares the demo model's trained
router gives its experts on real text (milder: its top quarter takes 30-60%); `spread` draws each token's
experts nearly uniformly at random, so a prompt touches every expert as a trained router's long prompt does.
Prints a JSON line per configuration and fails on a figure above the machine's limits (a cache, not the
tier, would have served it).

`--phases` measures only batch-1 decode, with the host's time per tiered layer split by phase: replaying the
graph pieces, waiting for the device's work up to the layer's routing, planning (`plan`: reading the routing
and choosing; `stage`: the staging step's own work, `copy_timing` its timing events), queueing the staging
copies, filling the CPU pool's arguments, the CPU pool's kernel (with its run in the background, the default:
handing it over, `cpu_pool`, and waiting for it, by default after the next graph piece's launch,
`pool_wait_after`, with STRATA_POOL_DEVICE_WAIT=0 after the copies are queued, `pool_wait`), and the rest of
the step; and, from the profiler, the device's time per tiered layer by kernel or copy against the wall time a
layer. With the native host step (the default where the native kernels are built: `native_step` in each line;
STRATA_NATIVE_STEP=0 the Python one) the step is one call, so `plan` holds all of it but the copies' timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import EXPERT_SOURCES, AddRequest, SamplingParams
from app.kernels.backends import select_backends
from app.kernels.cpu_experts import (
    background_finish,
    experts_swiglu_sum,
    host_step,
    native_available,
    threads,
)
from app.kernels.interface import Backends
from app.loading.checkpoint import CheckpointDir
from app.loading.model import LoadedModel
from app.models.config import ModelConfig
from app.models.expert_costs import CopyTimes
from app.models.expert_tier import HostLink, PoolArgs, TieredExperts, use_expert_tier
from app.models.moe import RoutedExperts, SparseMoE
from app.models.pieces import Pieces
from app.models.placement import PLACEMENTS, layer_residency, spare_slots
from app.models.qwen3 import CausalLM
from app.models.tier_step import NativeSmallStep
from app.text.tokenizer import Tokenizer
from benchmarks.gpu_bench import WEIGHT_BUDGET, build_model, write_model_dir
from benchmarks.profile_window import kernel_times
from benchmarks.results import emit
from benchmarks.roofline import measure_copy_bandwidth, roofline_tok_s
from benchmarks.shapes import param_bytes, shape, with_layers

BATCHES = (1, 8, 16)
PROMPT_LEN = 128
ADAPTATIONS_BEFORE_TIMING = 6
TIMED_WINDOWS = 24
PROMPTS = (2048, 8192)
GUMBEL_STD = math.pi / math.sqrt(6)


class SkewedGate(nn.Module):
    """A router whose logits, scaled to the spread of Gumbel noise, get log(p) added per expert: top-k of them
    then draws experts about as `p` says, over a random order of the layer's experts."""

    def __init__(self, gate: nn.Module, shares: torch.Tensor, spread: float, seed: int) -> None:
        super().__init__()
        experts = shares.numel()
        self.gate = gate
        self.out_features = experts
        self.scale = GUMBEL_STD / spread
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(seed))
        bias = torch.empty(experts)
        bias[order] = torch.log(shares / shares.sum())
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) * self.scale + self.bias.to(x.dtype)


class SpreadGate(nn.Module):
    """A router whose picks spread over every expert of the layer as a trained router's do over a long
    prompt (a random model's prompt tokens route alike: a 2K prompt touched ~26 of 128 experts a layer):
    Gumbel noise drawn at every forward outweighs its logits, so top-k draws each token's experts nearly
    uniformly at random."""

    def __init__(self, gate: nn.Module, spread: float) -> None:
        super().__init__()
        self.gate = gate
        self.out_features = gate.out_features
        self.scale = 0.1 * GUMBEL_STD / spread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float() * self.scale
        uniform = torch.rand_like(logits).clamp_(1e-9, 1 - 1e-9)
        return (logits - torch.log(-torch.log(uniform))).to(x.dtype)


def zipf_shares(experts: int, layers: int) -> list[torch.Tensor]:
    """1 / rank for every layer."""
    return [1.0 / torch.arange(1, experts + 1, dtype=torch.float32)] * layers


def demo_shares(experts: int, layers: int) -> list[torch.Tensor]:
    """The demo model's routing on real text (this repository's README and architecture notes, 1,500 tokens
    read and 64 generated), each layer's shares sorted and stretched over `experts` experts and `layers`
    layers (the demo has 16 experts and 8 layers)."""
    from app.default_model import default_model_dir
    from app.loading.model import open_model

    loaded = open_model(default_model_dir(), "float32", "cpu", progress=False)
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()[:6000] + (root / "docs/ARCHITECTURE.md").read_text()[:6000]
    ids = loaded.tokenizer.encode(text)[:1500]
    core = EngineCore(
        EngineConfig(model=str(default_model_dir()), device="cpu", max_batched_tokens=2048), loaded
    )
    core.add_request(AddRequest("demo", ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)))
    counts = None
    while core.has_work():  # reports come every 0.5 s and when the engine falls idle: every pick is counted
        _, stats = core.step()
        if stats is not None and stats.experts is not None:
            routed = torch.tensor(stats.experts.routed, dtype=torch.float32)
            counts = routed if counts is None else counts + routed
    assert counts is not None
    demo = counts.sort(dim=1, descending=True).values
    stretch = experts // demo.shape[1]
    return [
        demo[layer * demo.shape[0] // layers].repeat_interleave(stretch) + 1e-3 for layer in range(layers)
    ]


class Tiering:
    """The model's MoE layers with both forms of their experts: all on the GPU, or a tier over pinned RAM."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            (moe, moe.experts)
            for moe in model.modules()
            if isinstance(moe, SparseMoE) and isinstance(moe.experts, RoutedExperts)
        ]
        self.gates = {moe: moe.gate for moe, _ in self.layers}
        self.blocks = {moe: moe.block_kernel for moe, _ in self.layers}

    def all_resident(self) -> None:
        for moe, routed in self.layers:
            moe.experts = routed

    def tiered(self, resident: int, asynchronous: bool, placement: str = "spread") -> list[TieredExperts]:
        """Fresh tiers with `resident` experts a layer on the GPU (laid over the layers by `placement`: a
        layer given all of them stays untiered), the others in pinned host RAM."""
        self.all_resident()
        gc.collect()  # the last configuration's tiers, and their pinned host memory
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
        tiers = []
        experts = self.layers[0][1].gate_up.shape[0]
        counts = layer_residency(resident * len(self.layers), len(self.layers), experts, placement)
        for (moe, routed), count in zip(self.layers, counts, strict=True):
            if count >= experts:
                continue
            _, _, hidden = routed.gate_up.shape
            spare = spare_slots(resident) if asynchronous else 0
            tier = TieredExperts(
                experts,
                hidden,
                routed.intermediate,
                routed.kernel,
                count,
                experts_swiglu_sum,
                spare,
                background_finish(),  # as the loader gives the engine's tiers
                host_step(),
            )
            tier.fill(routed.gate_up, routed.down, torch.device("cuda"))
            moe.experts = tier
            tiers.append(tier)
        torch.cuda.empty_cache()
        return tiers

    def route(self, routing: str, hidden: int) -> None:
        """Give every layer the named routing (module docstring)."""
        experts = self.gates[self.layers[0][0]].out_features
        shares = {"zipf": zipf_shares, "demo": demo_shares}.get(routing)
        per_layer = shares(experts, len(self.layers)) if shares is not None else None
        for i, (moe, _) in enumerate(self.layers):
            gate = self.gates[moe]
            if routing == "spread":
                moe.gate = SpreadGate(gate, 0.02 * hidden**0.5)
            elif per_layer is None:
                moe.gate = gate
            else:
                moe.gate = SkewedGate(gate, per_layer[i], 0.02 * hidden**0.5, i).cuda()
            # the fused MoE block routes by the gate's weight alone: a replaced router takes the unfused path
            moe.block_kernel = self.blocks[moe] if moe.gate is gate else None


class BuiltTiers(Tiering):
    """A shape larger than the card, built tiered from the start (`build_tiered_model`): its one resident
    count and adaptation mode, no all-resident form."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            (moe, moe.experts)
            for moe in model.modules()
            if isinstance(moe, SparseMoE) and isinstance(moe.experts, TieredExperts)
        ]
        self.gates = {moe: moe.gate for moe, _ in self.layers}
        self.blocks = {moe: moe.block_kernel for moe, _ in self.layers}

    def all_resident(self) -> None:
        raise SystemExit("a shape larger than the card has no all-resident form")

    def tiered(self, resident: int, asynchronous: bool, placement: str = "spread") -> list[TieredExperts]:
        if placement != "spread":
            raise SystemExit("a shape larger than the card is built with every layer tiered alike")
        tiers = [tier for _, tier in self.layers]
        if resident != tiers[0].resident or asynchronous != bool(tiers[0].spare):
            raise SystemExit("a shape larger than the card is built once: one --resident and one --adapt")
        for tier in tiers:
            tier.place(torch.device("cuda"))
        return tiers


def initial_vectors(config: dict[str, Any], backends: Backends) -> Callable[[str], torch.Tensor]:
    """Each 1-D parameter's initial value (norm weights, the delta rule's dt_bias and A_log) by name: a
    model built on meta has none, so they come from a 4-layer copy of the shape with 2 experts, built on the
    CPU, its layer of the same type standing for each layer."""
    small = {**with_layers(config, min(4, config["num_hidden_layers"])), "vocab_size": 16}
    small.update(num_experts=2, num_experts_per_tok=1)
    model = CausalLM(ModelConfig.from_dict(small), backends=backends)
    types, small_types = ModelConfig.from_dict(config).layer_types, ModelConfig.from_dict(small).layer_types
    params = dict(model.named_parameters())

    def value(name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(small_types.index(types[int(parts[2])]))
        return params[".".join(parts)].detach()

    return value


def build_tiered_model(config: dict[str, Any], resident: int, backends: Backends, spare: int) -> CausalLM:
    """The shape with random bf16 weights (std 0.02, 1-D ones as initialised), its experts tiered from the
    start: the resident ones on the GPU, the others generated on the GPU a layer's expert at a time and
    copied to pinned host RAM. No full copy of the experts exists anywhere, so the shape may be larger than
    the card (and than host RAM)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_dict(config), backends=backends)
            use_expert_tier(model, resident, experts_swiglu_sum, spare, background_finish(), host_step())
        initial = initial_vectors(config, backends)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                host = isinstance(module, TieredExperts) and name in TieredExperts.HOST_PARAMETERS
                tensor = torch.empty(
                    param.shape, dtype=torch.bfloat16, device="cpu" if host else "cuda", pin_memory=host
                )
                if param.dim() < 2:
                    tensor.copy_(initial(f"{prefix}.{name}" if prefix else name))
                elif host:
                    for i in range(param.shape[0]):
                        part = torch.empty(param.shape[1:], dtype=torch.bfloat16, device="cuda")
                        tensor[i].copy_(part.normal_(0.0, 0.02, generator=generator))
                else:
                    tensor.normal_(0.0, 0.02, generator=generator)
                setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    model.model.rotary.to("cuda")
    for module in model.modules():
        if isinstance(module, TieredExperts):
            module.place(torch.device("cuda"))
    return model.eval()


def open_core(
    loaded: LoadedModel, adapt_every: int, asynchronous: bool, pcie_frac: float | None
) -> EngineCore:
    engine = EngineConfig(
        model=str(loaded.checkpoint.path),
        device="cuda",
        dtype="bfloat16",
        parallel=max(BATCHES),
        max_batched_tokens=max(PROMPTS),
        kv_memory=8 << 30,
        max_model_len=max(PROMPTS) + 64,
        adapt_every=adapt_every,
        adapt_async=asynchronous,
        pcie_frac=pcie_frac,
        park_memory=0,
    )
    return EngineCore(engine, loaded)


def drain(tiers: list[TieredExperts]) -> tuple[list[int], int]:
    """Entries served from VRAM / CPU / PCIe and bytes copied since the tiers' counts were last taken."""
    counts = [t.take_counts() for t in tiers]
    served = [sum(c) for c in zip(*(c.served for c in counts), strict=True)] if tiers else [0, 0, 0]
    return served, sum(c.pcie_bytes for c in counts)


def decode(
    core: EngineCore, tiers: list[TieredExperts], batch: int, vocab: int, warm: int
) -> tuple[float, list[int]]:
    """Aggregate tok/s of `batch` requests over TIMED_WINDOWS decode windows after `warm` others, and where
    the timed windows' routed entries were served (the engine's reports in between included)."""
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=warm + TIMED_WINDOWS + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist()
        core.add_request(AddRequest(f"d{batch}-{i}-{time.monotonic()}", prompt, params))
    timed, seen, served = [], 0, [0, 0, 0]
    while core.has_work():
        if seen == warm:
            drain(tiers)
        _, stats = core.step()
        if stats is None or stats.prompt_tokens or stats.decode_tokens != batch:
            continue
        seen += 1
        if warm < seen <= warm + TIMED_WINDOWS:
            timed.append(stats.duration_s)
            if stats.experts is not None and stats.experts.served is not None:
                served = [a + b for a, b in zip(served, stats.experts.served_total(), strict=True)]
        if seen == warm + TIMED_WINDOWS:
            served = [a + b for a, b in zip(served, drain(tiers)[0], strict=True)]
    return batch * len(timed) / sum(timed), served


def read_prompt(
    core: EngineCore, tiers: list[TieredExperts], length: int, vocab: int, seed: int
) -> dict[str, float]:
    """One new `length`-token prompt read: tok/s over the wall time from its arrival to its first token (and
    over the engine's window durations, which should agree), and the bytes the tier copied to the device."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (length,), generator=generator).tolist()
    drain(tiers)
    began = time.perf_counter()
    core.add_request(AddRequest(f"p{seed}", prompt, SamplingParams(max_tokens=1, temperature=0)))
    duration, hits, copied, windows, served = 0.0, 0, 0, 0, [0, 0, 0]
    while core.has_work():
        _, stats = core.step()
        if stats is not None:
            duration += stats.duration_s
            hits += stats.prefix_cache_hits
            windows += stats.prompt_tokens > 0
            if stats.experts is not None:
                copied += stats.experts.pcie_bytes
                served = [a + b for a, b in zip(served, stats.experts.served_total(), strict=True)]
    wall = time.perf_counter() - began
    last, last_copied = drain(tiers)
    copied += last_copied
    served = [a + b for a, b in zip(served, last, strict=True)]
    if hits:
        raise RuntimeError(f"the timed prompt was served {hits} tokens from the prefix cache")
    return {
        "tok_s": length / wall,
        "windows_tok_s": length / duration,
        "pcie_gb": copied / 1e9,
        "wall_s": wall,
        "windows": windows,
        "cpu_share": served[1] / max(sum(served), 1),
    }


def pinned_copy_rate(gigabytes: int = 1) -> float:
    """Bytes per second of a large pinned host-to-device copy (the best of three): the link's limit."""
    source = torch.empty(gigabytes << 30, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(source, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return source.nbytes / best


def measure(
    core: EngineCore,
    tiers: list[TieredExperts],
    vocab: int,
    warm: int,
    batches: tuple[int, ...] = BATCHES,
    prompts: tuple[int, ...] = PROMPTS,
) -> dict[str, Any]:
    """Decode at each of `batches` concurrent requests and each of `prompts` read, with the tier's shares."""
    line: dict[str, Any] = {}
    read_prompt(core, tiers, PROMPTS[0], vocab, 1)  # kernels compiled for prompt-sized windows
    totals = [0, 0, 0]
    for batch in batches:
        tok_s, served = decode(core, tiers, batch, vocab, warm)
        line[f"decode_bs{batch}_tok_s"] = round(tok_s, 1)
        totals = [a + b for a, b in zip(totals, served, strict=True)]
    pcie = pinned_copy_rate() if tiers else None
    for length in prompts:
        read = read_prompt(core, tiers, length, vocab, 100 + length)
        line[f"prompt_{length}_tok_s"] = round(read["tok_s"], 1)
        line[f"prompt_{length}_windows_tok_s"] = round(read["windows_tok_s"], 1)
        line[f"prompt_{length}_windows"] = read["windows"]
        line[f"prompt_{length}_cpu_share"] = round(read["cpu_share"], 3)
        if tiers:
            layer_bytes = len(tiers) * tiers[0].expert_bytes()
            line[f"prompt_{length}_experts_copied_per_layer"] = round(read["pcie_gb"] * 1e9 / layer_bytes, 1)
            line[f"prompt_{length}_pcie_gb_s"] = round(read["pcie_gb"] / read["wall_s"], 1)
            line["link_gb_s"] = round(pcie / 1e9, 1) if pcie is not None else None
            if pcie is not None and read["pcie_gb"] * 1e9 / read["wall_s"] > 1.05 * pcie:
                raise SystemExit(f"more bytes over PCIe than the link carries: {json.dumps(line)}")
    total = sum(totals)
    if total:
        line.update(
            {f"decode_{k}_share": round(v / total, 3) for k, v in zip(EXPERT_SOURCES, totals, strict=True)}
        )
    return line


class PhaseTimes:
    """Host seconds by phase of the tiered layers' steps in decode forwards (replays of graph pieces) for
    `--phases`, by wrapping the functions they call; the prompt window's eager forward is left out."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.forwards = 0
        self.inside = False
        self.serving = False  # inside a tier's miss service (a pool's wait outside it: after the next launch)
        self.classes: list[tuple[type, str, Callable]] = []  # the methods wrapped, to put back (`uninstall`)

    def timed(self, function: Callable, phase: str) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.inside and phase != "forward":
                return function(*args, **kwargs)
            self.inside = True
            counted = phase if phase != "pool_wait" or self.serving else "pool_wait_after"
            self.serving = self.serving or phase == "serve"
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[counted] += time.perf_counter() - began
                if phase == "serve":
                    self.serving = False
                if phase == "forward":
                    self.inside = False
                    self.forwards += 1

        return run

    def install(self, tiers: list[TieredExperts]) -> None:
        """Time every graph piece's replay, each tier's whole miss service and its parts."""
        for owner, name, phase in (
            (torch.cuda.CUDAGraph, "replay", "replay"),
            (Pieces, "replay", "forward"),
            (TieredExperts, "_serve_small", "serve"),
            (NativeSmallStep, "serve", "serve"),
            (TieredExperts, "_serve_large", "serve"),
            (HostLink, "wait", "wait"),
            (TieredExperts, "_stage", "stage"),
            (CopyTimes, "start", "copy_timing"),
            (CopyTimes, "stop", "copy_timing"),
            (PoolArgs, "fill", "pool_args"),
        ):
            method = getattr(owner, name)
            self.classes.append((owner, name, method))
            setattr(owner, name, self.timed(method, phase))
        staging = tiers[0].staging
        if staging is not None:
            staging.load = self.timed(staging.load, "copies")  # type: ignore[method-assign]
        for tier in tiers:
            tier.host_kernel = self.timed(tier.host_kernel, "cpu_pool")
            if tier.host_finish is not None:
                tier.host_finish = self.timed(tier.host_finish, "pool_wait")

    def uninstall(self) -> None:
        """Put the classes' methods back (the tiers' own wrappers go with the tiers)."""
        for owner, name, method in reversed(self.classes):
            setattr(owner, name, method)
        self.classes = []

    def per_layer_us(self, layers: int) -> dict[str, float]:
        """Microseconds a decode forward spends per tiered layer in each phase."""
        s = self.seconds
        # the copies' timing runs inside `_stage` in the Python step, inside the whole call in the native one
        timing_in_stage = s["copy_timing"] if s["stage"] else 0.0
        phases = {
            "forward": s["forward"],
            "replay": s["replay"],
            "wait": s["wait"],
            "plan": s["serve"]
            - s["stage"]
            - s["pool_args"]
            - s["cpu_pool"]
            - s["pool_wait"]
            - (s["copy_timing"] - timing_in_stage),
            "stage": s["stage"] - s["copies"] - timing_in_stage,
            "copy_timing": s["copy_timing"],
            "pool_args": s["pool_args"],
            "copies": s["copies"],
            "cpu_pool": s["cpu_pool"],
            "pool_wait": s["pool_wait"],
            # the pool joined after the next graph's launch (the device waiting for it)
            "pool_wait_after": s["pool_wait_after"],
            "hand_back": s["forward"] - s["replay"] - s["wait"] - s["serve"] - s["pool_wait_after"],
        }
        return {k: round(v / max(self.forwards, 1) / layers * 1e6, 1) for k, v in phases.items()}


def phases(core: EngineCore, tiers: list[TieredExperts], vocab: int, warm: int) -> dict[str, Any]:
    """Batch-1 decode with the host's time per tiered layer by phase (`PhaseTimes`)."""
    read_prompt(core, tiers, PROMPTS[0], vocab, 1)
    decode(core, tiers, 1, vocab, warm)  # graphs captured and replayed before the timers go in
    device = device_times(core, tiers, vocab)
    times = PhaseTimes()
    times.install(tiers)
    try:
        tok_s, served = decode(core, tiers, 1, vocab, warm)
    finally:
        times.uninstall()  # a later configuration's phases are timed by wrappers of its own
    total = max(sum(served), 1)
    return {
        "decode_bs1_tok_s": round(tok_s, 1),
        "us_per_layer": times.per_layer_us(len(tiers)),
        **device,
        **{f"decode_{k}_share": round(v / total, 3) for k, v in zip(EXPERT_SOURCES, served, strict=True)},
    }


def device_times(
    core: EngineCore, tiers: list[TieredExperts], vocab: int, windows: int = 24
) -> dict[str, Any]:
    """Batch-1 decode windows under the profiler: the device's time per tiered layer by kernel or copy
    (the 12 largest, microseconds a layer), their sum and the wall time a layer, which say whether a tiered
    layer waits for the host or for extra device work."""
    params = SamplingParams(max_tokens=windows + 12, temperature=0, ignore_eos=True)
    prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    core.add_request(AddRequest(f"profiled-{time.monotonic()}", prompt, params))

    def decode_windows(count: int) -> None:
        seen = 0
        while seen < count:
            _, stats = core.step()
            if stats is not None and not stats.prompt_tokens and stats.decode_tokens == 1:
                seen += 1

    decode_windows(4)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        began = time.perf_counter()
        decode_windows(windows)
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    while core.has_work():
        core.step()
    per_layer = windows * len(tiers)
    device = kernel_times(profiled)
    return {
        "wall_us_per_layer": round(wall * 1e6 / per_layer, 1),
        "device_us_per_layer": round(sum(us for _, us, _ in device) / per_layer, 1),
        "device_by_kernel": {name[:60]: round(us / per_layer, 1) for name, us, _ in device[:12]},
    }


def prompt_profile(core: EngineCore, tiers: list[TieredExperts], length: int, vocab: int) -> dict[str, Any]:
    """One more new `length`-token prompt read under the profiler: its wall time, the device's time by kernel
    or copy and the host's by operation (the 12 largest of each, milliseconds), which say whether the read
    waits for the link, the device's compute or the host."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        read = read_prompt(core, tiers, length, vocab, seed=length + 1)
        torch.cuda.synchronize()
    host = sorted(
        ((e.key, e.self_cpu_time_total) for e in profiled.key_averages() if e.self_cpu_time_total > 0),
        key=lambda e: -e[1],
    )
    device = kernel_times(profiled)
    return {
        f"prompt{length}_profiled_wall_s": round(read["wall_s"], 3),
        f"prompt{length}_device_ms": round(sum(us for _, us, _ in device) / 1e3, 1),
        f"prompt{length}_device_by_kernel_ms": {name[:60]: round(us / 1e3, 1) for name, us, _ in device[:12]},
        f"prompt{length}_host_by_op_ms": {name[:60]: round(us / 1e3, 1) for name, us in host[:12]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="q30-half")
    parser.add_argument("--resident", type=int, nargs="+", default=[0, 32])
    parser.add_argument(
        "--routing", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf", "demo", "spread"]
    )
    parser.add_argument(
        "--adapt", nargs="+", default=["frozen", "blocking"], choices=["frozen", "blocking", "async"]
    )
    parser.add_argument("--adapt-every", type=int, default=16)
    parser.add_argument("--placement", default="spread", choices=PLACEMENTS)
    parser.add_argument("--pcie-frac", type=float, nargs="+", default=[None])
    parser.add_argument("--phases", action="store_true", help="batch-1 decode only, host time by phase")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="decode batches timed")
    parser.add_argument("--prompts", type=int, nargs="*", default=list(PROMPTS), help="prompt lengths read")
    parser.add_argument("--no-whole", action="store_true", help="no all-resident run before the tiered ones")
    parser.add_argument(
        "--profile-prompts", action="store_true", help="read each prompt once more under the profiler"
    )
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("expert_tier needs a CUDA device")
    config = shape(args.shape)
    backends = select_backends("auto", "cuda")
    large = param_bytes(config) > WEIGHT_BUDGET  # built tiered: never whole on the card
    if large:
        if len(args.resident) != 1 or len(args.adapt) != 1:
            raise SystemExit(f"{args.shape} is larger than the card: give one --resident and one --adapt")
        spare = spare_slots(args.resident[0]) if args.adapt == ["async"] else 0
        model = build_tiered_model(config, args.resident[0], backends, spare)
        tiering: Tiering = BuiltTiers(model)
    else:
        model = build_model(config, backends, "cuda")
        tiering = Tiering(model)
    path = Path(tempfile.mkdtemp(prefix="strata-tier-")) / "random"
    write_model_dir(path, config)
    loaded = LoadedModel(model, Tokenizer.from_dir(path), CheckpointDir(path), (), torch.device("cuda"))
    bandwidth = measure_copy_bandwidth("cuda")
    base = {
        "shape": args.shape,
        "layers": config["num_hidden_layers"],
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "native_cpu_kernel": native_available(),
        "native_step": host_step() is not None,
        "cpu_threads": threads(),
    }
    vocab = config["vocab_size"]
    whole = not (large or args.no_whole)
    runs: list[tuple[int | None, str, float | None]] = [(None, "frozen", None)] if whole else []
    for resident in args.resident:
        for adapt in args.adapt if resident else ["frozen"]:
            runs += [(resident, adapt, frac) for frac in args.pcie_frac]
    for routing in args.routing:
        tiering.route(routing, config["hidden_size"])
        for resident, adapt, frac in runs:
            if resident is None:
                tiering.all_resident()
                tiers: list[TieredExperts] = []
            else:
                tiers = tiering.tiered(resident, adapt == "async", args.placement)
            every = 0 if adapt == "frozen" else args.adapt_every
            core = open_core(loaded, every, adapt == "async", frac)
            line = {**base, "routing": routing, "resident": resident, "adapt": adapt, "adapt_every": every}
            line["placement"] = args.placement
            line["pcie_frac"] = frac
            costs = tiers[0].costs if tiers else None
            if costs is not None:
                line["pcie_gb_s"] = round(costs.pcie_bytes_s / 1e9, 1)
                line["cpu_gb_s"] = round(costs.cpu_bytes_s / 1e9, 1)
                line["cpu_row_us"] = round(costs.cpu_row_s * 1e6, 1)
                line["cpu_call_us"] = round(costs.cpu_call_s * 1e6, 1)
            warm = ADAPTATIONS_BEFORE_TIMING * every if every else 4
            if args.phases and tiers:
                line.update(phases(core, tiers, vocab, warm))
            elif args.phases:
                line["decode_bs1_tok_s"] = round(decode(core, tiers, 1, vocab, warm)[0], 1)
            else:
                line.update(measure(core, tiers, vocab, warm, tuple(args.batches), tuple(args.prompts)))
                for length in args.prompts if args.profile_prompts else ():
                    line.update(prompt_profile(core, tiers, length, vocab))
            if resident is None and "decode_bs1_tok_s" in line:
                roofline = roofline_tok_s(config, 1, PROMPT_LEN + TIMED_WINDOWS, bandwidth)
                line["roofline_bs1_tok_s"] = round(roofline, 1)
                if line["decode_bs1_tok_s"] > roofline:
                    raise SystemExit(f"decode above the card's roofline: {json.dumps(line)}")
            emit(line, args.out)
            # this configuration's engine and tiers let go before the next one's are built (else both are
            # on the card at once: 96 resident then none ran out of memory)
            del core, costs
            tiers = []
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
