"""Full (softmax) attention layer with QK-norm, optional output gate, GQA and partial RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from app.models.batch import ForwardBatch
from app.models.config import ModelConfig
from app.models.layers import RMSNorm, apply_rotary

if TYPE_CHECKING:
    from app.kernels.backends import Backends


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


class Attention(nn.Module):
    """Multi-head attention over the flat batch; each sequence attends to its own past in the state."""

    def __init__(self, config: ModelConfig, layer: int, backends: Backends) -> None:
        super().__init__()
        self.attend = backends.attention
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.gated = config.gated_attention
        q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.offset_norm)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.offset_norm)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(tokens, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(tokens, -1)
        q = self.q_norm(q.reshape(tokens, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = torch.empty_like(q)
        scale = self.head_dim**-0.5
        for span in batch.spans:
            keys, values = batch.state.extend_kv(self.layer, span, k[span.rows], v[span.rows])
            out[span.rows] = self.attend(q[span.rows], keys, values, scale)
        out = out.reshape(tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
