"""Building blocks shared by the architectures: norms, rotary embedding, dense MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from app.kernels.interface import (
    AddNormKernel,
    GatedNormKernel,
    LinearKernel,
    NormKernel,
    Picks,
    held_row_bytes,
)
from app.models.config import RopeConfig


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: LinearKernel | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) over the last dimension, through `kernel` [rows, k] when one is given (which
    a held weight, `hold_blocks`, needs)."""
    if kernel is None:
        return F.linear(x, weight, bias)
    return kernel(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def hold_blocks(module: nn.Module, name: str, kind: str) -> None:
    """Make parameter `name` of `module` a held weight: an empty uint8 one of `kind`'s GGUF blocks over its
    rows (`interface.held_row_bytes`), on its device (the meta device while a model is built), for kernels
    that read the blocks in place (`Backends.held_blocks`)."""
    param = getattr(module, name)
    shape = (*param.shape[:-1], held_row_bytes(kind, param.shape[-1]))
    setattr(module, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=param.device), False))


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose matmul may be a backend kernel."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, kernel: LinearKernel | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)


class RMSNorm(nn.Module):
    """RMSNorm; with `offset` the scale is (1 + weight) and applied in fp32 (Qwen3-Next).

    `kernel` / `add_kernel` are fused versions (norm of rows; residual add then norm) with the same rounding.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        offset: bool = False,
        kernel: NormKernel | None = None,
        add_kernel: AddNormKernel | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.kernel = kernel
        self.add_kernel = add_kernel

    def add_forward(
        self, h: torch.Tensor | Picks, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding `h` [tokens, dim] (or a MoE block's `Picks`, summed), normalised;
        and that stream."""
        if self.add_kernel is not None:
            return self.add_kernel(h, residual, self.weight, self.eps, self.offset)
        if isinstance(h, Picks):
            h = h.total()
        residual = residual + h
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x.reshape(-1, x.shape[-1]), self.weight, self.eps, self.offset).view(x.shape)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm followed by a SiLU gate, used on Gated DeltaNet outputs (`kernel`: a fused version)."""

    def __init__(self, dim: int, eps: float, kernel: GatedNormKernel | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, gate, self.weight, self.eps)
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight * normed.to(dtype)) * F.silu(gate.float())
        return out.to(dtype)


class DenseMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, kernel: LinearKernel | None = None) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, kernel=kernel)
        self.up_proj = Linear(hidden, intermediate, kernel=kernel)
        self.down_proj = Linear(intermediate, hidden, kernel=kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over the first `rotary_dim` dimensions of each head (neox layout)."""

    def __init__(self, rope: RopeConfig, rotary_dim: int) -> None:
        super().__init__()
        inv_freq, self.scale = _inv_freq(rope, rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for the given positions, each [tokens, rotary_dim]."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [tokens, heads, head_dim] by tables from `cos_sin`."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rotated = torch.cat((-rot[..., dim // 2 :], rot[..., : dim // 2]), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, rest), dim=-1)


def _inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (always computed on the CPU, also when the model is built on meta) and scale."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    inv_freq = 1.0 / base
    p = rope.params
    if rope.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, base)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, base: torch.Tensor) -> tuple[torch.Tensor, float]:
    p = rope.params
    factor = p["factor"]
    old_len = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
    return inv_freq, float(attention)
