"""The CPU expert pool's kernel: experts' SwiGLU over the rows routed to each, from host RAM.

`expert_swiglu` (one expert) and `experts_swiglu_sum` (several experts of a layer, weighted and added at their
rows: a window's whole CPU share in one call, also on the pool's own thread while the caller goes on:
`finish_background`) run the native kernel (native/cpu_experts.cpp: OpenMP threads,
vectorised for the machine it was built on) when the install could build it, else the torch references
(`expert_swiglu_reference`, `experts_swiglu_sum_reference`), and say so once. Weights are fp32, bf16, int8
with one fp32 scale per output row, or GGUF's blocks of Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS or IQ3_S as
they lie in the file (uint8 rows, their type told by their width: app/kernels/interface.py's `held_kind`;
the i-quants' lookup tables handed to the native kernel once, `_hand_over_tables`); activations and results
are fp32.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from app.kernels.gguf_quants import I_QUANTS, dequantize_held, i_quant_tables
from app.kernels.interface import StepConstants, held_kind

try:
    from app.kernels import _native  # type: ignore[attr-defined]
except ImportError:
    _native = None

log = logging.getLogger("strata.kernels")
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# uint8 weights: GGUF blocks of these types; the i-quants' values come from lookup tables
_HELD_KINDS = {"Q8_0": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_XS": 7, "IQ3_XXS": 8, "IQ3_S": 9}
_NAMES = "fp32, bf16, int8, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS or IQ3_S"  # all the above, for messages
_warned = False


_torch_runs: list[float] = []  # without the native kernel: the seconds of the "background" run made at once


def native_available() -> bool:
    """Whether the native kernel was built and loads."""
    return _native is not None


@functools.cache
def threads() -> int:
    """Threads the native kernel uses: STRATA_CPU_THREADS, else every core this process may run on (not
    OpenMP's own count, which torch.set_num_threads changes where both share one OpenMP runtime); read once
    per process."""
    if "STRATA_CPU_THREADS" in os.environ:
        return max(int(os.environ["STRATA_CPU_THREADS"]), 1)
    return len(os.sched_getaffinity(0))


def kind(weight: torch.Tensor, columns: int) -> int:
    """The native kernel's code for `weight`'s kind, its rows holding `columns` weights (a uint8 weight:
    GGUF blocks of the type its rows' width tells; for an i-quant, the kernel has its tables from here on); a
    ValueError for any other."""
    if weight.dtype == torch.uint8:
        found = held_kind(weight, columns)
        if found not in _HELD_KINDS:
            raise ValueError(f"no native kernel reads {found} blocks")
        if found in I_QUANTS:
            _hand_over_tables()
        return _HELD_KINDS[found]
    if weight.dtype not in _KINDS:
        raise ValueError(f"weights of {weight.dtype}: {_NAMES}")
    return _KINDS[weight.dtype]


@functools.cache
def _hand_over_tables() -> None:
    """Gives the native kernel the i-quants' lookup tables (IQ4_NL's levels, the IQ3_XXS and IQ3_S grids: the
    gguf package's, as the torch reference reads them), once a process, before its first i-quant call."""
    tables = i_quant_tables()
    _native.set_tables(
        tables["iq4"].to(torch.int8).numpy().tobytes(),
        tables["IQ3_XXS"].to(torch.uint8).numpy().tobytes(),
        tables["IQ3_S"].to(torch.uint8).numpy().tobytes(),
    )


def expert_sizes(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    """(hidden, inter) of an expert's gate_up [.., 2 * inter, hidden] and down [.., hidden, inter]: told by
    their rows, so also for weights held as blocks."""
    return down.shape[-2], gate_up.shape[-2] // 2


def _dequantized(weight: torch.Tensor, scales: torch.Tensor | None, columns: int) -> torch.Tensor:
    if weight.dtype == torch.uint8:
        return dequantize_held(held_kind(weight, columns), weight, (*weight.shape[:-1], columns))
    if weight.dtype == torch.int8:
        if scales is None:
            raise ValueError("int8 weights need their scales")
        return weight.float() * scales[:, None]
    return weight.float()


# Values a super-block of a token vector quantized for integer dot products with Q4_K, Q5_K and Q6_K rows
# (native/int_dot.h).
QUANTIZED_BLOCK = 256
# GGUF types the native kernel sums in integers against quantized vectors
INTEGER_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [.., columns] (fp32, columns a multiple of QUANTIZED_BLOCK) as the native kernel reads it against
    Q4_K, Q5_K and Q6_K weights: each block of 256 values quantized to int8 codes under one step (its largest
    magnitude / 127, codes rounded to the nearest integer, ties to even), then widened back (code * step, in
    fp64 so that the products are exact). The kernel's integer sums give the dot products of these values
    with the weights."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QUANTIZED_BLOCK)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    return (codes.double() * step.double()).reshape(x.shape)


def _as_read(values: torch.Tensor, weight: torch.Tensor, columns: int) -> torch.Tensor:
    """`values` (fp32) as the native kernel multiplies them with `weight`'s rows of `columns` weights:
    quantized for Q4_K, Q5_K and Q6_K blocks (`quantized_activations`), else themselves."""
    if weight.dtype == torch.uint8 and held_kind(weight, columns) in INTEGER_KINDS:
        return quantized_activations(values)
    return values


def expert_swiglu_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
    channels: int | None = None,
) -> torch.Tensor:
    """y [n, hidden] fp32 = down @ (silu(gate @ x) * (up @ x)) for x [n, hidden], in fp32 (torch); with
    `channels`, over the first so many intermediate channels only."""
    hidden, inter = expert_sizes(gate_up, down)
    x = _as_read(x.float(), gate_up, hidden)
    gate, up = (x @ _dequantized(gate_up, gate_up_scales, hidden).to(x.dtype).T).chunk(2, dim=-1)
    kept = inter if channels is None else channels
    act = _as_read((torch.nn.functional.silu(gate[:, :kept]) * up[:, :kept]).float(), down, inter)
    return (act @ _dequantized(down, down_scales, inter)[:, :kept].to(act.dtype).T).float()


def experts_swiglu_sum_reference(
    x: torch.Tensor,
    experts: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    channels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`experts_swiglu_sum` in torch: expert by expert, each result weighted and added at its rows."""
    y = torch.zeros(x.shape, dtype=torch.float32) if out is None else out
    for i, expert in enumerate(experts.tolist()):
        first, last = int(offsets[i]), int(offsets[i + 1])
        picked = rows[first:last]
        scales = (None, None) if gate_up_scales is None else (gate_up_scales[expert], down_scales[expert])
        kept = None if channels is None else int(channels[i])
        out = expert_swiglu_reference(x[picked], gate_up[expert], down[expert], *scales, channels=kept)
        y.index_add_(0, picked, out * weights[first:last, None].float())
    return y


def experts_swiglu_sum(
    x: torch.Tensor,
    experts: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    channels: torch.Tensor | None = None,
    background: bool = False,
    done: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [n, hidden] fp32: for each i, the SwiGLU of x [n, hidden] at rows[offsets[i]:offsets[i + 1]] through
    expert experts[i] of gate_up [E, 2 * inter, hidden] / down [E, hidden, inter] (int8 with fp32 scales
    [E, rows]), weighted by those entries of `weights` and added at those rows; on the CPU, one call.
    With `out` (fp32, contiguous, shaped like x) the sums are added into it and it is returned. With
    `channels` [len(experts)] (fp32, bf16 and int8 weights), expert i sums its first channels[i] intermediate
    channels only: its share where the others are summed elsewhere. A row's result never depends on which
    other rows share its experts.

    With `background` (`out` given, every tensor already as the kernel reads it: contiguous, fp32 x and
    weights, int64 indices) the native kernel runs on the pool's own thread (on a thread fewer than
    `threads()`: the caller's goes on) and the call returns `out` as soon as the run is handed over, before
    the sums are in it: the caller may queue other work meanwhile, then waits with `finish_background`, and
    leaves every argument as it is until then. Without the native kernel the sums are made before the call
    returns. With `done` (one int32 in host memory, pinned where a device reads it) the run sets it to 1 once
    the sums are in `out` (or it failed): what a device waits on before reading them, sooner than the
    caller's `finish_background` could tell it."""
    if out is not None and (out.shape != x.shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError("out must be a contiguous fp32 tensor shaped like x")
    if background and out is None:
        raise ValueError("a background run adds into `out`: give it")
    if done is not None and (done.dtype != torch.int32 or done.device.type != "cpu" or not done.numel()):
        raise ValueError("done must be an int32 tensor in host memory")
    if _native is None:
        _warn_once()
        began = time.perf_counter()
        y = experts_swiglu_sum_reference(
            x, experts, offsets, rows, weights, gate_up, down, gate_up_scales, down_scales, out, channels
        )
        if background:
            _torch_runs.append(time.perf_counter() - began)
        if done is not None:
            done[0] = 1
        return y
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            "stacked weights: gate_up [experts, 2 * inter, hidden], down [experts, hidden, inter]"
        )
    _check(x, gate_up, down, gate_up_scales, down_scales, stacked=True)
    n = x.shape[0]
    experts, offsets, rows = (_kernel_arg(t, torch.int64, background) for t in (experts, offsets, rows))
    weights = _kernel_arg(weights, torch.float32, background)
    count = experts.numel()
    if offsets.numel() != count + 1 or rows.numel() != weights.numel():
        raise ValueError("offsets must bound each expert's entries of rows and weights")
    if channels is not None:
        channels = _kernel_arg(channels, torch.int64, background)
        if channels.numel() != count:
            raise ValueError("channels must give one count for each expert")
    x = _kernel_arg(x, torch.float32, background)
    y = torch.zeros(x.shape, dtype=torch.float32) if out is None else out
    _native.experts_swiglu_sum(
        x.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        y.data_ptr(),
        gate_up_scales.data_ptr() if gate_up_scales is not None else 0,
        down_scales.data_ptr() if down_scales is not None else 0,
        x.shape[1],
        expert_sizes(gate_up, down)[1],
        kind(gate_up, x.shape[1]),
        kind(down, expert_sizes(gate_up, down)[1]),
        max(threads() - background, 1),  # a background run leaves a core to the caller, who goes on
        experts.data_ptr(),
        offsets.data_ptr(),
        rows.data_ptr(),
        weights.data_ptr(),
        count,
        n,
        gate_up.shape[0],
        rows.numel(),
        channels.data_ptr() if channels is not None else 0,
        background,
        done.data_ptr() if done is not None else 0,
    )
    return y


def small_step(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    experts: int,
    entries: int,
    staging: tuple[torch.Tensor, torch.Tensor] | None,
    copy_address: int | None,
    constants: StepConstants,
) -> Any | None:
    """The expert tier's host step for a small window of one layer as one native call (native/tier_step.cpp;
    app/models/tier_step.py drives it), or None without the native kernels: its missed experts lie at the host
    slots of gate_up [slots, 2 * inter, hidden] / down [slots, hidden, inter] (contiguous, as the pool reads
    them) and are copied into `staging` (gate_up, down: slots shaped alike, contiguous; None: every miss on
    the CPU pool) by the function at `copy_address` (the CUDA driver's cuMemcpyHtoDAsync; None: a plain copy
    of host memory, for staging on a CPU); a call reads at most `entries` routed entries of `experts`
    experts. The pool runs in the background on a thread fewer than `threads()`, as `experts_swiglu_sum`
    does."""
    if _native is None:
        return None
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("a tier step reads contiguous host weights")
    hidden, inter = expert_sizes(gate_up, down)
    slots, targets = 0, (0, 0)
    if staging is not None:
        for target, source in zip(staging, (gate_up, down), strict=True):
            alike = target.shape[1:] == source.shape[1:] and target.dtype == source.dtype
            if not (alike and target.is_contiguous()):
                raise ValueError("staging slots must be contiguous and shaped like the host slots")
        slots, targets = staging[0].shape[0], (staging[0].data_ptr(), staging[1].data_ptr())
        if copy_address is None and staging[0].is_cuda:
            raise ValueError("copies to a GPU's staging slots need the driver's copy function")
    return _native.SmallStep(
        experts,
        hidden,
        inter,
        gate_up.shape[0],
        slots,
        entries,
        gate_up[0].nbytes,
        down[0].nbytes,
        gate_up.shape[2] * gate_up.element_size(),
        gate_up.data_ptr(),
        down.data_ptr(),
        *targets,
        _native.host_copy_address() if copy_address is None else copy_address,
        kind(gate_up, hidden),
        kind(down, inter),
        max(threads() - 1, 1),
        gate_up.dtype in (torch.float32, torch.bfloat16),
        *constants,
    )


def _kernel_arg(t: torch.Tensor, dtype: torch.dtype, background: bool) -> torch.Tensor:
    """`t` as the native kernel reads it; a background run's must be that already (it is read after the call
    returns, when a copy made here would be gone)."""
    read = as_contiguous(t, dtype)
    if background and read is not t:
        raise ValueError("a background run reads its arguments as given: fp32 x and weights, int64 indices")
    return read


def background_finish() -> Callable[[], float] | None:
    """What the expert tier waits for its background pool runs with (`finish_background`), or None with
    STRATA_POOL_BACKGROUND=0: each run then in the calling thread, after the window's staging copies are
    queued. With the device waiting for the runs (STRATA_POOL_DEVICE_WAIT, app/kernels/backends.py) the
    background runs decoded fastest on an H200 machine (docs/PERFORMANCE.md, 2026-12-07)."""
    return None if os.environ.get("STRATA_POOL_BACKGROUND", "1") == "0" else finish_background


def host_step() -> Callable[..., Any] | None:
    """What the expert tier makes its native small-window host steps with (`small_step`), or None with
    STRATA_NATIVE_STEP=0 (the step in Python, for measurements) or without the native kernels."""
    if _native is None or os.environ.get("STRATA_NATIVE_STEP", "1") == "0":
        return None
    return small_step


def finish_background() -> float:
    """Wait for the run `experts_swiglu_sum(..., background=True)` started (its sums are then in its `out`);
    the seconds the run took."""
    if _native is None:
        if not _torch_runs:
            raise RuntimeError("no background run to finish")
        return _torch_runs.pop()
    return _native.pool_finish()


def _warn_once() -> None:
    global _warned
    if not _warned:
        log.warning("the native CPU expert kernel is not built: experts in host RAM run in torch")
        _warned = True


def expert_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's SwiGLU of x [n, hidden] (fp32 result): gate_up [2 * inter, hidden] (gate rows first),
    down [hidden, inter], both fp32, bf16, int8 (with fp32 `*_scales` [rows]) or GGUF blocks; on the CPU."""
    if _native is None:
        _warn_once()
        return expert_swiglu_reference(x, gate_up, down, gate_up_scales, down_scales)
    _check(x, gate_up, down, gate_up_scales, down_scales)
    x = x.float().contiguous()
    n, hidden = x.shape
    inter = expert_sizes(gate_up, down)[1]
    y = torch.empty(n, hidden, dtype=torch.float32)
    _native.expert_swiglu(
        x.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        y.data_ptr(),
        gate_up_scales.data_ptr() if gate_up_scales is not None else 0,
        down_scales.data_ptr() if down_scales is not None else 0,
        n,
        hidden,
        inter,
        kind(gate_up, hidden),
        kind(down, inter),
        threads(),
    )
    return y


def by_expert(top_ids: torch.Tensor, top_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A window's routed entries grouped by expert in expert order (in entry order within an expert): the
    experts, offsets of each one's entries [experts + 1], the entries' rows and weights (fp32)."""
    flat = top_ids.flatten()
    order = flat.argsort(stable=True)
    experts, counts = flat[order].unique_consecutive(return_counts=True)
    offsets = torch.zeros(experts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return experts, offsets, order // top_ids.shape[1], top_weights.flatten()[order].float()


def routed_experts(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum (the `experts` contract of app/kernels/interface.py) on the CPU
    through the native kernel in one call, which groups the entries by expert itself: the experts in expert
    order, each row's result independent of its batch, fp32 inside, returned in x's dtype. Weights fp32,
    bf16 or GGUF blocks (int8 goes through `experts_swiglu_sum`). The CPU backend set's experts kernel."""
    if _native is None or gate_up.dtype == torch.int8:
        experts, offsets, rows, weights = by_expert(top_ids, top_weights)
        return experts_swiglu_sum(x, experts, offsets, rows, weights, gate_up, down).to(x.dtype)
    _check(x, gate_up, down, None, None, stacked=True)
    n, top_k = top_ids.shape
    if top_weights.shape != top_ids.shape:
        raise ValueError("top_ids and top_weights must both be [tokens, top_k]")
    xs, ids, weights = (
        as_contiguous(x, torch.float32),
        as_contiguous(top_ids, torch.int64),
        as_contiguous(top_weights, torch.float32),
    )
    y = torch.empty(n, x.shape[1], dtype=torch.float32)
    _native.routed_experts(
        xs.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        y.data_ptr(),
        x.shape[1],
        expert_sizes(gate_up, down)[1],
        kind(gate_up, x.shape[1]),
        kind(down, expert_sizes(gate_up, down)[1]),
        threads(),
        ids.data_ptr(),
        weights.data_ptr(),
        n,
        top_k,
        gate_up.shape[0],
    )
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def moe_block_reference(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`moe_block` in torch, as the model's `SparseMoE` computes it unfused."""
    probs = torch.softmax(x.float() @ router.float().T, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    picks = torch.ones_like(ids) if live is None else live[:, None].expand_as(ids)
    counts.scatter_add_(0, ids.flatten(), picks.flatten().to(counts.dtype))
    y = experts_swiglu_sum_reference(x.float(), *by_expert(ids, weights), gate_up, down)
    if shared is not None:
        gate, up, shared_down, shared_router = (t.float() for t in shared)
        h = torch.nn.functional.silu(x.float() @ gate.T) * (x.float() @ up.T)
        y = y + torch.sigmoid(x.float() @ shared_router.T) * (h @ shared_down.T)
    return y.to(x.dtype)


def moe_block(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    picks: bool = False,
) -> torch.Tensor:
    """A sparse MoE block (the `moe_block` contract of app/kernels/interface.py; always summed, whatever
    `picks` asks) in one native call:
    router logits (router [experts, hidden]), softmax and top-k picks (renormalised with `renormalize`,
    each real row's picks added to `counts`), the routed experts' weighted SwiGLU (stacked gate_up / down,
    fp32, bf16 or GGUF blocks) and the shared expert's (gate, up [inter, hidden], down [hidden, inter], router
    [1, hidden]) behind its sigmoid, for fp32 rows in host memory; the torch reference otherwise."""
    native = _native is not None and x.dtype == torch.float32 and x.device.type == "cpu"
    plain = [router, *(shared or ())]
    native = native and gate_up.dtype in (torch.float32, torch.bfloat16, torch.uint8)
    native = native and all(w.dtype in (torch.float32, torch.bfloat16) for w in plain)
    native = native and all(w.is_contiguous() for w in (gate_up, down, *plain))
    if not native or counts.dtype != torch.int64 or not counts.is_contiguous():
        return moe_block_reference(x, router, top_k, renormalize, counts, live, gate_up, down, shared)
    _check(x, gate_up, down, None, None, stacked=True)
    rows, hidden = x.shape
    experts = gate_up.shape[0]
    if router.shape != (experts, hidden) or not 1 <= top_k <= experts:
        raise ValueError("router must be [experts, hidden] and top_k in [1, experts]")
    x = as_contiguous(x, torch.float32)
    live = None if live is None else as_contiguous(live, torch.int64)
    y = torch.empty(rows, hidden)
    ids, top_weights = torch.empty(rows, top_k, dtype=torch.int64), torch.empty(rows, top_k)
    gate = up = shared_down = shared_router = None
    if shared is not None:
        gate, up, shared_down, shared_router = shared
        inter = gate.shape[0]
        if up.shape != gate.shape or gate.shape[1] != hidden or shared_down.shape != (hidden, inter):
            raise ValueError("shared expert: gate, up [inter, hidden] and down [hidden, inter]")
        if len({gate.dtype, up.dtype, shared_down.dtype}) != 1 or shared_router.numel() != hidden:
            raise ValueError("shared expert: one dtype for its weights, and a router of [1, hidden]")
        shared_router = as_contiguous(shared_router, router.dtype)
    _native.moe_block(
        x.data_ptr(),
        y.data_ptr(),
        rows,
        hidden,
        router.data_ptr(),
        kind(router, hidden),
        experts,
        top_k,
        renormalize,
        counts.data_ptr(),
        0 if live is None else live.data_ptr(),
        ids.data_ptr(),
        top_weights.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        kind(gate_up, hidden),
        kind(down, expert_sizes(gate_up, down)[1]),
        expert_sizes(gate_up, down)[1],
        0 if gate is None else gate.data_ptr(),
        0 if up is None else up.data_ptr(),
        0 if shared_down is None else shared_down.data_ptr(),
        kind(gate, hidden) if gate is not None else 0,
        0 if gate is None else gate.shape[0],
        0 if shared_router is None else shared_router.data_ptr(),
        threads(),
    )
    return y


DENSE_ROWS = 8  # up to so many rows the CPU set's dense projections may run natively (decode)
DENSE_WEIGHTS = 1 << 17  # ... with weights of at least so many elements (torch is quicker below)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias): the CPU set's dense projections (the `linear` contract of
    app/kernels/interface.py). A few rows (decode windows) times a large weight run through the native
    kernel, which reads weights from memory at several times the rate of torch's one-row matmul on a CPU;
    more rows (prompts) and small weights through torch (bf16 weights of an fp32 model widened for it;
    natively they are read as they are, whatever their size). The result in x's dtype."""
    rows = x.shape[0]
    narrowed = weight.dtype == torch.bfloat16 and x.dtype == torch.float32  # a bf16 weight in an fp32 model
    if (
        _native is None
        or rows > DENSE_ROWS
        or (weight.numel() < DENSE_WEIGHTS and not narrowed)
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not weight.is_contiguous()
        or weight.device.type != "cpu"
    ):
        return torch.nn.functional.linear(x, weight.to(x.dtype) if narrowed else weight, bias)
    xs = as_contiguous(x, torch.float32)
    y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    b = None if bias is None else as_contiguous(bias, torch.float32)
    _native.dense(
        xs.data_ptr(),
        weight.data_ptr(),
        0 if b is None else b.data_ptr(),
        y.data_ptr(),
        rows,
        weight.shape[1],
        weight.shape[0],
        kind(weight, weight.shape[1]),
        threads(),
    )
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _native_rows(*tensors: torch.Tensor) -> bool:
    """Whether the native norm takes these: built, and every tensor fp32 on the CPU."""
    return _native is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One native call: RMSNorm of x's rows (after adding `residual`, times silu(`gate`)), and the sum."""
    x, weight = as_contiguous(x, torch.float32), as_contiguous(weight, torch.float32)
    residual = None if residual is None else as_contiguous(residual, torch.float32)
    gate = None if gate is None else as_contiguous(gate, torch.float32)
    rows, dim = x.shape
    y = torch.empty(rows, dim)
    summed = None if residual is None else torch.empty(rows, dim)
    _native.rms_norm(
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        0 if gate is None else gate.data_ptr(),
        weight.data_ptr(),
        y.data_ptr(),
        0 if summed is None else summed.data_ptr(),
        rows,
        dim,
        eps,
        offset,
        threads(),
    )
    return y, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """The CPU set's RMSNorm of x's rows [rows, dim] (the `rms_norm` contract of app/kernels/interface.py):
    one native call for fp32, the reference's torch operations otherwise."""
    if _native_rows(x, weight):
        return _norm(x, weight, eps, offset)[0]
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x) if offset else weight * normed.type_as(x)


def add_rms_norm(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of residual + h, residual + h): the CPU set's `add_rms_norm`, one native call for fp32."""
    if _native_rows(h, residual, weight) and h.shape == residual.shape:
        normed, summed = _norm(h, weight, eps, offset, residual=residual)
        assert summed is not None
        return normed, summed
    summed = residual + h
    return rms_norm(summed, weight, eps, offset), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows times weight, times silu(gate): the CPU set's `gated_rms_norm` (Gated DeltaNet's
    output norm), one native call for fp32."""
    if _native_rows(x, gate, weight) and gate.shape == x.shape:
        return _norm(x, weight, eps, False, gate=gate)[0]
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(x.dtype)) * torch.nn.functional.silu(gate.float())).to(x.dtype)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor, live: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU set's router picks (the `route` contract of app/kernels/interface.py): softmax over every
    expert in fp32, the top_k and their weights (renormalised with `renormalize`), each real row's picks added
    to `counts`; one native call for fp32 logits, torch's operations otherwise."""
    rows, experts = logits.shape
    if _native_rows(logits) and counts.dtype == torch.int64 and counts.is_contiguous():
        logits = as_contiguous(logits, torch.float32)
        ids = torch.empty(rows, top_k, dtype=torch.int64)
        weights = torch.empty(rows, top_k)
        live = None if live is None else as_contiguous(live, torch.int64)
        _native.route(
            logits.data_ptr(),
            ids.data_ptr(),
            weights.data_ptr(),
            counts.data_ptr(),
            0 if live is None else live.data_ptr(),
            rows,
            experts,
            top_k,
            renormalize,
        )
        return ids, weights
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    picks = torch.ones_like(ids) if live is None else live[:, None].expand_as(ids)
    counts.scatter_add_(0, ids.flatten(), picks.flatten().to(counts.dtype))
    return ids, weights.to(logits.dtype)


def as_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` contiguous and of `dtype` (itself when it already is: no call into torch)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _check(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None,
    down_scales: torch.Tensor | None,
    stacked: bool = False,
) -> None:
    """The native kernel reads raw memory: everything on the CPU, contiguous, of matching shapes and kinds
    (one expert's weights, or `stacked` ones with a leading experts dimension, scales [experts, rows]): both
    of one kind, or both GGUF blocks the kernel reads (two types: a Q4_K_M file's Q6_K down projections)."""
    lead = 1 if stacked else 0
    if down.dim() != lead + 2 or gate_up.dim() != lead + 2:
        raise ValueError(
            "weights: gate_up [2 * inter, hidden] and down [hidden, inter] (stacked: [experts, ...])"
        )
    hidden, inter = expert_sizes(gate_up, down)
    widths = (gate_up.shape[-1], down.shape[-1])
    plain = gate_up.dtype != torch.uint8 and widths != (hidden, inter)
    if x.dim() != 2 or x.shape[1] != hidden or gate_up.shape[lead] != 2 * inter or plain:
        shapes = f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape[lead:])}, down {tuple(down.shape[lead:])}"
        raise ValueError(
            f"shapes {shapes}: want x [n, hidden], gate_up [2 * inter, hidden], down [hidden, inter]"
        )
    try:
        same = kind(gate_up, hidden) == kind(down, inter) or gate_up.dtype == down.dtype == torch.uint8
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"weights of {gate_up.dtype} and {down.dtype}: both {_NAMES}")
    tensors = [gate_up, down]
    if gate_up.dtype == torch.int8:
        if gate_up_scales is None or down_scales is None:
            raise ValueError("int8 weights need their scales")
        if gate_up_scales.shape[lead:] != (2 * inter,) or down_scales.shape[lead:] != (hidden,):
            raise ValueError("one scale per output row of each weight")
        if gate_up_scales.dtype != torch.float32 or down_scales.dtype != torch.float32:
            raise ValueError("scales are fp32")
        tensors += [gate_up_scales, down_scales]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("weights and scales must be contiguous tensors in host memory")
