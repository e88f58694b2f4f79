"""A decode window's sparse MoE block with a shared expert (Qwen3-Next) in six launches instead of fourteen.

The block's pieces run the router, the routing, the routed experts (two grouped matmuls and the sum of each
token's picks) and then the shared expert as nine more launches: its gate, up and down projections, SiLU,
the product, its router, the sigmoid, the scaling and the add. Here, for windows of up to `MAX_ROWS` rows:

- the router's projection and `route_top_k` as in the pieces, then the routed pairs (`expert_pairs`);
- `_shared_gate_up_kernel`: the shared expert's gate and up projections, SiLU(gate) * up, and (its last
  program) the shared router's logit, weights read whole before the kernel before it ends;
- `_shared_down_sum_kernel`: the shared down projection, then each token's routed picks summed, the shared
  output scaled by the sigmoid of its logit and added, all in one epilogue.

Each row is summed by itself in fp32 on the CUDA cores (as `triton_linear.row_linear`), so a row's result
does not depend on its window; intermediate results are rounded to the model's dtype where the pieces round
them (each projection's output, the SiLU, the product, the sigmoid, the scaled shared output, the routed
sum), so results agree with the pieces to the order of fp32 sums. `--exact` keeps the pieces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_linear import ROW_ELEMENTS, few_rows_linear
from app.kernels.triton_moe import expert_pairs, route_top_k
from app.kernels.triton_norm import torch_sigmoid

MAX_ROWS = 16  # windows of more rows run the block's pieces (cuBLAS reads their projections faster)
MAX_K = 1 << 13  # the longest reduction a program holds whole


@triton.jit
def _shared_gate_up_kernel(
    x_ptr,
    gate_ptr,
    up_ptr,
    router_ptr,
    act_ptr,
    logit_ptr,
    rows,
    inter,
    stride_x,
    stride_gate,
    stride_up,
    stride_act,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[:rows, cols] = SiLU(x @ gate[cols].T) * (x @ up[cols].T) for BLOCK_N columns of the shared
    expert, each projection rounded to the model's dtype first; the last program writes x @ router.T."""
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    out_ty = act_ptr.dtype.element_ty
    if pid == tl.num_programs(0) - 1:
        router = tl.load(router_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        follow_previous(PDL)
        for row in range(rows):
            x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
            tl.store(logit_ptr + row, tl.sum(router * x, 0).to(logit_ptr.dtype.element_ty))
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        mask = col_ok[:, None] & k_ok[None, :]
        rows_at = cols.to(tl.int64)[:, None]
        gate = tl.load(gate_ptr + rows_at * stride_gate + ks[None, :], mask=mask, other=0.0)
        up = tl.load(up_ptr + rows_at * stride_up + ks[None, :], mask=mask, other=0.0)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
        follow_previous(PDL)
        for row in range(rows):
            x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.sum(gate * x[None, :], 1).to(out_ty).to(tl.float32)
            u = tl.sum(up * x[None, :], 1).to(out_ty).to(tl.float32)
            silu = tl.math.div_rn(g, 1.0 + (libdevice.exp(-g) if PRECISE else tl.exp(-g)))
            act = silu.to(out_ty).to(tl.float32) * u
            tl.store(act_ptr + row * stride_act + cols, act.to(out_ty), mask=col_ok)


@triton.jit
def _shared_down_sum_kernel(
    act_ptr,
    down_ptr,
    logit_ptr,
    pairs_ptr,
    out_ptr,
    rows,
    hidden,
    stride_act,
    stride_down,
    stride_out,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[:rows, cols] = (sum of the row's TOP_K routed pairs) + sigmoid(logit) * (act @ down[cols].T),
    for BLOCK_N columns of the hidden state, rounded to the model's dtype where the pieces round."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    down = tl.load(
        down_ptr + cols.to(tl.int64)[:, None] * stride_down + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    follow_previous(PDL)
    out_ty = out_ptr.dtype.element_ty
    for row in range(rows):
        act = tl.load(act_ptr + row * stride_act + ks, mask=k_ok, other=0.0).to(tl.float32)
        shared = tl.sum(down * act[None, :], 1).to(out_ty).to(tl.float32)
        routed = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for choice in tl.static_range(TOP_K):
            pair = pairs_ptr + (row * TOP_K + choice) * hidden + cols
            routed += tl.load(pair, mask=col_ok, other=0.0).to(tl.float32)
        routed = routed.to(out_ty).to(tl.float32)
        logit = tl.load(logit_ptr + row).to(tl.float32)
        gate = torch_sigmoid(logit, PRECISE).to(out_ty).to(tl.float32)
        total = routed + (gate * shared).to(out_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, total.to(out_ty), mask=col_ok)


_COMPILED = isinstance(_shared_down_sum_kernel, triton.runtime.JITFunction)  # the interpreter lacks libdevice

SharedExpert = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _takes(x: torch.Tensor, shared: SharedExpert | None) -> bool:
    """Whether the shared expert's kernels take this window (else the block runs its pieces)."""
    if shared is None or not 1 <= x.shape[0] <= MAX_ROWS:
        return False
    gate, up, down, router = shared
    if any(w.dtype == torch.uint8 or w.stride(-1) != 1 for w in shared):
        return False
    inter, hidden = gate.shape
    shapes = up.shape == gate.shape and down.shape == (hidden, inter) and router.shape == (1, hidden)
    return shapes and x.shape[1] == hidden and max(hidden, inter) <= MAX_K


def _row_block(k: int) -> tuple[int, int]:
    """(weight rows a program holds, the power-of-two k it covers) for a reduction of k."""
    block_k = triton.next_power_of_2(k)
    return max(1, ROW_ELEMENTS // block_k), block_k


def moe_block(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared: SharedExpert | None,
) -> torch.Tensor | None:
    """`Backends.moe_block` on the Triton set, for a window of up to MAX_ROWS rows with a shared expert
    (gate, up [inter, hidden], down [hidden, inter], router [1, hidden]) in the model's dtype: the routed
    experts as the pieces run them, the shared expert and the sum in two launches. None otherwise (the block
    then runs its pieces)."""
    if not _takes(x, shared):
        return None
    assert shared is not None
    gate, up, shared_down, shared_router = shared
    rows, hidden = x.shape
    x = x.contiguous()
    logits = few_rows_linear(x, router)
    ids, weights = route_top_k(logits, top_k, renormalize, counts, live)
    pairs = expert_pairs(x, ids, weights, gate_up, down)
    inter = gate.shape[0]
    act = x.new_empty(rows, inter)
    logit = x.new_empty(rows)
    block_n, block_k = _row_block(hidden)
    grid = (triton.cdiv(inter, block_n) + 1,)
    _shared_gate_up_kernel[grid](
        x,
        gate,
        up,
        shared_router,
        act,
        logit,
        rows,
        inter,
        x.stride(0),
        gate.stride(0),
        up.stride(0),
        act.stride(0),
        K=hidden,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISE=_COMPILED,
        num_warps=4,
        **pdl(x.device, grid),
    )
    out = torch.empty_like(x)
    block_n, block_k = _row_block(inter)
    grid = (triton.cdiv(hidden, block_n),)
    _shared_down_sum_kernel[grid](
        act,
        shared_down,
        logit,
        pairs,
        out,
        rows,
        hidden,
        act.stride(0),
        shared_down.stride(0),
        out.stride(0),
        K=inter,
        TOP_K=top_k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISE=_COMPILED,
        num_warps=4,
        **pdl(x.device, grid),
    )
    return out
