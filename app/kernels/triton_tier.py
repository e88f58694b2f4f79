"""The expert tier's small captured windows in few launches: what a tiered layer hands the host at its cut
and takes back after it (app/models/expert_tier.py, `HostLink`).

A captured window's tiered layer copies its routing and input to pinned host memory before the cut, and after
it reads each expert's staging slot and the CPU pool's sums from there. Done with torch ops, that was a
dozen launches a layer (casts, a concatenation, copies each way, gathers, masks and adds), each a few
microseconds of a batch-1 token's 24 layers. These kernels read and write the pinned buffers in place (a
pinned tensor is addressable from the device) in three launches: `pack_routing` before the cut,
`staged_slots` and `add_parts` after it (`TIER_LINK`). Each gives the bits of the torch ops it replaces
(app/kernels/reference.py, `TIER_LINK_REFERENCE`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.interface import TierLinkFns
from app.kernels.triton_launch import follow_previous, pdl

WAIT_LOOKS = tl.constexpr(1 << 24)  # `add_parts`' looks at the CPU pool's done word before giving up


@triton.jit
def _row_entries(ids_ptr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row `program_id`'s place: the row, its entries' offsets and lanes (`at`, `in_row`) and their ids."""
    row = tl.program_id(0).to(tl.int64)
    picks = tl.arange(0, BLOCK_W)
    in_row = picks < WIDTH
    at = row * WIDTH + picks
    return row, at, in_row, tl.load(ids_ptr + at, mask=in_row, other=0)


@triton.jit
def _pack_routing(
    ids_ptr,
    weights_ptr,
    x_ptr,
    live_ptr,
    slot_of_ptr,
    down_ptr,
    slots_ptr,
    entries,
    hidden,
    experts,
    WIDTH: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row `program_id` of the window: its ids (experts for a padding row's) and weights as fp32 into
    down[:entries] / down[entries:2 * entries], its input as fp32 into down[2 * entries + row * hidden:], and
    each entry's device slot (-1 for a host expert or a padding row) into slots."""
    follow_previous(PDL)
    row, at, in_row, ids = _row_entries(ids_ptr, WIDTH, BLOCK_W)
    weights = tl.load(weights_ptr + at, mask=in_row, other=0.0).to(tl.float32)
    slots = tl.load(slot_of_ptr + ids, mask=in_row, other=-1)
    if HAS_LIVE:
        live = tl.load(live_ptr + row) != 0
        ids = tl.where(live, ids, experts)
        slots = tl.where(live, slots, -1)
    tl.store(down_ptr + at, ids.to(tl.float32), mask=in_row)
    tl.store(down_ptr + entries + at, weights, mask=in_row)
    tl.store(slots_ptr + at, slots, mask=in_row)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        values = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(down_ptr + 2 * entries + row * hidden + cols, values, mask=ok)


def pack_routing(
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    live: torch.Tensor | None,
    slot_of: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Write a window's routing ids / weights [rows, k] (a padding row's ids: the number of experts) and input
    x [rows, hidden] into `down` (fp32, pinned) as ids, weights, x; returns each entry's device slot
    (slot_of[id], -1 on padding rows: `live` [rows] 0), [rows, k] int64 on x's device."""
    rows, width = ids.shape
    hidden = x.shape[1]
    slots = torch.empty(rows, width, dtype=torch.int64, device=x.device)
    grid = (rows,)
    _pack_routing[grid](
        ids.contiguous(),
        weights.contiguous(),
        x.contiguous(),
        live if live is not None else ids,
        slot_of,
        down,
        slots,
        rows * width,
        hidden,
        slot_of.numel(),
        WIDTH=width,
        HAS_LIVE=live is not None,
        BLOCK_W=triton.next_power_of_2(width),
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)),
        **pdl(x.device, grid),
    )
    return slots


@triton.jit
def _staged_slots(
    ids_ptr,
    live_ptr,
    stage_of_ptr,
    out_ptr,
    WIDTH: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row `program_id`'s entries' staging slots from the map stage_of (fp32, -1 for none): -1 on padding."""
    follow_previous(PDL)
    row, at, in_row, ids = _row_entries(ids_ptr, WIDTH, BLOCK_W)
    slots = tl.load(stage_of_ptr + ids, mask=in_row, other=-1.0).to(tl.int64)
    if HAS_LIVE:
        slots = tl.where(tl.load(live_ptr + row) != 0, slots, -1)
    tl.store(out_ptr + at, slots, mask=in_row)


def staged_slots(ids: torch.Tensor, live: torch.Tensor | None, stage_of: torch.Tensor) -> torch.Tensor:
    """Each entry of ids [rows, k] (experts) as its staging slot from `stage_of` [experts] (fp32, pinned or
    on the device; -1 for an expert not staged), -1 on padding rows (`live` 0): [rows, k] int64 on ids'
    device."""
    rows, width = ids.shape
    out = torch.empty(rows, width, dtype=torch.int64, device=ids.device)
    grid = (rows,)
    _staged_slots[grid](
        ids.contiguous(),
        live if live is not None else ids,
        stage_of,
        out,
        WIDTH=width,
        HAS_LIVE=live is not None,
        BLOCK_W=triton.next_power_of_2(width),
        **pdl(ids.device, grid),
    )
    return out


@triton.jit
def _rounded(x, kind: tl.constexpr):
    """fp32 x in `kind` as torch rounds (to nearest, ties to even); bf16 rounded on the bits first, since
    Triton's interpreter truncates where the compiled conversion rounds."""
    if kind == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(kind)


@triton.jit
def _add_parts(
    resident_ptr,
    staged_ptr,
    sums_ptr,
    done_ptr,
    out_ptr,
    hidden,
    STAGED: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = (resident + staged) + sums, each add rounded to out's dtype as torch's adds of that dtype are;
    with WAIT, sums read only once the host's int32 at done_ptr is nonzero."""
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    at = row * hidden + cols
    kind: tl.constexpr = out_ptr.dtype.element_ty
    out = tl.load(resident_ptr + at, mask=ok, other=0.0)
    if STAGED:
        staged = tl.load(staged_ptr + at, mask=ok, other=0.0)
        out = _rounded(out.to(tl.float32) + staged.to(tl.float32), kind)
    if WAIT:
        # each look crosses PCIe (about a microsecond); a pool that never ends is given up on after
        # WAIT_LOOKS of them rather than hanging the device
        looks = 0
        done = tl.load(done_ptr, volatile=True)
        while (done == 0) & (looks < WAIT_LOOKS):
            done = tl.load(done_ptr, volatile=True)
            looks += 1
        sums = tl.load(sums_ptr + at, mask=ok, other=0.0, volatile=True)
    else:
        sums = tl.load(sums_ptr + at, mask=ok, other=0.0)
    sums = _rounded(sums, kind)
    tl.store(out_ptr + at, _rounded(out.to(tl.float32) + sums.to(tl.float32), kind), mask=ok)


def add_parts(
    resident: torch.Tensor, staged: torch.Tensor | None, sums: torch.Tensor, done: torch.Tensor | None = None
) -> torch.Tensor:
    """A tiered layer's output: its resident experts' sum plus its staged experts' (both [rows, hidden] in the
    activations' dtype) plus the CPU pool's sums [rows, hidden] (fp32, pinned or on the device), read once
    `done` (one int32, pinned: None for no wait) is nonzero."""
    rows, hidden = resident.shape
    resident = resident.contiguous()
    staged = staged.contiguous() if staged is not None else None
    out = torch.empty_like(resident)
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (rows, triton.cdiv(hidden, block))
    _add_parts[grid](
        resident,
        staged if staged is not None else resident,
        sums,
        done if done is not None else sums,
        out,
        hidden,
        STAGED=staged is not None,
        WAIT=done is not None,
        BLOCK=block,
        **pdl(resident.device, grid),
    )
    return out


TIER_LINK = TierLinkFns(pack=pack_routing, staged_slots=staged_slots, add_parts=add_parts, waits=True)
