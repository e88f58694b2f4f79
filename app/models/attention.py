"""Full (softmax) attention layer with QK-norm, optional output gate, GQA and partial RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from app.kernels.interface import AttentionWeights
from app.models.batch import ForwardBatch, PagedStatePools
from app.models.config import ModelConfig
from app.models.layers import Linear, RMSNorm, apply_rotary, linear

if TYPE_CHECKING:
    from app.kernels.interface import Backends


class Attention(nn.Module):
    """Multi-head attention over the flat batch; each sequence attends to its own past in the state."""

    def __init__(self, config: ModelConfig, layer: int, backends: Backends) -> None:
        super().__init__()
        self.attend = backends.attention
        self.paged_attend = backends.paged_attention
        self.gate_in_attention = backends.attention_gate
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.gated = config.gated_attention
        self.q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        self.kv_out = self.kv_heads * self.head_dim
        bias = config.attention_bias
        # q, k and v projections in one weight (one matmul); checkpoints keep them apart (`checkpoint_parts`).
        self.qkv_weight = nn.Parameter(torch.empty(self.q_out + 2 * self.kv_out, config.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(self.q_out + 2 * self.kv_out)) if bias else None
        self.linear_kernel = backends.linear
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, bias, backends.linear)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.offset_norm)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.offset_norm)
        self.qk_norm_rope = backends.qk_norm_rope
        self.qk_norm_rope_store = backends.qk_norm_rope_store
        self.decode_step = backends.attention_decode

    def checkpoint_parts(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint tensor name -> (parameter name, index into it) for the q, k and v projections."""
        q, kv = self.q_out, self.kv_out
        rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        parts: dict[str, tuple[str, tuple]] = {}
        for name, part in rows.items():
            parts[f"{prefix}{name}.weight"] = ("qkv_weight", (part,))
            if self.qkv_bias is not None:
                parts[f"{prefix}{name}.bias"] = ("qkv_bias", (part,))
        return parts

    def weights(self) -> AttentionWeights:
        """The parameters as a fused decode step reads them."""
        return AttentionWeights(
            qkv=self.qkv_weight,
            o=self.o_proj.weight,
            q_norm=self.q_norm.weight,
            k_norm=self.k_norm.weight,
            eps=self.q_norm.eps,
            offset=self.q_norm.offset,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            gated=self.gated,
        )

    def _norm_rope(
        self, q: torch.Tensor, k: torch.Tensor, norms: tuple, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k normalised per head and rotated."""
        if self.qk_norm_rope is not None:
            return self.qk_norm_rope(q, k, *norms, *cos_sin)
        return apply_rotary(self.q_norm(q), *cos_sin), apply_rotary(self.k_norm(k), *cos_sin)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        layout = batch.layout
        plain = self.qkv_bias is None and self.o_proj.bias is None
        if self.decode_step is not None and plain and layout is not None and layout.max_query_len == 1:
            keys, values, viewed = cast(PagedStatePools, batch.state).kv_view(self.layer, layout)
            out = self.decode_step(x, self.weights(), *cos_sin, keys, values, viewed)
            if out is not None:
                return out
        tokens = x.shape[0]
        q, k, v = linear(x, self.qkv_weight, self.qkv_bias, self.linear_kernel).split(
            [self.q_out, self.kv_out, self.kv_out], -1
        )
        gate = None
        if self.gated:
            q, gate = q.view(tokens, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(tokens, self.heads, self.head_dim)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset)
        scale = self.head_dim**-0.5
        if layout is not None and self.paged_attend is not None:
            state = cast(PagedStatePools, batch.state)
            keys, values, layout = state.kv_view(self.layer, layout)
            if self.qk_norm_rope_store is not None:
                q = self.qk_norm_rope_store(q, k, v, *norms, *cos_sin, keys, values, layout.slot_mapping)
            else:
                q, k = self._norm_rope(q, k, norms, cos_sin)
                state.write_kv(self.layer, k, v, layout.slot_mapping)
                keys, values = state.kv_cache(self.layer)
            if gate is not None and self.gate_in_attention:
                return self.o_proj(self.paged_attend(q, keys, values, layout, scale, gate).view(tokens, -1))
            out = self.paged_attend(q, keys, values, layout, scale)
        else:
            q, k = self._norm_rope(q, k, norms, cos_sin)
            out = torch.empty_like(q)
            for span in batch.spans:
                keys, values = batch.state.extend_kv(self.layer, span, k[span.rows], v[span.rows])
                out[span.rows] = self.attend(q[span.rows], keys, values, scale)
        out = out.reshape(tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out)
