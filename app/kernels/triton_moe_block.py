"""A decode window's sparse MoE block in few launches: with a shared expert (Qwen3-Next) three, not fourteen.

The block's pieces run the router, the routing, the routed experts (alignment, two grouped matmuls, the sum
of each token's picks) and then the shared expert as nine more launches. Here, for windows of up to
`MAX_ROWS` rows, the shared expert is one more pick of every row, always taken, whose weight is the sigmoid of
its router's logit:

1. `_router_kernel`: a program per (row, few experts): the router's logits and the shared expert's logit, the
   weight rows read before the kernel before it ends; the row's program that finishes last (a counter a row)
   then routes the row as `route_top_k` does (`triton_moe.route_row`: softmax, top-k, weights, counts).
2. `_pair_up_kernel`: a program per (pair, few intermediate columns): SiLU(x @ gate.T) * (x @ up.T) of the
   pair's expert, the shared expert's for the last pick of a row. 11 picks of 512 columns in programs of 8
   columns are 704 programs at one row, so a lone row's experts are read by every SM (no split of k needed).
3. `_pair_down_sum_kernel`: a program per (row, few hidden columns): each routed pick's down projection times
   its weight, summed in pick order, then the shared pick's times its gate, added.

Each row is summed by itself in fp32 on the CUDA cores in tiles of fixed shape, so a row's result does not
depend on its window; intermediate results are rounded to the model's dtype where the pieces round them, so
results agree with the pieces to the order of fp32 sums. `--exact` keeps the pieces.

A block without a shared expert (Qwen3-MoE) keeps its experts' kernels (`fused_experts`, which reads GGUF
blocks too) but takes its router and routing from `_router_kernel` in one launch instead of two. Its
programs sum each logit as `row_linear` does (the same tile, the same fp32 reduction), and it is taken only
where the pieces would project the router by `row_linear` (`triton_linear.sums_rows`: every full-size
shape's router; other routers keep the pieces): such a window routes exactly as its pieces would. It is
taken from ONE_LAUNCH_ROWS rows: on an H100 the 24-layer Q4_K q30 file decoded 2,542 tok/s at 8 rows with
it and 2,513 without, but 629 at one row against 664 without (docs/PERFORMANCE.md, 2026-12-06).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from app.kernels.interface import Picks
from app.kernels.triton_launch import follow_previous, pdl
from app.kernels.triton_linear import ROW_ELEMENTS, sums_rows
from app.kernels.triton_moe import expert_pairs, route_row, sum_picks
from app.kernels.triton_norm import torch_sigmoid

MAX_ROWS = 16  # windows of more rows run the block's pieces (tiles of rows read shared experts once)
ONE_LAUNCH_ROWS = 8  # a block without a shared expert routes in one launch from this many rows
MAX_K = 1 << 13  # the longest hidden state a router program holds whole
UP_COLUMNS = 8  # intermediate columns (of gate and of up) a `_pair_up_kernel` program computes
DOWN_COLUMNS = 4  # hidden columns a `_pair_down_sum_kernel` program computes
CHUNK = 256  # k a program reads at a time


@triton.jit
def _router_kernel(
    x_ptr,
    router_ptr,
    shared_router_ptr,
    logits_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    live_ptr,
    arrivals_ptr,
    experts,
    stride_x,
    stride_router,
    stride_logits,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """logits[row, cols] = x[row] @ router[cols].T for BLOCK_N experts (with HAS_SHARED a row's last program:
    column `experts`, the shared expert's logit), rounded to the model's dtype; a row's program that arrives
    last on the row's counter routes the row."""
    pid = tl.program_id(0)
    row = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < experts
    w_rows = router_ptr + cols.to(tl.int64) * stride_router
    if HAS_SHARED:  # noqa: SIM102 (a branch of the compiler around a branch of the program)
        if pid == tl.num_programs(0) - 1:
            cols = experts + tl.arange(0, BLOCK_N)
            col_ok = cols == experts
            w_rows = shared_router_ptr + tl.zeros((BLOCK_N,), dtype=tl.int64)
    w = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    w = w.to(tl.float32)
    follow_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
    logit = tl.sum(w * x[None, :], 1)
    tl.store(logits_ptr + row * stride_logits + cols, logit.to(logits_ptr.dtype.element_ty), mask=col_ok)
    tl.debug_barrier()  # every thread's logits stored before the arrival is counted (release)
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(arrivals_ptr + row, 0)  # for the next window
        route_row(
            logits_ptr,
            ids_ptr,
            weights_ptr,
            counts_ptr,
            live_ptr,
            row.to(tl.int64),
            experts,
            stride_logits,
            TOP_K,
            RENORM,
            HAS_LIVE,
            BLOCK_E,
            BLOCK_TOP,
        )


@triton.jit
def _gate_up_sums(
    x_ptr, gate_rows, up_rows, row_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr
):
    """(x @ gate.T, x @ up.T) in fp32 for BLOCK_N weight rows at `gate_rows` / `up_rows` (pointers to each
    row's start), k read CHUNK at a time and summed once at the end."""
    gate = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
    for start in tl.static_range(0, K, CHUNK):
        ks = start + tl.arange(0, CHUNK)
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = row_ok[:, None] & k_ok[None, :]
        gate += tl.load(gate_rows[:, None] + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(up_rows[:, None] + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    return tl.sum(gate, 1), tl.sum(up, 1)


@triton.jit
def _pair_up_kernel(
    x_ptr,
    gate_up_ptr,
    shared_gate_ptr,
    shared_up_ptr,
    ids_ptr,
    act_ptr,
    inter,
    stride_x,
    stride_expert,
    stride_gate_up,
    stride_shared_gate,
    stride_shared_up,
    stride_act,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[pair, cols] for BLOCK_N intermediate columns of pair (row, pick): a routed pick's
    SiLU(gate) * up rounded once (as the grouped matmul rounds), the shared pick's with each projection, the
    SiLU and the product rounded (as the dense MLP's pieces round)."""
    pair = tl.program_id(0)
    row = pair // (TOP_K + 1)
    pick = pair % (TOP_K + 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    at = cols.to(tl.int64)
    follow_previous(PDL)
    x_row = x_ptr + row * stride_x
    out_ty = act_ptr.dtype.element_ty
    if pick < TOP_K:
        expert = tl.load(ids_ptr + row * TOP_K + pick).to(tl.int64)
        base = gate_up_ptr + expert * stride_expert
        g, u = _gate_up_sums(
            x_row, base + at * stride_gate_up, base + (at + inter) * stride_gate_up, col_ok, K, BLOCK_N, CHUNK
        )
        act = g * tl.sigmoid(g) * u
    else:
        g, u = _gate_up_sums(
            x_row,
            shared_gate_ptr + at * stride_shared_gate,
            shared_up_ptr + at * stride_shared_up,
            col_ok,
            K,
            BLOCK_N,
            CHUNK,
        )
        g = g.to(out_ty).to(tl.float32)
        u = u.to(out_ty).to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + (libdevice.exp(-g) if PRECISE else tl.exp(-g)))
        act = silu.to(out_ty).to(tl.float32) * u
    tl.store(act_ptr + pair * stride_act + cols, act.to(out_ty), mask=col_ok)


@triton.jit
def _down_sum(act_row, down_rows, row_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """act @ down.T in fp32 for BLOCK_N weight rows at `down_rows`, k read CHUNK at a time."""
    acc = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
    for start in tl.static_range(0, K, CHUNK):
        ks = start + tl.arange(0, CHUNK)
        k_ok = ks < K
        act = tl.load(act_row + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(down_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * act
    return tl.sum(acc, 1)


@triton.jit
def _pair_down_sum_kernel(
    act_ptr,
    down_ptr,
    shared_down_ptr,
    ids_ptr,
    weights_ptr,
    logits_ptr,
    out_ptr,
    experts,
    hidden,
    stride_act,
    stride_expert,
    stride_down,
    stride_shared_down,
    stride_logits,
    stride_out,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row, cols] = (sum over the routed picks of weight * act @ down.T, each rounded, in pick order)
    + sigmoid(shared logit) * (shared act @ shared down.T), rounded where the pieces round."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    at = cols.to(tl.int64)
    follow_previous(PDL)
    out_ty = out_ptr.dtype.element_ty
    pairs = act_ptr + row * (TOP_K + 1) * stride_act
    routed = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for pick in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + row * TOP_K + pick).to(tl.int64)
        weight = tl.load(weights_ptr + row * TOP_K + pick).to(tl.float32)
        rows = down_ptr + expert * stride_expert + at * stride_down
        y = _down_sum(pairs + pick * stride_act, rows, col_ok, K, BLOCK_N, CHUNK)
        routed += (y * weight).to(out_ty).to(tl.float32)
    shared_rows = shared_down_ptr + at * stride_shared_down
    shared = _down_sum(pairs + TOP_K * stride_act, shared_rows, col_ok, K, BLOCK_N, CHUNK)
    shared = shared.to(out_ty).to(tl.float32)
    logit = tl.load(logits_ptr + row * stride_logits + experts).to(tl.float32)
    gate = torch_sigmoid(logit, PRECISE).to(out_ty).to(tl.float32)
    total = routed.to(out_ty).to(tl.float32) + (gate * shared).to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, total.to(out_ty), mask=col_ok)


_COMPILED = isinstance(_pair_down_sum_kernel, triton.runtime.JITFunction)  # the interpreter lacks libdevice

SharedExpert = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """The router programs' arrival counters on `device`, one a row (int32, back to 0 after every window; a
    device's windows run one after another on its stream)."""
    with torch.inference_mode():
        return torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)


def _routes(x: torch.Tensor, router: torch.Tensor, experts: int) -> bool:
    """Whether `route_window` takes this window's routing: 1 to MAX_ROWS rows, a router [experts, hidden] of
    floating weights (not GGUF blocks) with unit-stride rows, a hidden state a program holds whole."""
    rows, hidden = x.shape
    return (
        1 <= rows <= MAX_ROWS
        and router.dtype != torch.uint8
        and router.stride(-1) == 1
        and router.shape == (experts, hidden)
        and hidden <= MAX_K
    )


def _routes_as_pieces(x: torch.Tensor, router: torch.Tensor, experts: int) -> bool:
    """`_routes` from ONE_LAUNCH_ROWS rows, and the pieces project this router in such a window by
    `row_linear` (`sums_rows`), whose bits `route_window`'s logits have."""
    rows = x.shape[0]
    return rows >= ONE_LAUNCH_ROWS and _routes(x, router, experts) and sums_rows(rows, router)


def _takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, shared: SharedExpert) -> bool:
    """Whether the block's kernels take this window with its shared expert whole (else it runs its pieces)."""
    weights = (gate_up, down, *shared)
    if any(w.dtype == torch.uint8 or w.stride(-1) != 1 for w in weights):
        return False
    gate, up, shared_down, router = shared
    inter, hidden = gate.shape
    experts = gate_up.shape[0]
    shapes = (
        up.shape == gate.shape
        and shared_down.shape == (hidden, inter)
        and router.shape == (1, hidden)
        and gate_up.shape == (experts, 2 * inter, hidden)
        and down.shape == (experts, hidden, inter)
    )
    return shapes and x.shape[1] == hidden


def route_window(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: torch.Tensor | None,
    shared_router: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A window's router logits and routing in one launch (`_router_kernel`): logits [rows, experts] in x's
    dtype (one more column, the shared expert's logit, with `shared_router` [1, hidden]), each row's top-k
    experts [rows, top_k] int64 and weights (x's dtype) as `route_top_k` gives them, the live rows' picks
    added to `counts`. For windows `_routes` takes; a logit has the bits `row_linear` gives it."""
    rows, hidden = x.shape
    experts = router.shape[0]
    has_shared = shared_router is not None
    x = x.contiguous()
    logits = x.new_empty(rows, experts + has_shared)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=x.device)
    weights = x.new_empty(rows, top_k)
    block_k = triton.next_power_of_2(hidden)
    block_n = max(1, ROW_ELEMENTS // block_k)
    grid = (triton.cdiv(experts, block_n) + has_shared, rows)
    _router_kernel[grid](
        x,
        router,
        shared_router if shared_router is not None else router,
        logits,
        ids,
        weights,
        counts,
        live if live is not None else counts,
        _arrivals(x.device),
        experts,
        x.stride(0),
        router.stride(0),
        logits.stride(0),
        K=hidden,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(experts),
        TOP_K=top_k,
        BLOCK_TOP=triton.next_power_of_2(top_k),
        RENORM=renormalize,
        HAS_LIVE=live is not None,
        HAS_SHARED=has_shared,
        num_warps=4,
        **pdl(x.device, grid),
    )
    return logits, ids, weights


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
    picks: bool = False,
) -> torch.Tensor | Picks | None:
    """`Backends.moe_block` on the Triton set, for a window of up to MAX_ROWS rows. With a shared expert
    (gate, up [inter, hidden], down [hidden, inter], router [1, hidden]) whose size is the routed experts'
    (gate_up [experts, 2 * inter, hidden], down [experts, hidden, inter]), none held as GGUF blocks: the
    whole block in three launches. Without one, from ONE_LAUNCH_ROWS rows where the pieces would project the
    router by `row_linear`: the router and the routing in one launch, then the routed experts by
    `fused_experts` (any weights it reads), the pieces' bits; with `picks` their `Picks`, for the norm after
    the block to sum. None otherwise (the block then runs its pieces)."""
    if shared is None:
        if not _routes_as_pieces(x, router, gate_up.shape[0]):
            return None
        ids, weights = route_window(x, router, top_k, renormalize, counts, live)[1:]
        pairs = expert_pairs(x, ids, weights, gate_up, down)  # `fused_experts` before its sum
        return Picks(pairs, ids, sum_picks) if picks else sum_picks(pairs, ids)
    if not (_routes(x, router, gate_up.shape[0]) and _takes(x, gate_up, down, shared)):
        return None
    shared_gate, shared_up, shared_down, shared_router = shared
    rows, hidden = x.shape
    experts, inter = gate_up.shape[0], shared_gate.shape[0]
    x = x.contiguous()
    logits, ids, weights = route_window(x, router, top_k, renormalize, counts, live, shared_router)
    act = x.new_empty(rows * (top_k + 1), inter)
    grid = (act.shape[0], triton.cdiv(inter, UP_COLUMNS))
    _pair_up_kernel[grid](
        x,
        gate_up,
        shared_gate,
        shared_up,
        ids,
        act,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        shared_gate.stride(0),
        shared_up.stride(0),
        act.stride(0),
        K=hidden,
        TOP_K=top_k,
        BLOCK_N=UP_COLUMNS,
        CHUNK=CHUNK,
        PRECISE=_COMPILED,
        num_warps=4,
        **pdl(x.device, grid),
    )
    out = torch.empty_like(x)
    grid = (rows, triton.cdiv(hidden, DOWN_COLUMNS))
    _pair_down_sum_kernel[grid](
        act,
        down,
        shared_down,
        ids,
        weights,
        logits,
        out,
        experts,
        hidden,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        shared_down.stride(0),
        logits.stride(0),
        out.stride(0),
        K=inter,
        TOP_K=top_k,
        BLOCK_N=DOWN_COLUMNS,
        CHUNK=CHUNK,
        PRECISE=_COMPILED,
        num_warps=4,
        **pdl(x.device, grid),
    )
    return out
