"""The backend interface: one function per hot operation, a registry, and the choice made at start.

Every backend set must agree with the pure-torch reference (`REFERENCE`), which runs on any device and is
what the tests compare fast kernels against.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from app.errors import StrataError
from app.models.attention import causal_attention
from app.models.batch import PagedLayout
from app.models.gdn import delta_rule_chunked, delta_rule_recurrent
from app.models.layers import AddNormKernel, GatedNormKernel, LinearKernel, NormKernel
from app.models.moe import RouteKernel, experts_reference

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PagedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedLayout, float], torch.Tensor]
ConvVarlenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DeltaRuleVarlenFn = Callable[..., torch.Tensor]
QKNormRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Backends:
    """The functions the model's layers call for their heavy work.

    attention(q [new, heads, d], k [total, kv_heads, d], v, scale) -> [new, heads, d] (causal, GQA);
    delta_rule_prompt / delta_rule_step(q, k, v, g, beta, state) -> (out, state), for prompt chunks and for
    single tokens; experts(x, top_ids, top_weights, gate_up, down) -> the weighted sum of routed experts.

    Whole-batch kernels, used when the state is paged (the batch then carries a `PagedLayout`):
    paged_attention(q, key_cache, value_cache, layout, scale) -> [tokens, heads, d] over keys already
    written; conv_varlen(x, weight, conv_state, query_start, state_slots) and
    delta_rule_varlen(q, k, v, g, beta, state, layout) update the state pools in place (the delta rule reads
    sequences of several rows in chunks ending at multiples of app.models.gdn.CHUNK positions).
    route(logits, top_k, renormalize, counts, live) -> (ids, weights): the router's picks in one launch.
    Fusions with the reference's rounding: rms_norm(x, weight, eps, offset); add_rms_norm(h, residual, ...)
    -> (norm of residual + h, residual + h); gated_rms_norm(x, gate, weight, eps); qk_norm_rope(q, k,
    q_weight, k_weight, eps, offset, cos, sin) -> (q, k) normalised per head and rotated.
    linear(x, weight, bias) -> x @ weight.T + bias for the dense projections (None: torch, i.e. cuBLAS).
    `exact` marks a set whose kernels never choose their tiles by the batch.
    """

    name: str
    attention: AttentionFn
    delta_rule_prompt: DeltaRuleFn
    delta_rule_step: DeltaRuleFn
    experts: ExpertsFn
    paged_attention: PagedAttentionFn | None = None
    conv_varlen: ConvVarlenFn | None = None
    delta_rule_varlen: DeltaRuleVarlenFn | None = None
    route: RouteKernel | None = None
    rms_norm: NormKernel | None = None
    add_rms_norm: AddNormKernel | None = None
    gated_rms_norm: GatedNormKernel | None = None
    qk_norm_rope: QKNormRopeFn | None = None
    linear: LinearKernel | None = None
    exact: bool = False


REFERENCE = Backends(
    name="torch",
    attention=causal_attention,
    delta_rule_prompt=delta_rule_chunked,
    delta_rule_step=delta_rule_recurrent,
    experts=experts_reference,
)


def triton_backends() -> Backends:
    """The Triton kernels (CUDA; on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
    from app.kernels.triton_attention import paged_attention
    from app.kernels.triton_gdn import causal_conv_varlen, gated_delta_rule_paged
    from app.kernels.triton_moe import fused_experts, route_top_k
    from app.kernels.triton_norm import add_rms_norm, gated_rms_norm, qk_norm_rope, rms_norm

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
    )


def exact_backends(backends: Backends) -> Backends:
    """The same set with batch-independent tiles wherever a kernel's tiles could follow the batch size.

    The routed experts keep their decode tiles for every window, and the dense projections leave cuBLAS (which
    picks its algorithm by matrix shape) for the same grouped matmul with one group.
    """
    if backends.exact or backends.name == "torch":
        return replace(backends, exact=True)
    from app.kernels.triton_moe import exact_fused_experts, exact_linear

    return replace(
        backends, name=f"{backends.name}+exact", experts=exact_fused_experts, linear=exact_linear, exact=True
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
}


def select_backends(name: str, device: torch.device | str, exact: bool = False) -> Backends:
    """The named backend set; `auto` is Triton on CUDA (when Triton is installed), else the torch reference.

    With `exact`, kernels whose tiles would follow the batch size use fixed ones (see `exact_backends`).
    """
    device = torch.device(device)
    if name == "auto":
        chosen = (_triton(device) if device.type == "cuda" else None) or REFERENCE
    elif name not in REGISTRY:
        raise StrataError(f"unknown backend {name!r}; choose one of auto, {', '.join(REGISTRY)}")
    else:
        found = REGISTRY[name](device)
        if found is None:
            raise StrataError(f"backend {name!r} does not run on {device.type}")
        chosen = found
    return exact_backends(chosen) if exact else chosen
