"""The CPU backend set's whole-batch sequence mixers: attention over the paged KV cache, Gated DeltaNet's conv
and delta rule over the paged state pools, and the attention's q/k norm with rotary, each one native call
(native/cpu_sequence.cpp) for a window of any number of sequences instead of a Python loop over them.

They implement the whole-batch contracts of app/kernels/interface.py (`paged_attention`, `conv_varlen`,
`delta_rule_varlen`, `qk_norm_rope`) for fp32 tensors in host memory; other dtypes, or an install without the
native module, take the torch references beside them (`*_reference`), which the tests compare against.
Prompt rows of attention go through torch's fused attention (it is quicker for many rows; a decode row is
one native pass over its keys). The delta rule reads every sequence token by token, prompts too, so a prompt
read in pieces is computed exactly as in one piece.
"""

from __future__ import annotations

import torch

from app.kernels import kv_quant
from app.kernels.cpu_experts import as_contiguous, threads
from app.kernels.interface import AttentionWeights, GatedDeltaNetWeights
from app.kernels.reference import causal_attention, delta_rule_recurrent
from app.models.batch import PagedLayout

try:
    from app.kernels import _native  # type: ignore[attr-defined]
except ImportError:
    _native = None

L2NORM_EPS = 1e-6  # the delta rule's q and k normalisation, as the model's `l2norm`


def _host_fp32(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these: built, and every tensor fp32 in host memory."""
    return _native is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _spans(layout: PagedLayout) -> list[tuple[int, int, int]]:
    """(first row, rows, keys once written) of each sequence of the layout."""
    starts = layout.query_start.tolist()
    return [(a, b - a, n) for a, b, n in zip(starts[:-1], starts[1:], layout.seq_lens.tolist(), strict=True)]


def _sequence_cache(
    cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """A sequence's first `length` keys (or values) [length, kv_heads, d] gathered from the paged cache, as
    `dtype` (8-bit caches widened, `kv_quant`)."""
    used = table[: -(-length // cache.shape[1])].long()
    return kv_quant.dequantize(cache.index_select(0, used).flatten(0, 1)[:length], dtype)


def paged_attention_reference(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: PagedLayout, scale: float
) -> torch.Tensor:
    """`paged_attention` in torch: each sequence's keys gathered from its blocks (8-bit ones widened to q's
    dtype), then `causal_attention`."""
    out = torch.empty_like(q)
    for s, (start, rows, keys) in enumerate(_spans(layout)):
        if rows:
            _attend_span(q, key_cache, value_cache, layout.block_table[s], start, rows, keys, scale, out)
    return out


def _attend_span(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    start: int,
    rows: int,
    keys: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    k = _sequence_cache(key_cache, table, keys, q.dtype)
    v = _sequence_cache(value_cache, table, keys, q.dtype)
    out[start : start + rows] = causal_attention(q[start : start + rows], k, v, scale)


def paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: PagedLayout, scale: float
) -> torch.Tensor:
    """Causal attention of every row of a flat batch over its sequence's keys already in the paged cache
    [blocks, block_size, kv_heads, d] (q [tokens, heads, d]): every single-row sequence in one native call,
    longer ones through torch's fused attention, each sequence on its own."""
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    if not _host_fp32(q, key_cache, value_cache) or not contiguous:
        return paged_attention_reference(q, key_cache, value_cache, layout, scale)
    q = _heads(q)
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim)
    seqs, width = layout.block_table.shape
    _native.paged_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        out.data_ptr(),
        _int32(layout.query_start).data_ptr(),
        _int32(layout.seq_lens).data_ptr(),
        _int32(layout.block_table).data_ptr(),
        seqs,
        tokens,
        width,
        key_cache.shape[0],
        key_cache.shape[1],
        heads,
        key_cache.shape[2],
        dim,
        q.stride(0),
        scale,
        threads(),
    )
    if layout.max_query_len > 1:
        for s, (start, rows, keys) in enumerate(_spans(layout)):
            if rows > 1:
                _attend_span(q, key_cache, value_cache, layout.block_table[s], start, rows, keys, scale, out)
    return out


def conv_varlen_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """`conv_varlen` in torch, sequence by sequence: taps added in order in fp32, SiLU, the state kept."""
    kernel = weight.shape[1]
    out = torch.empty_like(x)
    starts = query_start.tolist()
    for start, end, slot in zip(starts[:-1], starts[1:], state_slots.tolist(), strict=True):
        padded = torch.cat((conv_state[slot].float(), x[start:end].t().float()), dim=-1)
        acc = padded[:, : end - start] * weight[:, :1].float()
        for tap in range(1, kernel):
            acc = acc + padded[:, tap : tap + end - start] * weight[:, tap : tap + 1].float()
        out[start:end] = torch.nn.functional.silu(acc).t().to(x.dtype)
        conv_state[slot] = padded[:, padded.shape[1] - (kernel - 1) :].to(conv_state.dtype)
    return out


def conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """SiLU of the depthwise causal conv of every sequence (x [tokens, channels], weight [channels, kernel]),
    continuing each one's conv state [slots, channels, kernel-1], which is overwritten in place with its last
    kernel-1 inputs; one native call. Returns [tokens, channels] in x's dtype."""
    channels, kernel = weight.shape
    if x.shape[1] != channels or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError("x, weight and conv_state disagree on channels or kernel size")
    if not _host_fp32(x, weight, conv_state) or not conv_state.is_contiguous():
        return conv_varlen_reference(x, weight, conv_state, query_start, state_slots)
    x, weight = _heads(x), weight.contiguous()
    out = torch.empty(x.shape)
    _native.conv_varlen(
        x.data_ptr(),
        weight.data_ptr(),
        conv_state.data_ptr(),
        out.data_ptr(),
        _int32(query_start).data_ptr(),
        _int64(state_slots).data_ptr(),
        state_slots.numel(),
        x.shape[0],
        channels,
        kernel,
        x.stride(0),
        conv_state.shape[0],
        threads(),
    )
    return out


def delta_rule_paged_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: PagedLayout,
) -> torch.Tensor:
    """`delta_rule_paged` in torch: each sequence through `delta_rule_recurrent`, saves included."""
    tokens, v_heads, dv = v.shape
    per, dk = v_heads // q.shape[1], q.shape[2]
    out = torch.empty(tokens, v_heads, dv)
    saves = [0] * len(layout.seq_lens) if layout.save_at is None else layout.save_at.tolist()
    save_slots = layout.save_slots.tolist() if layout.save_slots is not None else saves
    slots = layout.state_slots.tolist()
    for s, (start, rows, keys) in enumerate(_spans(layout)):
        span = slice(start, start + rows)
        qs = _l2norm(q[span].float()).repeat_interleave(per, dim=1) * dk**-0.5
        ks = _l2norm(k[span].float()).repeat_interleave(per, dim=1)
        cut = saves[s] - (keys - rows) if saves[s] > 0 else rows
        held = state[slots[s]]
        for first, last in ((0, cut), (cut, rows)):
            if last > first:
                part = slice(first, last)
                inputs = (t[span][part].float() for t in (v, g, beta))
                out[start + first : start + last], held = delta_rule_recurrent(
                    qs[part], ks[part], *inputs, held
                )
            if last == cut and saves[s] > 0:
                state[save_slots[s]] = held
        state[slots[s]] = held
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def delta_rule_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: PagedLayout,
) -> torch.Tensor:
    """The gated delta rule of every sequence of a paged batch, token by token, in one native call.

    q, k [tokens, k_heads, dk] raw (l2-normalised here, q also scaled by dk**-0.5); v [tokens, v_heads, dv];
    g (log decay), beta [tokens, v_heads] fp32; state [slots, v_heads, dk, dv] fp32, each sequence's slot
    read and overwritten in place; a sequence with a `save_at` also leaves its state there in its save slot.
    Returns [tokens, v_heads, dv] fp32.
    """
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    agree = k.shape == q.shape and v.shape[0] == tokens and v_heads % k_heads == 0
    if not agree or state.shape[1:] != (v_heads, dk, dv):
        raise ValueError("q, k, v and state disagree on tokens, heads or head dimensions")
    if not _host_fp32(q, k, v, g, beta, state) or not state.is_contiguous():
        return delta_rule_paged_reference(q, k, v, g, beta, state, layout)
    q, k, v, g, beta = (_heads(t) for t in (q, k, v, g, beta))
    out = torch.empty(tokens, v_heads, dv)
    saving = layout.save_at is not None and layout.save_slots is not None
    _native.delta_rule_varlen(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        g.data_ptr(),
        beta.data_ptr(),
        state.data_ptr(),
        out.data_ptr(),
        _int32(layout.query_start).data_ptr(),
        _int32(layout.seq_lens).data_ptr(),
        _int64(layout.state_slots).data_ptr(),
        _int32(layout.save_at).data_ptr() if saving else 0,
        _int64(layout.save_slots).data_ptr() if saving else 0,
        layout.state_slots.numel(),
        tokens,
        k_heads,
        v_heads,
        dk,
        dv,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g.stride(0),
        beta.stride(0),
        state.shape[0],
        dk**-0.5,
        L2NORM_EPS,
        threads(),
    )
    return out


def _heads(t: torch.Tensor) -> torch.Tensor:
    """`t` [tokens, ...] with each row contiguous, as the native kernels read it (rows may stay any stride
    apart: the split views of a projection's output are passed as they are)."""
    if t.shape[0] and t[0].is_contiguous():
        return t
    return t.contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [tokens, heads, d] and k [tokens, kv_heads, d] (times 1 + weight with `offset`),
    then neox rotary over the first cos.shape[-1] dims; one native call for fp32, torch's operations
    otherwise (as the model's `RMSNorm` and `apply_rotary` compute them)."""
    if not _host_fp32(q, k, q_weight, k_weight, cos, sin):
        return _norm_rope_reference(q, q_weight, eps, offset, cos, sin), _norm_rope_reference(
            k, k_weight, eps, offset, cos, sin
        )
    q, k = _heads(q), _heads(k)
    tokens, heads, dim = q.shape
    q_out, k_out = torch.empty(q.shape), torch.empty(k.shape)
    cos, sin = cos.contiguous(), sin.contiguous()
    _native.qk_norm_rope(
        q.data_ptr(),
        k.data_ptr(),
        q_weight.contiguous().data_ptr(),
        k_weight.contiguous().data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        tokens,
        heads,
        k.shape[1],
        dim,
        cos.shape[-1],
        q.stride(0),
        k.stride(0),
        eps,
        offset,
        threads(),
    )
    return q_out, k_out


def _norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    x = (normed * (1.0 + weight.float())).type_as(x) if offset else weight * normed.type_as(x)
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rotated = torch.cat((-rot[..., dim // 2 :], rot[..., : dim // 2]), dim=-1)
    return torch.cat((rot * cos[:, None, :] + rotated * sin[:, None, :], rest), dim=-1)


_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def gdn_decode(
    x: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_state: torch.Tensor,
    recurrent: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor | None:
    """A Gated DeltaNet layer's whole step for one decode row per sequence (x [seqs, hidden], row i of the
    sequence in state slot state_slots[i]) in one native call: projections, conv, delta rule, gated norm and
    output projection, the conv and recurrent pools [slots, ...] updated in place. The layer's own pieces
    compute the same (tests compare); None where the native kernel does not take these tensors (not fp32
    rows and state, projections not fp32 or bf16, or a strided tensor), and the layer runs its pieces."""
    w = weights
    small = (x, w.conv, w.dt_bias, w.a_log, w.norm, conv_state, recurrent)
    if not _host_fp32(*small) or any(m.dtype not in _KINDS for m in (w.qkvz, w.ba, w.out)):
        return None
    if not all(t.is_contiguous() for t in (*small, w.qkvz, w.ba, w.out)):
        return None
    rows, hidden = x.shape
    y = torch.empty(rows, hidden)
    _native.gdn_decode(
        x.data_ptr(),
        y.data_ptr(),
        rows,
        hidden,
        w.qkvz.data_ptr(),
        _KINDS[w.qkvz.dtype],
        w.ba.data_ptr(),
        _KINDS[w.ba.dtype],
        w.out.data_ptr(),
        _KINDS[w.out.dtype],
        w.conv.data_ptr(),
        w.conv.shape[1],
        w.dt_bias.data_ptr(),
        w.a_log.data_ptr(),
        w.norm.data_ptr(),
        w.eps,
        conv_state.data_ptr(),
        recurrent.data_ptr(),
        recurrent.shape[0],
        _int64(state_slots).data_ptr(),
        w.k_heads,
        w.v_heads,
        w.dk,
        w.dv,
        threads(),
    )
    return y


def attention_decode(
    x: torch.Tensor,
    weights: AttentionWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
) -> torch.Tensor | None:
    """An attention layer's whole step for one decode row per sequence (x [seqs, hidden]) in one native
    call: q, k, v projection, per-head norm and rotary (cos, sin [seqs, rotary]), the row's key and value
    written to the paged caches at its `slot_mapping`, attention over the sequence's keys, the output gate
    and o_proj. The layer's own pieces compute the same (tests compare); None where the native kernel does
    not take these tensors, and the layer runs its pieces."""
    w = weights
    small = (x, w.q_norm, w.k_norm, cos, sin, key_cache, value_cache)
    if not _host_fp32(*small) or any(m.dtype not in _KINDS for m in (w.qkv, w.o)):
        return None
    if not all(t.is_contiguous() for t in (*small, w.qkv, w.o)):
        return None
    rows, hidden = x.shape
    y = torch.empty(rows, hidden)
    table = _int32(layout.block_table)
    _native.attention_decode(
        x.data_ptr(),
        y.data_ptr(),
        rows,
        hidden,
        w.qkv.data_ptr(),
        _KINDS[w.qkv.dtype],
        w.o.data_ptr(),
        _KINDS[w.o.dtype],
        w.q_norm.data_ptr(),
        w.k_norm.data_ptr(),
        w.eps,
        w.offset,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[-1],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _int64(layout.slot_mapping).data_ptr(),
        table.data_ptr(),
        _int32(layout.seq_lens).data_ptr(),
        table.shape[1],
        key_cache.shape[0],
        key_cache.shape[1],
        w.heads,
        w.kv_heads,
        w.head_dim,
        w.gated,
        threads(),
    )
    return y


def _int32(t: torch.Tensor) -> torch.Tensor:
    return as_contiguous(t, torch.int32)


def _int64(t: torch.Tensor) -> torch.Tensor:
    return as_contiguous(t, torch.int64)
