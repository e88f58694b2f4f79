"""Keys and values kept in 8 bits: int8 or fp8 (e4m3) codes with one fp32 scale per token and kv head.

A quantized cache row (one token's one kv head) is its head_dim codes followed by ROW_EXTRA bytes: the 4 of
its fp32 scale, then zeros that keep every row 16-byte aligned (so kernels read codes 16 bytes at a time).
A quantized cache is [..., kv_heads, head_dim + ROW_EXTRA] of the codes' dtype and its blocks move, park and
copy as whole tensors like any other cache's. The scale is the row's largest magnitude over
the code's largest (127 for int8, 448 for e4m3); an int8 code is x / scale rounded half to even, an e4m3
code x / scale rounded half to even to e4m3's grid. Attention reads codes * scale: the codes are exact in
bf16, fp16 and fp32, so kernels dot them as they are and scale the scores and the probabilities instead.

Error bounds (tests/kernels/test_kv_quant.py): an int8 value is within scale / 2 = amax / 254 of x; an e4m3
value within 1/16 of |x| where |x| / scale >= 2**-6 (e4m3's normal range) and within scale * 2**-10 below.
The kernels that write quantized rows (`triton_norm.qk_norm_rope_store`) give the bits of `quantize`.
"""

from __future__ import annotations

import torch

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_BYTES = 4
ROW_EXTRA = 16  # the scale's bytes and padding after a row's codes
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
TINY = 1e-30  # the least amax a scale is taken from: a row of zeros gets zero codes, not 0 / 0


def quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds codes and scales."""
    return dtype in CODE_MAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache row of one token's kv head: head_dim, and ROW_EXTRA more where quantized."""
    if not quantized(dtype):
        return head_dim
    if head_dim % ROW_EXTRA:
        raise ValueError(f"8-bit KV needs a head size divisible by {ROW_EXTRA}, not {head_dim}")
    return head_dim + ROW_EXTRA


def e4m3_grid(y: torch.Tensor) -> torch.Tensor:
    """fp32 y (|y| <= 448) rounded half to even to the nearest e4m3 value: 1.5 * 2**23 times the grid's
    spacing at y (2**(e - 3) for y's exponent e, at least 2**-9) added and taken away, in fp32."""
    exponent = ((y.view(torch.int32) >> 23) & 255).clamp(min=127 - 6)
    magic = ((exponent - 3) << 23).view(torch.float32) * 12582912.0
    return (y + magic) - magic


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., head_dim] as quantized cache rows [..., head_dim + ROW_EXTRA] of `dtype`."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True).clamp(min=TINY)
    scale = amax / torch.full_like(amax, CODE_MAX[dtype])  # torch on CUDA multiplies by a number's inverse
    y = (x / scale).clamp(-CODE_MAX[dtype], CODE_MAX[dtype])
    codes = torch.round(y).to(torch.int8) if dtype == torch.int8 else e4m3_grid(y).to(dtype)
    padding = scale.new_zeros((*scale.shape[:-1], ROW_EXTRA - SCALE_BYTES), dtype=torch.uint8)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8), padding), -1).view(dtype)


def write(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at flat cache slots (block * block_size + offset) of caches
    [..., block_size, kv_heads, row], quantized where the caches are 8-bit (as bytes: torch's CPU index_copy_
    takes no fp8)."""
    if quantized(key_cache.dtype):
        k, v = (
            quantize(k, key_cache.dtype).view(torch.uint8),
            quantize(v, value_cache.dtype).view(torch.uint8),
        )
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(value_cache.dtype))


def codes_and_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized rows [..., head_dim + ROW_EXTRA] as their codes [..., head_dim] and fp32 scales [...]."""
    head_dim = rows.shape[-1] - ROW_EXTRA
    raw = rows.view(torch.uint8)
    scales = raw[..., head_dim : head_dim + SCALE_BYTES].contiguous().view(torch.float32)[..., 0]
    return rows[..., :head_dim], scales


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of `dtype`: codes times scale (rows not quantized are only cast)."""
    if not quantized(rows.dtype):
        return rows.to(dtype)
    codes, scales = codes_and_scales(rows)
    return (codes.float() * scales[..., None]).to(dtype)


def cache_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The cache dtype `--kv-dtype name` asks for beside activations of `activations`: auto is theirs, bf16
    only where they are bf16 (attention reads a cache of another 16- or 32-bit dtype nowhere), fp8 and int8
    8-bit rows."""
    if name == "auto" or (name == "bf16" and activations == torch.bfloat16):
        return activations
    if name == "bf16":
        raise ValueError(f"--kv-dtype bf16 needs bf16 activations, and this model runs in {activations}")
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {name} is none of auto, bf16, fp8, int8")
    return KV_DTYPES[name]
