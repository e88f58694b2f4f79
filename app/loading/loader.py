"""Build a model on the meta device and fill it from an HF directory's memory-mapped tensors."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app.kernels.backends import CPU_HELD_BLOCKS
from app.kernels.cpu_experts import background_finish, experts_swiglu_sum, host_step
from app.kernels.interface import Backends, held_row_bytes
from app.kernels.reference import REFERENCE
from app.loading.checkpoint import Checkpoint, open_checkpoint
from app.loading.fill import ParallelFill
from app.loading.host_pages import HostPages, pin_all
from app.loading.progress import Progress
from app.loading.safetensors import CheckpointError
from app.models.attention import Attention
from app.models.expert_tier import TieredExperts, moe_layers, use_expert_tier
from app.models.layers import Linear, hold_blocks
from app.models.moe import RoutedExperts
from app.models.placement import layer_residency
from app.models.qwen3 import CausalLM, ModelPart

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass
class TensorSource:
    """Where one checkpoint tensor goes: a parameter, and the index of the part it fills."""

    param: str
    index: tuple


CPU_FP32_RAM_SHARE = 0.25  # on a CPU, `auto` widens 16-bit weights to fp32 while they fit this of RAM


def resolve_dtype(name: str, checkpoint: Checkpoint, device: torch.device | str = "cuda") -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 when it names none), except on a CPU, where 16-bit
    weights are widened to float32 when that fits a quarter of the host's RAM (torch's CPU matmuls of one or
    a few rows run faster in fp32 than in bf16, also on CPUs with bf16 instructions); otherwise the named
    dtype."""
    if name == "auto":
        name = checkpoint.config.dtype or "float32"
        if torch.device(device).type == "cpu" and name != "float32" and _fits_in_fp32(checkpoint):
            name = "float32"
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def weight_elements(checkpoint: Checkpoint) -> int:
    """How many weights the checkpoint's tensors hold."""
    return sum(math.prod(checkpoint.shape(name)) for name in checkpoint.names())


def _fits_in_fp32(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint's tensors in fp32 take at most CPU_FP32_RAM_SHARE of the host's RAM."""
    elements = weight_elements(checkpoint)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 4 * elements <= CPU_FP32_RAM_SHARE * ram


def experts_within(
    path: Path | str,
    dtype: str,
    budget: int,
    device: torch.device | str = "cuda",
    part: ModelPart | None = None,
    backends: Backends | None = None,
) -> int | None:
    """How many experts of each MoE layer (MTP layers included) fit `budget` bytes of `device` memory in the
    weights' dtype, or as the file's blocks where `backends` hold a tier's experts so (`tier_expert_bytes`):
    the `--expert-vram` form of `--expert-cache`; None when every expert fits. With `part` (a stage of a
    layer split, on its own card) only its layers count."""
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    held = range(config.num_hidden_layers) if part is None else part.layers
    mtp = mtp_layer_count(checkpoint) if config.num_experts and (part is None or part.first) else 0
    layers = sum(config.moe_layers[i] for i in held) + mtp
    if not layers:
        return None
    element = torch.empty((), dtype=resolve_dtype(dtype, checkpoint, device)).element_size()
    fits = budget // (layers * tier_expert_bytes(checkpoint, backends, element))
    return None if fits >= config.num_experts else fits


def tier_expert_bytes(checkpoint: Checkpoint, backends: Backends | None, element: int) -> int:
    """An expert's bytes in an expert tier: the file's blocks, where its projections are blocks that
    `backends` and the CPU pool's kernel read in place, of one type or (`Backends.held_apart`) the down
    projection of another (the tier then holds them so, `_hold_tier_alike`); else widened to weights of
    `element` bytes."""
    config = checkpoint.config
    held = _held_expert_bytes(checkpoint, backends)
    return held or 3 * config.hidden_size * config.moe_intermediate_size * element


def _held_expert_bytes(checkpoint: Checkpoint, backends: Backends | None) -> int | None:
    """`tier_expert_bytes` where the tier holds the file's blocks; else None."""
    reads = getattr(checkpoint, "held_blocks", None)
    config = checkpoint.config
    if reads is None or backends is None or not any(config.moe_layers):
        return None
    layer = config.moe_layers.index(True)
    kinds = []
    for projections in (("gate", "up"), ("down",)):
        found = {reads(f"model.layers.{layer}.mlp.experts.0.{p}_proj.weight") for p in projections}
        kinds.append({None if f is None else f[0] for f in found})
    if any(len(k) != 1 for k in kinds):
        return None
    gate, down = (k.pop() for k in kinds)
    readable = backends.held_blocks.intersection(CPU_HELD_BLOCKS)
    if gate not in readable or down not in readable or (gate != down and not backends.held_apart):
        return None
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    return 2 * inter * held_row_bytes(gate, hidden) + hidden * held_row_bytes(down, inter)


def mtp_layer_count(checkpoint: Checkpoint) -> int:
    """MTP layers to build: from config.json when it says, else from the `mtp.layers.N` tensors present."""
    if checkpoint.config.model_type != "qwen3_next":
        return 0
    found = {int(m.group(1)) for name in checkpoint.names() if (m := _MTP_LAYER.match(name))}
    has_mtp = any(name.startswith("mtp.") for name in checkpoint.names())
    if not has_mtp:
        return 0
    return checkpoint.config.mtp_layers or (max(found) + 1 if found else 0)


def tensor_sources(model: nn.Module) -> dict[str, TensorSource]:
    """Checkpoint tensor name -> its place in the model, following HF's names."""
    sources: dict[str, TensorSource] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if hasattr(module, "checkpoint_parts"):
            for name, (param, index) in module.checkpoint_parts(dot).items():
                sources[name] = TensorSource(f"{dot}{param}", index)
            continue
        for name, _ in module.named_parameters(recurse=False):
            sources[f"{dot}{name}"] = TensorSource(f"{dot}{name}", ())
    return sources


def load_model(
    path: Path | str,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    progress: bool = True,
    backends: Backends = REFERENCE,
    resident_experts: int | None = None,
    spare_experts: int = 0,
    part: ModelPart | None = None,
    placement: str = "spread",
) -> tuple[CausalLM, Checkpoint]:
    """Load an HF directory into a CausalLM on `device`, checking every tensor's presence, name and shape.

    With `resident_experts` below the model's experts per layer, every MoE layer gets an expert tier: its
    experts load to host memory, and only the resident ones are copied to `device` (models/expert_tier.py),
    beside `spare_experts` free slots a layer for asynchronous swaps; `placement` lays that budget (so many
    experts a layer) over the layers (`layer_residency`). With `part` (a stage of a layer split) only that
    part's tensors are read; the rest of the model is `Absent`.
    """
    checkpoint = open_checkpoint(path)
    target = resolve_dtype(dtype, checkpoint, device)
    tiered = resident_experts is not None and resident_experts < checkpoint.config.num_experts
    with torch.device("meta"):
        model = CausalLM(checkpoint.config, mtp_layers=mtp_layer_count(checkpoint), backends=backends)
        known = set(tensor_sources(model))  # every tensor the whole model reads
        if part is not None:
            model.keep_part(part)
        if tiered:
            assert resident_experts is not None
            layers, experts = moe_layers(model), checkpoint.config.num_experts
            counts = layer_residency(resident_experts * layers, layers, experts, placement)
            use_expert_tier(
                model, counts, experts_swiglu_sum, spare_experts, background_finish(), host_step()
            )
    sources = tensor_sources(model)
    packed = _hold_blocks(model, checkpoint, sources, backends)
    params = dict(model.named_parameters())
    names = checkpoint.names()
    for name in names:
        if name in known:
            continue
        if name == "lm_head.weight" and checkpoint.config.tie_word_embeddings:
            continue
        raise CheckpointError(f"unexpected tensor {name} in {checkpoint.path}")
    missing = sorted(set(sources) - set(names))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more} in {checkpoint.path}")
    for name, source in sources.items():
        expected = tuple(params[source.param][source.index].shape)
        found = checkpoint.shape(name)
        if source.param in packed:
            found = (*found[:-1], held_row_bytes(packed[source.param], found[-1]))
        if found != expected:
            raise CheckpointError(
                f"wrong shape for {name} in {checkpoint.path}: checkpoint has {list(found)}, model expects "
                f"{list(expected)}"
            )
    host = {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, TieredExperts)
        for name in module.HOST_PARAMETERS
    }
    narrow = _bf16_weights(model, checkpoint, target, backends, packed)
    state = _fill(params, sources, checkpoint, target, torch.device(device), host, narrow, packed, progress)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.model.rotary.to(device)
    for module in model.modules():
        if isinstance(module, TieredExperts):
            module.place(torch.device(device))
    return model.eval(), checkpoint


def hold_file_blocks(model: CausalLM, checkpoint: Checkpoint, backends: Backends) -> dict[str, str]:
    """Make the parameters of `model` (built on the meta device) that `load_model` would fill with the file's
    blocks on `backends` held weights (`_hold_blocks`), as sizes: parameter name -> quant type."""
    return _hold_blocks(model, checkpoint, tensor_sources(model), backends)


def _holders(model: CausalLM, backends: Backends) -> dict[str, tuple[nn.Module, str]]:
    """The parameters whose kernels read a file's blocks in place on these backends: parameter name ->
    (its module, its name there). The routed experts where the set's experts kernel reads blocks (an expert
    tier's on the device and in host RAM alike); with `held_linear`, the weights of the projections that go
    through its linear kernel."""
    holders: dict[str, tuple[nn.Module, str]] = {}
    if not backends.held_blocks:
        return holders
    for prefix, module in model.named_modules():
        if type(module) is RoutedExperts:
            holders |= {f"{prefix}.{name}": (module, name) for name in ("gate_up", "down")}
        elif isinstance(module, TieredExperts):
            resident = ("gate_up", "down") if module.gate_up is not None else ()
            names = (*TieredExperts.HOST_PARAMETERS, *resident)
            holders |= {f"{prefix}.{name}": (module, name) for name in names}
        elif backends.held_linear and isinstance(module, Linear) and module.kernel is not None:
            holders[f"{prefix}.weight"] = (module, "weight")
        elif backends.held_linear and isinstance(module, Attention) and module.linear_kernel is not None:
            holders[f"{prefix}.qkv_weight"] = (module, "qkv_weight")
    return holders


def _hold_blocks(
    model: CausalLM, checkpoint: Checkpoint, sources: dict[str, TensorSource], backends: Backends
) -> dict[str, str]:
    """Hold as the file's blocks (`layers.hold_blocks`) every parameter the backends' kernels can read so
    (`_holders`) whose checkpoint tensors are all of one quant type of `Backends.held_blocks`, read as they
    lie (a GGUF file's); they are filled from the file's bytes without dequantizing. An expert's two
    projections are held alike, or of two types where the set takes that (`Backends.held_apart`). Returns
    parameter name -> quant type."""
    holders = _holders(model, backends)
    reads_blocks = getattr(checkpoint, "held_blocks", None)
    if not holders or reads_blocks is None:
        return {}
    kinds: dict[str, set[str | None]] = {}
    for name, source in sources.items():
        if source.param in holders:
            found = reads_blocks(name)
            kinds.setdefault(source.param, set()).add(found[0] if found is not None else None)
    chosen = {
        param: next(iter(found))
        for param, found in kinds.items()
        if len(found) == 1 and next(iter(found)) in backends.held_blocks
    }
    for param, (module, name) in holders.items():
        down = param.removesuffix(name) + "down"
        pair = chosen.get(param), chosen.get(down)
        apart = backends.held_apart and None not in pair
        if isinstance(module, RoutedExperts) and name == "gate_up" and pair[0] != pair[1] and not apart:
            chosen.pop(param, None)  # this set's experts kernel takes both projections in one kind
            chosen.pop(down, None)
        if isinstance(module, TieredExperts) and name == "host_gate_up":
            prefix = param.removesuffix(name)
            parts = [n for n in TIER_PARTS if prefix + n in holders]
            _hold_tier_alike(chosen, prefix, parts, backends.held_apart)
    for param, kind in chosen.items():
        module, name = holders[param]
        hold_blocks(module, name, kind)
    return chosen


# A tier's parameters: its experts in host RAM, and those on the device
TIER_PARTS = ("host_gate_up", "host_down", "gate_up", "down")


def _hold_tier_alike(chosen: dict[str, str], prefix: str, names: list[str], apart: bool) -> None:
    """Keep a tier's parameters (`names` of TIER_PARTS after `prefix`) held only where each projection is of
    one quant type on the device and in host RAM that the CPU pool's kernel reads too (`CPU_HELD_BLOCKS`), and
    the gate and up's is the down's, or may differ (`apart`: the set's experts kernel takes two types): its
    experts then move between the device and host RAM as they lie, and a miss is computed from them on
    either."""
    gate = {chosen.get(prefix + n) for n in names if n.endswith("gate_up")}
    down = {chosen.get(prefix + n) for n in names if n.endswith("down")}
    kinds = gate | down
    alike = len(gate) == len(down) == 1 and (len(kinds) == 1 or apart)
    if not alike or not kinds.issubset(CPU_HELD_BLOCKS):
        for name in names:
            chosen.pop(prefix + name, None)


def _bf16_weights(
    model: CausalLM, checkpoint: Checkpoint, target: torch.dtype, backends: Backends, packed: dict[str, str]
) -> set[str]:
    """The matrices to keep in bf16 in a wider model, where the backends' kernels read bf16 weights with fp32
    arithmetic (`Backends.bf16_weights`): the routed experts and the weights of projections that go through
    the backends' linear kernel (unless they are held as blocks, `packed`), each where the checkpoint stores
    it in bf16, so nothing is rounded."""
    if not backends.bf16_weights or target == torch.bfloat16:
        return set()
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            names |= {f"{prefix}.gate_up", f"{prefix}.down"}
        elif isinstance(module, Linear) and module.kernel is not None:
            names.add(f"{prefix}.weight")
        elif isinstance(module, Attention) and module.linear_kernel is not None:
            names.add(f"{prefix}.qkv_weight")
    names -= set(packed)
    stored: dict[str, set[torch.dtype]] = {}
    dtype_of = getattr(checkpoint, "dtype_of", None)  # weights drawn as they load: without drawing
    for name, source in tensor_sources(model).items():
        if source.param in names:
            dtype = dtype_of(name) if dtype_of is not None else checkpoint.tensor(name).dtype
            stored.setdefault(source.param, set()).add(dtype)
    return {name for name, dtypes in stored.items() if dtypes == {torch.bfloat16}}


def _fill(
    params: dict[str, nn.Parameter],
    sources: dict[str, TensorSource],
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    host: set[str],
    narrow: set[str],
    packed: dict[str, str],
    progress: bool,
) -> dict[str, torch.Tensor]:
    """Materialise every parameter: a mapped view where no conversion is needed on the host, else a filled
    tensor, read in parallel from the files where the checkpoint says where its bytes lie (ParallelFill);
    the parameters named in `host` in host memory whatever `device` is (for a GPU pinned once filled,
    `HostPages`); those in `narrow` in bf16; those in `packed` from the checkpoint's blocks."""
    state: dict[str, torch.Tensor] = {}
    to_pin: list[HostPages] = []

    def allocate(shape: Sequence[int], kind: torch.dtype, where: torch.device, pin: bool) -> torch.Tensor:
        if not pin:
            return torch.empty(shape, dtype=kind, device=where)
        to_pin.append(HostPages(shape, kind))
        return to_pin[-1].tensor

    cpu = torch.device("cpu")
    extent_of = getattr(checkpoint, "extent", None)
    fill = ParallelFill()
    one_by_one: list[tuple[str, TensorSource, torch.device, torch.dtype]] = []
    for name, source in sources.items():
        held = source.param in packed
        where = cpu if source.param in host else device
        pin = source.param in host and device.type == "cuda"
        kind = torch.uint8 if held else torch.bfloat16 if source.param in narrow else dtype
        extent = None if held or extent_of is None else extent_of(name)
        if source.index == ():
            mapped = where.type == "cpu" and not pin and (extent is None or extent.dtype == kind)
            if extent is None or mapped or not extent.nbytes:
                one_by_one.append((name, source, where, kind))
                continue
            state[source.param] = allocate(extent.shape, kind, where, pin)
            fill.add(extent, state[source.param])
            continue
        if source.param not in state:
            shape = params[source.param].shape
            state[source.param] = allocate(shape, kind, where, pin)
        place = state[source.param][source.index]
        if extent is not None and extent.nbytes and place.is_contiguous():
            fill.add(extent, place)
        else:
            one_by_one.append((name, source, where, kind))
    total = fill.nbytes + sum(
        _stored_bytes(checkpoint, name, kind, packed.get(source.param))
        for name, source, _, kind in one_by_one
    )
    bar = Progress(total, "loading", enabled=progress, unit="bytes")
    fill.run(bar.advance)
    for name, source, where, kind in one_by_one:
        held = packed.get(source.param)
        tensor = checkpoint.held_blocks(name)[1] if held else checkpoint.tensor(name)  # type: ignore[union-attr,index]
        if source.index == ():
            state[source.param] = tensor.to(device=where, dtype=kind)
        else:
            state[source.param][source.index].copy_(tensor)
        bar.advance(_stored_bytes(checkpoint, name, kind, held))
    pin_all(to_pin)
    bar.close()
    return state


def _stored_bytes(checkpoint: Checkpoint, name: str, kind: torch.dtype, held: str | None) -> int:
    """The bytes a tensor takes once loaded: as `kind`, or as the blocks of quant type `held`."""
    shape = checkpoint.shape(name)
    if held:
        return math.prod(shape[:-1]) * held_row_bytes(held, shape[-1])
    return math.prod(shape) * kind.itemsize
