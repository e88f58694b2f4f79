"""The backend sets by name, and the choice made at start.

Every set must agree with the pure-torch reference (app/kernels/reference.py), which runs on any device and
is what the tests compare fast kernels against; the interface they implement is app/kernels/interface.py.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from app.errors import StrataError
from app.kernels.interface import HELD_BLOCKS, Backends
from app.kernels.reference import (
    REFERENCE,
    TIER_LINK_REFERENCE,
    causal_attention,
    delta_rule_chunked,
    delta_rule_recurrent,
)

# the block types the native CPU expert kernel reads in place
CPU_HELD_BLOCKS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ3_S")


def triton_backends() -> Backends:
    """The Triton kernels (CUDA; on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
    from app.kernels.triton_attention import paged_attention
    from app.kernels.triton_gdn import causal_conv_varlen, gated_delta_rule_paged
    from app.kernels.triton_gdn_decode import gdn_decode
    from app.kernels.triton_linear import few_rows_linear
    from app.kernels.triton_moe import fused_experts, route_top_k
    from app.kernels.triton_moe_block import moe_block
    from app.kernels.triton_norm import (
        add_rms_norm,
        gated_rms_norm,
        qk_norm_rope,
        qk_norm_rope_store,
        rms_norm,
    )
    from app.kernels.triton_tier import TIER_LINK

    # STRATA_FUSED_DECODE=0 runs decode windows' Gated DeltaNet layers and shared-expert MoE blocks by their
    # pieces, STRATA_TIER_LINK=0 a tiered layer's captured hand-over by torch ops (for measurements);
    # the graph after a tiered layer's cut is launched while its CPU pool still runs in the background, the
    # device waiting for the pool's sums (STRATA_POOL_DEVICE_WAIT=0: the step waits for the pool first).
    fused = os.environ.get("STRATA_FUSED_DECODE", "1") != "0"
    tier_link = TIER_LINK if os.environ.get("STRATA_TIER_LINK", "1") != "0" else TIER_LINK_REFERENCE
    if os.environ.get("STRATA_POOL_DEVICE_WAIT", "1") == "0":
        tier_link = replace(tier_link, waits=False)
    return Backends(
        name="triton",
        attention=causal_attention,
        delta_rule_prompt=delta_rule_chunked,
        delta_rule_step=delta_rule_recurrent,
        experts=fused_experts,
        paged_attention=paged_attention,
        conv_varlen=causal_conv_varlen,
        delta_rule_varlen=gated_delta_rule_paged,
        route=route_top_k,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        gated_rms_norm=gated_rms_norm,
        qk_norm_rope=qk_norm_rope,
        qk_norm_rope_store=qk_norm_rope_store,
        linear=few_rows_linear,
        moe_block=moe_block if fused else None,
        gdn_decode=gdn_decode if fused else None,
        tier_link=tier_link,
        held_blocks=frozenset(HELD_BLOCKS),
        held_linear=True,
        held_apart=True,
        attention_gate=True,
        stepwise_spans=True,
    )


def cpu_backends() -> Backends:
    """The torch reference with the routed experts, the dense projections of a few rows, the norms and the
    sequence mixers through the native CPU kernels (a layer's routed experts in one call, fp32 inside, each
    row's result independent of its batch; decode rows' projections at several times torch's rate; a norm in
    one call instead of nine; attention and Gated DeltaNet over the paged state for the whole window, as the
    GPU's kernels), where the install built them; else the reference itself."""
    from app.kernels import cpu_experts as cpu
    from app.kernels import cpu_sequence as sequence

    if not cpu.native_available():
        return REFERENCE
    return replace(
        REFERENCE,
        name="cpu",
        experts=cpu.routed_experts,
        linear=cpu.dense,
        route=cpu.route,
        rms_norm=cpu.rms_norm,
        add_rms_norm=cpu.add_rms_norm,
        gated_rms_norm=cpu.gated_rms_norm,
        paged_attention=sequence.paged_attention,
        conv_varlen=sequence.conv_varlen,
        delta_rule_varlen=sequence.delta_rule_paged,
        qk_norm_rope=sequence.qk_norm_rope,
        moe_block=cpu.moe_block,
        gdn_decode=sequence.gdn_decode,
        attention_decode=sequence.attention_decode,
        bf16_weights=True,
        held_blocks=frozenset(CPU_HELD_BLOCKS),
        held_apart=True,
    )


def exact_backends(backends: Backends) -> Backends:
    """The same set with batch-independent tiles wherever a kernel's tiles could follow the batch size.

    The routed experts keep their decode tiles for every window, and the dense projections leave cuBLAS (which
    picks its algorithm by matrix shape) for the same grouped matmul with one group.
    """
    if backends.exact or backends.name == "torch":
        return replace(backends, exact=True)
    if backends.name == "cpu":
        # The experts kernel is batch-independent. The dense projections go to torch for every window: the
        # native ones (alone, or inside the fused MoE block and decode layers) take only decode rows, so a row
        # would be projected one way in a decode window and another beside a prompt chunk.
        fused = dict.fromkeys(("linear", "moe_block", "gdn_decode", "attention_decode"))
        return replace(backends, name="cpu+exact", exact=True, **fused)
    from app.kernels.triton_moe import exact_fused_experts, exact_linear

    # The fused decode steps round differently from the pieces that a decode row beside a prompt chunk takes.
    return replace(
        backends,
        name=f"{backends.name}+exact",
        experts=exact_fused_experts,
        linear=exact_linear,
        moe_block=None,
        gdn_decode=None,
        exact=True,
    )


def _triton(device: torch.device) -> Backends | None:
    """The Triton set on CUDA, or on the CPU inside Triton's interpreter (how the tests run it)."""
    runs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if not runs or importlib.util.find_spec("triton") is None:
        return None
    return triton_backends()


REGISTRY: dict[str, Callable[[torch.device], Backends | None]] = {
    "triton": _triton,
    "torch": lambda device: REFERENCE,
    "cpu": lambda device: cpu_backends() if device.type == "cpu" else None,
}


def select_backends(name: str, device: torch.device | str, exact: bool = False) -> Backends:
    """The named backend set; `auto` is Triton on CUDA (when Triton is installed), the CPU set
    (`cpu_backends`) on a CPU, else the torch reference.

    With `exact`, kernels whose tiles would follow the batch size use fixed ones (see `exact_backends`).
    """
    device = torch.device(device)
    if name == "auto":
        chosen = (_triton(device) if device.type == "cuda" else cpu_backends()) or REFERENCE
    elif name not in REGISTRY:
        raise StrataError(f"unknown backend {name!r}; choose one of auto, {', '.join(REGISTRY)}")
    else:
        found = REGISTRY[name](device)
        if found is None:
            raise StrataError(f"backend {name!r} does not run on {device.type}")
        chosen = found
    return exact_backends(chosen) if exact else chosen
