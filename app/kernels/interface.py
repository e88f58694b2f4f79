"""The interface between the model and its compute backends: one function type per hot operation, and
`Backends`, the set a model is built with. The model's layers import only this module; the sets themselves
(the pure-torch reference, the Triton kernels) live beside it in app/kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.kernels.gguf_quants import DEQUANTIZE
from app.models.batch import PagedLayout

# The delta rule's prompt form reads sequences in chunks ending at multiples of CHUNK positions.
CHUNK = 64
# GGUF's Q8_0 blocks, as `Backends.q8_0_experts` kernels read them: weights a block, and its bytes (an fp16
# scale, then 32 int8)
Q8_0_BLOCK, Q8_0_BYTES, _ = DEQUANTIZE["Q8_0"]


def q8_0_bytes(columns: int) -> int:
    """The bytes of a Q8_0 row of `columns` weights (whole blocks of Q8_0_BLOCK)."""
    if columns % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 rows hold whole blocks of {Q8_0_BLOCK} weights, not {columns}")
    return columns // Q8_0_BLOCK * Q8_0_BYTES


NormKernel = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
AddNormKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]
]
GatedNormKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# several experts of a layer from host RAM: (x, experts, offsets, rows, weights, gate_up, down, out=None) ->
# their sum (added into `out` where given)
HostExpertsFn = Callable[..., torch.Tensor]
RouteKernel = Callable[
    [torch.Tensor, int, bool, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PagedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedLayout, float], torch.Tensor]
ConvVarlenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DeltaRuleVarlenFn = Callable[..., torch.Tensor]
QKNormRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
QKNormRopeStoreFn = Callable[..., torch.Tensor]
MoEBlockFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class GatedDeltaNetWeights:
    """A Gated DeltaNet layer's parameters as a fused decode step reads them: the projections qkvz
    [k_heads * (2 dk + 2 per dv), hidden] and ba [2 v_heads, hidden] (grouped per key head), the conv
    weight [channels, kernel], dt_bias and a_log [v_heads], the output norm's weight [dv] and eps, and
    out [hidden, v_heads * dv]."""

    qkvz: torch.Tensor
    ba: torch.Tensor
    conv: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    norm: torch.Tensor
    eps: float
    out: torch.Tensor
    k_heads: int
    v_heads: int
    dk: int
    dv: int


GDNDecodeFn = Callable[..., torch.Tensor | None]


@dataclass(frozen=True)
class AttentionWeights:
    """An attention layer's parameters as a fused decode step reads them: qkv [(heads * (2 if gated else 1)
    + 2 kv_heads) * head_dim, hidden] (a head's gate after its q when gated), o [hidden, heads * head_dim],
    the q and k norms' weights [head_dim], their eps and whether they scale by 1 + weight (`offset`)."""

    qkv: torch.Tensor
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    eps: float
    offset: bool
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool


AttentionDecodeFn = Callable[..., torch.Tensor | None]


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
    sequences of several rows in chunks ending at multiples of CHUNK positions).
    route(logits, top_k, renormalize, counts, live) -> (ids, weights): the router's picks in one launch.
    Fusions with the reference's rounding: rms_norm(x, weight, eps, offset); add_rms_norm(h, residual, ...)
    -> (norm of residual + h, residual + h); gated_rms_norm(x, gate, weight, eps); qk_norm_rope(q, k,
    q_weight, k_weight, eps, offset, cos, sin) -> (q, k) normalised per head and rotated;
    qk_norm_rope_store(q, k, v, q_weight, k_weight, eps, offset, cos, sin, key_cache, value_cache,
    slot_mapping) -> q, with k and v stored in the paged caches in the same launch (None: rope, then a write).
    linear(x, weight, bias) -> x @ weight.T + bias for the dense projections (None: torch, i.e. cuBLAS;
    the Triton set's takes windows of few rows itself).
    moe_block(x, router, top_k, renormalize, counts, live, gate_up, down, shared) -> a whole sparse MoE block
    (router, picks counted into `counts`, routed experts, and the shared expert `shared` = (gate, up, down,
    router) behind its sigmoid, or None) in one call; None: the block's pieces one by one.
    gdn_decode(x, weights, conv_state, recurrent, state_slots) -> a Gated DeltaNet layer's whole step for a
    window of one decode row per sequence (state pools updated in place), or None where it does not take
    these tensors (the layer then runs its pieces).
    attention_decode(x, weights, cos, sin, key_cache, value_cache, layout) -> an attention layer's whole step
    for a window of one decode row per sequence (its keys and values written to the caches), or None as
    gdn_decode.
    `exact` marks a set whose kernels never choose their tiles by the batch. `bf16_weights` marks a set
    whose experts, MoE-block and linear kernels read bf16 weights and compute in fp32: a bf16 checkpoint's
    matrices that those kernels take then stay bf16 in a wider model (the same products, half the bytes).
    `q8_0_experts` marks a set whose experts and MoE-block kernels also read the routed experts as GGUF's
    Q8_0 blocks in place (uint8 rows of 34 bytes a 32 weights), so a Q8_0 file's experts stay Q8_0.
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
    qk_norm_rope_store: QKNormRopeStoreFn | None = None
    linear: LinearKernel | None = None
    moe_block: MoEBlockFn | None = None
    gdn_decode: GDNDecodeFn | None = None
    attention_decode: AttentionDecodeFn | None = None
    exact: bool = False
    bf16_weights: bool = False
    q8_0_experts: bool = False
