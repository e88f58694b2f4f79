"""Whole KV blocks copied by id in one launch, either side possibly in pinned host RAM (`--kv-resident`).

Streaming a batch's host blocks in for an attention layer takes one copy a run of consecutive block numbers;
blocks that conversations decoding together appended in turn come in short runs, and each copy is a call on
the host. `copy_blocks` copies any number of blocks of a layer, keys and values, in one kernel: its programs
read and write pinned host RAM in place over PCIe (a pinned buffer has a device address), each program
taking every `grid`-th pair of ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS = 64  # the most programs of a launch: each reads blocks one after another, waiting on the link
MAX_CHUNK = 8192  # the most 4-byte words a program loads at once (a whole block of keys and one of values
# where they fit, so that all of a block's reads are in flight before its writes)


@triton.jit
def _copy_blocks_kernel(
    src_k,
    src_v,
    dst_k,
    dst_v,
    src_ids,
    dst_ids,
    pairs,
    grid,
    WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    start = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    for pair in range(start, pairs, grid):
        source = tl.load(src_ids + pair).to(tl.int64) * WORDS
        target = tl.load(dst_ids + pair).to(tl.int64) * WORDS
        for offset in tl.static_range(0, WORDS, CHUNK):
            mask = offset + cols < WORDS
            keys = tl.load(src_k + source + offset + cols, mask=mask)
            values = tl.load(src_v + source + offset + cols, mask=mask)
            tl.store(dst_k + target + offset + cols, keys, mask=mask)
            tl.store(dst_v + target + offset + cols, values, mask=mask)


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """A [blocks, ...] tensor as [blocks, 4-byte words] (a block's bytes are a multiple of 16)."""
    return blocks.view(torch.uint8).view(blocks.shape[0], -1).view(torch.int32)


def copy_blocks(
    sources: tuple[torch.Tensor, torch.Tensor],
    targets: tuple[torch.Tensor, torch.Tensor],
    source_ids: torch.Tensor,
    target_ids: torch.Tensor,
) -> None:
    """Copy block source_ids[i] of the keys and values `sources` ([blocks, ...] each, contiguous) over block
    target_ids[i] of `targets`, for every i, on the current stream. The ids (int32 or int64) live on the
    device; a target id appears once."""
    pairs = source_ids.numel()
    if pairs == 0:
        return
    src_k, src_v = (_words(t) for t in sources)
    dst_k, dst_v = (_words(t) for t in targets)
    words = src_k.shape[1]
    if dst_k.shape[1] != words:
        raise ValueError(f"blocks of {words} and {dst_k.shape[1]} words")
    grid = min(pairs, PROGRAMS)
    chunk = min(triton.next_power_of_2(words), MAX_CHUNK)
    _copy_blocks_kernel[(grid,)](
        src_k, src_v, dst_k, dst_v, source_ids, target_ids, pairs, grid, WORDS=words, CHUNK=chunk
    )
