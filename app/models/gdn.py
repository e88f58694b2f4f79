"""Gated DeltaNet (linear attention) layer of Qwen3-Next: causal conv + gated delta rule, carried state."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from app.kernels.interface import GatedDeltaNetWeights
from app.models.batch import ForwardBatch, PagedLayout, PagedStatePools
from app.models.config import ModelConfig
from app.models.layers import GatedRMSNorm, Linear

if TYPE_CHECKING:
    from app.kernels.interface import Backends


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale the last dimension to unit length."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_qk(q: torch.Tensor, k: torch.Tensor, v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw q, k [tokens, k_heads, dk] as the delta rule reads them, in fp32: unit length, q scaled by
    dk**-0.5, each key head repeated for the v_heads // k_heads value heads that read it."""
    per, dk = v_heads // q.shape[1], q.shape[2]
    return (
        l2norm(q.float()).repeat_interleave(per, dim=1) * dk**-0.5,
        l2norm(k.float()).repeat_interleave(per, dim=1),
    )


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one sequence continuing `state`.

    x [length, channels]; weight [channels, kernel]; state [channels, kernel-1] (zeros when None).
    Returns the output [length, channels] and the new state.
    """
    channels, kernel = weight.shape
    if state is None:
        state = x.new_zeros(channels, kernel - 1)
    padded = torch.cat((state, x.t().to(state.dtype)), dim=-1)  # [channels, kernel-1+length]
    out = conv_taps(padded.to(weight.dtype), weight, x.shape[0])
    return F.silu(out).t().to(x.dtype), padded[:, padded.shape[1] - (kernel - 1) :].clone()


def conv_taps(padded: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """out[..., c, t] = sum over taps j of padded[..., c, t + j] * weight[c, j], added tap by tap: plain
    element-wise arithmetic, the same for a sequence alone as in a batch of them (and no convolution
    primitive, whose set-up costs far more than a decode step's few multiplications on a CPU)."""
    out = padded[..., :length] * weight[:, :1]
    for tap in range(1, weight.shape[1]):
        out = out + padded[..., tap : tap + length] * weight[:, tap : tap + 1]
    return out


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention token mixer over the flat batch, one state per sequence."""

    def __init__(self, config: ModelConfig, layer: int, backends: Backends) -> None:
        super().__init__()
        self.rule_prompt = backends.delta_rule_prompt
        self.rule_step = backends.delta_rule_step
        self.conv_varlen = backends.conv_varlen
        self.rule_varlen = backends.delta_rule_varlen
        self.decode_step = backends.gdn_decode
        self.conv_saves = backends.stepwise_spans
        self.layer = layer
        self.k_heads = config.linear_num_key_heads
        self.v_heads = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.key_dim = self.k_heads * self.dk
        self.value_dim = self.v_heads * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        hidden = config.hidden_size
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, kernel=backends.linear)
        self.in_proj_ba = Linear(hidden, 2 * self.v_heads, kernel=backends.linear)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, backends.gated_rms_norm)
        self.out_proj = Linear(self.value_dim, hidden, kernel=backends.linear)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections grouped per key head -> mixed qkv [tokens, conv_dim], z [tokens, v_heads, dv], b, a."""
        tokens = x.shape[0]
        per = self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(tokens, self.k_heads, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.k_heads, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        return mixed, z.reshape(tokens, self.v_heads, self.dv), b.reshape(tokens, -1), a.reshape(tokens, -1)

    def weights(self) -> GatedDeltaNetWeights:
        """The parameters as a fused decode step reads them."""
        return GatedDeltaNetWeights(
            qkvz=self.in_proj_qkvz.weight,
            ba=self.in_proj_ba.weight,
            conv=self.conv1d.weight[:, 0, :],
            dt_bias=self.dt_bias,
            a_log=self.A_log,
            norm=self.norm.weight,
            eps=self.norm.eps,
            out=self.out_proj.weight,
            k_heads=self.k_heads,
            v_heads=self.v_heads,
            dk=self.dk,
            dv=self.dv,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.steps is None:
            return self._window(x, batch)
        if self.decode_step is not None:  # a fused decode step per row, its projections inside
            out = torch.empty_like(x)
            for j, (rows, step) in enumerate(batch.steps):  # in order: each continues the state before it
                out[rows] = self._window(x[rows], step)
                self._step_saves(batch, j)
            return out
        # the projections and the output's norm and projection of every row at once; conv and delta rule
        # step by step
        mixed, z, g, beta = self._project(x)
        mixing: torch.Tensor | None = None
        for j, (rows, step) in enumerate(batch.steps):
            part = self._mix(mixed[rows], g[rows], beta[rows], step)
            if mixing is None:
                mixing = part.new_empty((x.shape[0], *part.shape[1:]))
            mixing[rows] = part
            self._step_saves(batch, j)
        assert mixing is not None
        return self._finish(mixing, z, x)

    def _step_saves(self, batch: ForwardBatch, step: int) -> None:
        """Copy the state of each (seq, slot) of the batch's `step_saves[step]` into that slot."""
        saves = batch.step_saves.get(step)
        if not saves:
            return
        if batch.layout is not None:  # paged pools: copied in place, a copy each pool
            conv, recurrent = cast(PagedStatePools, batch.state).linear_pools(self.layer)
            device = conv.device
            sources, targets = (torch.tensor(t, device=device) for t in zip(*saves, strict=True))
            conv[targets], recurrent[targets] = conv[sources], recurrent[sources]
            return
        for seq, slot in saves:
            conv, recurrent = batch.state.linear_state(self.layer, seq)
            assert conv is not None and recurrent is not None
            batch.state.set_linear_state(self.layer, slot, conv.clone(), recurrent.clone())

    def _window(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer over a batch's rows at once (its spans in parallel, each continuing its state)."""
        layout = batch.layout
        decoding = layout is not None and layout.max_query_len == 1 and layout.save_slots is None
        if self.decode_step is not None and decoding:
            assert layout is not None
            conv_state, recurrent = cast(PagedStatePools, batch.state).linear_pools(self.layer)
            out = self.decode_step(x, self.weights(), conv_state, recurrent, layout.state_slots)
            if out is not None:
                return out
        mixed, z, g, beta = self._project(x)
        return self._finish(self._mix(mixed, g, beta, batch), z, x)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' mixed qkv, z, decay g and write strength beta."""
        mixed, z, b, a = self._split(x)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return mixed, z, g, beta

    def _mix(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Conv and delta rule of the batch's rows, continuing (and updating) each span's state."""
        weight = self.conv1d.weight[:, 0, :]
        if batch.layout is not None and self.conv_varlen is not None and self.rule_varlen is not None:
            out = self._whole_batch(mixed, weight, g, beta, batch.layout, cast(PagedStatePools, batch.state))
            if not self.conv_saves:
                self._save_conv(mixed, weight.shape[1], batch)
            return out
        if len(batch.spans) > 1 and all(s.length == 1 and s.save_slot is None for s in batch.spans):
            return self._decode_rows(mixed, weight, g, beta, batch)
        return self._per_sequence(mixed, weight, g, beta, batch)

    def _finish(self, out: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated norm and output projection of the delta rule's output."""
        out = self.norm(out.to(x.dtype).reshape(-1, self.dv), z.reshape(-1, self.dv)).view(x.shape[0], -1)
        return self.out_proj(out)

    def _whole_batch(
        self,
        mixed: torch.Tensor,
        weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        layout: PagedLayout,
        state: PagedStatePools,
    ) -> torch.Tensor:
        """Conv and delta rule of every sequence in one launch each, on the state pools in place."""
        tokens = mixed.shape[0]
        conv_state, recurrent = state.linear_pools(self.layer)
        assert self.conv_varlen is not None and self.rule_varlen is not None
        if self.conv_saves:  # the conv kernel leaves the checkpoints and row saves itself
            conv_out = self.conv_varlen(
                mixed, weight, conv_state, layout.query_start, layout.state_slots, layout=layout
            )
        else:
            conv_out = self.conv_varlen(mixed, weight, conv_state, layout.query_start, layout.state_slots)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return self.rule_varlen(
            q.view(tokens, self.k_heads, self.dk),
            k.view(tokens, self.k_heads, self.dk),
            v.view(tokens, self.v_heads, self.dv),
            g,
            beta,
            recurrent,
            layout,
        )

    def _save_conv(self, mixed: torch.Tensor, kernel: int, batch: ForwardBatch) -> None:
        """The conv state at each span's `save_at` (its last kernel-1 inputs) into the span's save slot.

        Device tensors only (no loop over spans), so that it runs inside a captured window too: every
        sequence gathers its kernel-1 inputs before `save_at`, and only those with a save slot keep them.
        """
        layout = batch.layout
        if layout is None or layout.save_slots is None or layout.save_at is None:
            return
        conv, _ = cast(PagedStatePools, batch.state).linear_pools(self.layer)
        starts = layout.query_start[:-1].long()
        past = layout.seq_lens.long() - (layout.query_start[1:].long() - starts)
        end = starts + layout.save_at.long() - past  # [seqs]: the row after the last input kept
        taps = torch.arange(1 - kernel, 0, device=mixed.device)
        rows = (end[:, None] + taps).clamp(0, max(mixed.shape[0] - 1, 0))  # [seqs, kernel-1]
        slots = layout.save_slots.clamp(min=0)
        saving = (layout.save_at > 0)[:, None, None]
        conv[slots] = torch.where(saving, mixed[rows].transpose(1, 2).to(conv.dtype), conv[slots])

    def _state(
        self, batch: ForwardBatch, seq: int, mixed: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's conv and recurrent state, zeros where it has none yet."""
        conv_state, state = batch.state.linear_state(self.layer, seq)
        if conv_state is None:
            conv_state = mixed.new_zeros(mixed.shape[1], weight.shape[1] - 1)
        if state is None:
            state = mixed.new_zeros(self.v_heads, self.dk, self.dv, dtype=torch.float32)
        return conv_state, state

    def _decode_rows(
        self,
        mixed: torch.Tensor,
        weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """A window of decode rows only, one per sequence: conv and delta-rule step of every sequence at once
        (sequences, like heads, never mix), each with the arithmetic it gets alone in `_per_sequence`."""
        spans = batch.spans
        held = [self._state(batch, span.seq, mixed, weight) for span in spans]
        conv_states, states = [c for c, _ in held], [r for _, r in held]
        rows = torch.tensor([span.start for span in spans], device=mixed.device)
        x = mixed[rows]  # [seqs, channels]
        padded = torch.cat((torch.stack(conv_states), x[:, :, None].to(conv_states[0].dtype)), dim=-1)
        conv_out = F.silu(conv_taps(padded.to(weight.dtype), weight, 1)[..., 0]).to(x.dtype)
        q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        seqs, heads = len(spans), self.v_heads
        q, k = delta_rule_qk(q.view(seqs, self.k_heads, self.dk), k.view(seqs, self.k_heads, self.dk), heads)
        core, state = self.rule_step(
            q.reshape(1, seqs * heads, self.dk),
            k.reshape(1, seqs * heads, self.dk),
            v.reshape(1, seqs * heads, self.dv),
            g[rows].reshape(1, seqs * heads),
            beta[rows].reshape(1, seqs * heads),
            torch.stack(states).reshape(seqs * heads, self.dk, self.dv),
        )
        state = state.view(seqs, heads, self.dk, self.dv)
        for i, span in enumerate(spans):
            batch.state.set_linear_state(self.layer, span.seq, padded[i, :, 1:].clone(), state[i])
        out = mixed.new_empty(mixed.shape[0], heads, self.dv, dtype=torch.float32)
        out[rows] = core.view(seqs, heads, self.dv)
        return out

    def _per_sequence(
        self,
        mixed: torch.Tensor,
        weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """The reference path: conv and delta rule sequence by sequence through the `SequenceState`."""
        out = mixed.new_empty(mixed.shape[0], self.v_heads, self.dv, dtype=torch.float32)
        kernel = weight.shape[1]
        for span in batch.spans:
            conv_state, state = self._state(batch, span.seq, mixed, weight)
            before = conv_state
            conv_out, conv_state = causal_conv(mixed[span.rows], weight, conv_state)
            q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            heads = (-1, self.k_heads, self.dk)
            q, k = delta_rule_qk(q.view(heads), k.view(heads), self.v_heads)
            v = v.view(-1, self.v_heads, self.dv)
            decay, gate = g[span.rows], beta[span.rows]
            if span.length == 1:
                core, state = self.rule_step(q, k, v, decay, gate, state)
            elif span.save_slot is None:
                core, state = self.rule_prompt(q, k, v, decay, gate, state, offset=span.past)
            else:  # in two parts, leaving the state where the first ends in the save slot
                cut = span.save_at - span.past
                inputs = torch.cat((before, mixed[span.rows].t().to(before.dtype)), dim=-1)
                head, state = self.rule_prompt(
                    q[:cut], k[:cut], v[:cut], decay[:cut], gate[:cut], state, offset=span.past
                )
                batch.state.set_linear_state(
                    self.layer, span.save_slot, inputs[:, cut : cut + kernel - 1], state
                )
                tail, state = self.rule_prompt(
                    q[cut:], k[cut:], v[cut:], decay[cut:], gate[cut:], state, offset=span.save_at
                )
                core = torch.cat((head, tail))
            batch.state.set_linear_state(self.layer, span.seq, conv_state, state)
            out[span.rows] = core
        return out
