"""The pure-torch reference backends: plain code that runs on any device, what every faster kernel is
checked against (`REFERENCE`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.kernels.interface import CHUNK, Backends, TierLinkFns


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention of one sequence's new rows over all its keys.

    q [new, heads, d]; k, v [past+new, kv_heads, d]. Row i sees keys up to past + i. Returns [new, heads, d].
    """
    new, total = q.shape[0], k.shape[0]
    mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule token by token (the recurrent form), in fp32.

    q, k [length, heads, dk] (normalised, q pre-scaled); v [length, heads, dv]; g, beta [length, heads];
    state [heads, dk, dv]. Returns outputs [length, heads, dv] and the new state.
    """
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.bmm(k[t][:, None, :], state)[:, 0]  # [heads, dv]: k . state per head
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.bmm(q[t][:, None, :], state)[:, 0]
    return out, state


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over chunks of CHUNK tokens (the prompt form); same contract as the recurrent form.

    Within a chunk the delta-rule updates are folded into one triangular solve (the WY form); across chunks
    the state is carried. Chunks end at multiples of CHUNK positions of the sequence: `offset` is the position
    of the first token (the state holds that many), so a prompt read in pieces cut at such multiples is
    computed exactly as in one piece. Rows before `offset` in its chunk are zero (no key, no value, no decay).
    """
    length = q.shape[0]
    front = offset % CHUNK
    pad = (-(front + length)) % CHUNK
    q, k, v, g, beta = (
        F.pad(t.transpose(0, 1), (0, 0) * (t.dim() - 2) + (front, pad)) for t in (q, k, v, g, beta)
    )
    heads = q.shape[0]
    n = q.shape[1] // CHUNK
    q, k, v = (t.reshape(heads, n, CHUNK, -1) for t in (q, k, v))  # [heads, chunks, C, d]
    g, beta = g.reshape(heads, n, CHUNK), beta.reshape(heads, n, CHUNK)
    decay = g.cumsum(-1)  # [heads, chunks, C]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = (
        (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    )  # [h, n, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * pair).tril(-1) + torch.eye(CHUNK, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    inner = q @ k.transpose(-1, -2) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + inner[:, i] @ fresh
        state = state * decay[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ fresh
    out = out.reshape(heads, n * CHUNK, -1)[:, front : front + length].transpose(0, 1)
    return out, state


def experts_reference(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Reference routed experts: rows grouped by expert, SwiGLU per expert, weighted and summed per row.

    x [tokens, hidden]; top_ids, top_weights [tokens, k]; gate_up [experts, 2I, hidden];
    down [experts, hidden, I]. Entries with a negative id add nothing.
    """
    out = torch.zeros_like(x)
    flat_ids = top_ids.flatten()
    order = flat_ids.argsort(stable=True)
    order = order[flat_ids[order] >= 0]
    counts = torch.bincount(flat_ids[order], minlength=gate_up.shape[0]).tolist()
    rows = order // top_ids.shape[1]
    weights = top_weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picked = rows[start : start + count]
        gate, up = F.linear(x[picked], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[start : start + count, None]
        out.index_add_(0, picked, y.to(out.dtype))
        start += count
    return out


def pack_routing_reference(
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    live: torch.Tensor | None,
    slot_of: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`TierLinkFns.pack` in torch ops (the copy to the host queued, not waited for: graphs hold it)."""
    experts = slot_of.numel()
    masked = ids if live is None else ids.masked_fill(live[:, None] == 0, experts)
    packed = torch.cat([masked.flatten().float(), weights.flatten().float(), x.flatten().float()])
    down[: packed.numel()].copy_(packed, non_blocking=True)
    slots = slot_of[ids]
    return slots if live is None else slots.masked_fill(live[:, None] == 0, -1)


def staged_slots_reference(
    ids: torch.Tensor, live: torch.Tensor | None, stage_of: torch.Tensor
) -> torch.Tensor:
    """`TierLinkFns.staged_slots` in torch ops."""
    slots = stage_of.to(ids.device, non_blocking=True).long()[ids]
    return slots if live is None else slots.masked_fill(live[:, None] == 0, -1)


def add_parts_reference(
    resident: torch.Tensor, staged: torch.Tensor | None, sums: torch.Tensor, done: torch.Tensor | None = None
) -> torch.Tensor:
    """`TierLinkFns.add_parts` in torch ops, which cannot wait on the device: `done` must be set already."""
    if done is not None and not int(done[0]):
        raise ValueError("the torch hand-over cannot wait for the CPU pool on the device")
    out = resident if staged is None else resident + staged
    return out + sums.to(resident.device, resident.dtype, non_blocking=True)


TIER_LINK_REFERENCE = TierLinkFns(
    pack=pack_routing_reference, staged_slots=staged_slots_reference, add_parts=add_parts_reference
)

REFERENCE = Backends(
    name="torch",
    attention=causal_attention,
    delta_rule_prompt=delta_rule_chunked,
    delta_rule_step=delta_rule_recurrent,
    experts=experts_reference,
    tier_link=TIER_LINK_REFERENCE,
)
