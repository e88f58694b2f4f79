"""The interface between the model and its compute backends: one function type per hot operation, and
`Backends`, the set a model is built with. The model's layers import only this module; the sets themselves
(the pure-torch reference, the Triton kernels) live beside it in app/kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from app.kernels.gguf_quants import DEQUANTIZE

# The delta rule's prompt form reads sequences in chunks ending at multiples of CHUNK positions.
CHUNK = 64

# GGUF quant types whose blocks kernels may read in place (`Backends.held_blocks`): a held weight is a uint8
# tensor whose rows are the file's blocks, values a block and bytes a block as here
HELD_BLOCKS = {kind: size[:2] for kind, size in DEQUANTIZE.items()}


def held_row_bytes(kind: str, columns: int) -> int:
    """The bytes of a row of `columns` weights held as `kind`'s blocks (whole blocks)."""
    values, size = HELD_BLOCKS[kind]
    if columns % values:
        raise ValueError(f"{kind} rows hold whole blocks of {values} weights, not {columns}")
    return columns // values * size


def held_kind(weight: torch.Tensor, columns: int) -> str:
    """The quant type of a held (uint8) weight whose rows hold `columns` weights, told by the rows' width."""
    for kind, (values, size) in HELD_BLOCKS.items():
        if columns % values == 0 and weight.shape[-1] == columns // values * size:
            return kind
    raise ValueError(f"uint8 rows of {weight.shape[-1]} bytes hold no known blocks of {columns} weights")


@dataclass(frozen=True)
class Picks:
    """A sparse MoE block's output before its last sum, for the norm after it to sum in its own launch.

    pairs [tokens * top_k, hidden]: row token * top_k + choice is that pick's expert output times its weight;
    ids [tokens, top_k]: the picks' experts (a negative id: a pick never computed, its row unwritten and left
    out); `add`: the producer's kernel for the sum alone, (pairs, ids) -> [tokens, hidden], each token's rows
    added in choice order in fp32 and rounded once to the pairs' dtype. An `AddNormKernel` of a set whose
    moe_block leaves picks takes them in place of its first tensor and sums them the same way.
    """

    pairs: torch.Tensor
    ids: torch.Tensor
    add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def total(self) -> torch.Tensor:
        """Each token's sum of its picks [tokens, hidden]."""
        return self.add(self.pairs, self.ids)


NormKernel = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
AddNormKernel = Callable[
    [torch.Tensor | Picks, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]
]
GatedNormKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# several experts of a layer from host RAM: (x, experts, offsets, rows, weights, gate_up, down, out=None) ->
# their sum (added into `out` where given); with background=True (and `out`) the run may go on after the call
# returns, until the HostFinishFn's call, which returns the seconds it took
HostExpertsFn = Callable[..., torch.Tensor]
HostFinishFn = Callable[[], float]
# the expert tier's small-window host step as one native call, made for a layer (app/kernels/cpu_experts.py's
# `small_step`: host gate_up and down, experts, entries, staging areas or None, copy function address or None,
# `StepConstants`) -> an object whose `serve` app/models/tier_step.py calls, or None without the native
# kernels
HostStepFactory = Callable[..., Any]


class StepConstants(NamedTuple):
    """The expert tier's constants a native host step plans with (app/models/expert_costs.py's PROBE_EVERY,
    SPLIT_GAIN_S and GATE_UP_SHARE, app/models/expert_tier.py's SPLIT_ALIGN)."""

    probe_every: int
    split_align: int
    split_gain_s: float
    gate_up_share: float


RouteKernel = Callable[
    [torch.Tensor, int, bool, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# routed experts: (x, top_ids, top_weights, gate_up, down) -> each row's weighted sum of its entries' experts;
# an entry whose id is negative adds nothing and its expert's weights are not read (the device kernels and the
# torch reference; the native CPU kernel refuses such ids)
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PagedAttentionFn = Callable[..., torch.Tensor]  # (q, key_cache, value_cache, layout, scale[, gate])
ConvVarlenFn = Callable[..., torch.Tensor]
DeltaRuleVarlenFn = Callable[..., torch.Tensor]
QKNormRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
QKNormRopeStoreFn = Callable[..., torch.Tensor]
MoEBlockFn = Callable[..., torch.Tensor | None]


@dataclass(frozen=True)
class TierLinkFns:
    """What a tiered layer of a captured small window does on the device around its cut (the expert tier's
    `HostLink`, app/models/expert_tier.py), its pinned host buffers read and written in place:
    `pack(ids, weights, x, live, slot_of, down) -> slots`: the routing ids / weights [rows, k] (a padding
    row's ids, `live` 0: the number of experts) and input x [rows, hidden] written as fp32 into `down`, in
    that order; returns each entry's device slot (slot_of[id], -1 on padding rows) [rows, k] int64.
    `staged_slots(ids, live, stage_of) -> slots`: each entry's staging slot from the map `stage_of`
    [experts] (fp32, -1 for none), -1 on padding rows.
    `add_parts(resident, staged, sums, done=None) -> out`: resident + staged (None: none) + sums (fp32), each
    add rounded to the activations' dtype as torch's adds are; where `waits`, with `done` (one int32, pinned)
    it first waits on the device until that word is nonzero (the CPU pool's sums are in `sums` then), so the
    graph after a cut can be launched while the pool still runs."""

    pack: Callable[..., torch.Tensor]
    staged_slots: Callable[..., torch.Tensor]
    add_parts: Callable[..., torch.Tensor]
    waits: bool = False  # whether add_parts waits on the device for a `done` word


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
    moe_block(x, router, top_k, renormalize, counts, live, gate_up, down, shared, picks=False) -> a whole
    sparse MoE block (router, picks counted into `counts`, routed experts, and the shared expert `shared` =
    (gate, up, down, router) behind its sigmoid, or None) in few launches, or None where it does not take the
    window (the block then runs its pieces one by one, as when the set has no moe_block); with `picks` it may
    return `Picks` instead of the sum, for the set's add_rms_norm to sum.
    gdn_decode(x, weights, conv_state, recurrent, state_slots) -> a Gated DeltaNet layer's whole step for a
    window of one decode row per sequence (state pools updated in place), or None where it does not take
    these tensors (the layer then runs its pieces).
    attention_decode(x, weights, cos, sin, key_cache, value_cache, layout) -> an attention layer's whole step
    for a window of one decode row per sequence (its keys and values written to the caches), or None as
    gdn_decode.
    `stepwise_spans`: its conv_varlen (given the batch's layout, `layout=`) and delta_rule_varlen read a
    layout's stepwise spans themselves, token by token with their row saves, and the conv leaves the
    layout's checkpoints itself; the recurrent layers of other sets take such spans a row at a time
    (`ForwardBatch.in_steps`) and save the conv state of checkpoints with torch operations.
    `attention_gate`: its paged_attention also takes a gated attention layer's output gate (`gate=`, q's
    shape) and multiplies each output by its sigmoid in the same launch.
    `exact` marks a set whose kernels never choose their tiles by the batch. `bf16_weights` marks a set
    whose experts, MoE-block and linear kernels read bf16 weights and compute in fp32: a bf16 checkpoint's
    matrices that those kernels take then stay bf16 in a wider model (the same products, half the bytes).
    `held_blocks` names the GGUF quant types (of HELD_BLOCKS) whose blocks the set's experts and MoE-block
    kernels also read in place (a held weight: uint8 rows of the file's blocks, `held_kind`), so a file's
    routed experts of those types stay as the file holds them; with `held_linear` its linear kernel reads
    them too, so do the dense projections that go through it. `held_apart`: its experts kernel takes the two
    projections of an expert held as different types (a Q4_K_M file's Q4_K gate and up, Q6_K down).
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
    tier_link: TierLinkFns | None = None
    exact: bool = False
    bf16_weights: bool = False
    held_blocks: frozenset[str] = frozenset()
    held_linear: bool = False
    held_apart: bool = False
    attention_gate: bool = False
    stepwise_spans: bool = False
