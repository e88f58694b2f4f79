"""Model state of the batch slots: a paged KV pool for attention layers, per-slot Gated DeltaNet state."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from app.engine.kv_stream import StreamedKV, StreamPlan, shifted
from app.engine.transfer import device_tensor
from app.kernels import kv_quant
from app.models.batch import PagedLayout, SequenceSpan
from app.models.config import ATTENTION, LINEAR_ATTENTION, ModelConfig

STATE_DTYPE = torch.float32  # Gated DeltaNet recurrent state is carried in fp32


def _count(config: ModelConfig, kind: str, layers: range | None) -> int:
    """How many of `layers` (None: all) are of `kind`."""
    types = config.layer_types
    return sum(types[i] == kind for i in (range(len(types)) if layers is None else layers))


def kv_block_bytes(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    layers: range | None = None,
    extra: int = 0,
) -> int:
    """Bytes of one KV block of `dtype` (8-bit ones with their scales, `kv_quant`) across the attention
    layers among `layers` (None: all) and `extra` more (an MTP head's), keys and values."""
    count = _count(config, ATTENTION, layers) + extra
    item = torch.empty((), dtype=dtype).element_size()
    row = kv_quant.row_width(config.head_dim, dtype)
    return 2 * count * block_size * config.num_key_value_heads * row * item


def resident_blocks(tokens: int | None, block_size: int) -> int | None:
    """The blocks `--kv-resident TOKENS` keeps on the device (None: no such budget)."""
    return None if tokens is None else -(-tokens // block_size)


def device_kv_bytes(
    config: ModelConfig,
    kv_memory: int,
    resident_tokens: int | None,
    block_size: int,
    dtype: torch.dtype,
    layers: range | None = None,
) -> int:
    """Device memory the KV pool of `kv_memory` bytes takes when `resident_tokens` of it (None: all) live on
    the device (`--kv-resident`): those blocks of every attention layer among `layers`, and two staging areas
    of one layer as large as the part in host RAM (app/engine/kv_stream.py)."""
    block = kv_block_bytes(config, block_size, dtype, layers)
    resident = resident_blocks(resident_tokens, block_size)
    if resident is None or block == 0:
        return kv_memory
    beyond = max(kv_memory // block - resident, 0)
    return min(kv_memory, resident * block + 2 * beyond * block // _count(config, ATTENTION, layers))


def slot_state_bytes(config: ModelConfig, dtype: torch.dtype, layers: range | None = None) -> int:
    """Bytes of one slot's conv and recurrent state across the Gated DeltaNet layers among `layers`."""
    layers = _count(config, LINEAR_ATTENTION, layers)
    if layers == 0:
        return 0
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    conv = conv_dim * (config.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return layers * (conv + recurrent)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor's bytes (a view)."""
    return t.view(torch.uint8)


class PagedState:
    """Implements the model's `PagedStatePools` over slots: `seq` in a span is the slot index.

    Keys and values live in blocks [blocks, block_size, kv_heads, head_dim] per attention layer, of
    `kv_dtype` (None: `dtype`, the activations'); an 8-bit `kv_dtype` holds codes and a scale a row
    (`kv_quant`: rows of head_dim + 16), which `write_kv` and `extend_kv` quantize (the kernels widen them).
    Each slot's block table (set per window by the runner) maps its positions to blocks. One block and one
    slot beyond the given counts (`scratch_block`, `scratch_slot`) belong to no request: padding rows of a
    CUDA graph's bucket write there. The Gated DeltaNet pools hold `checkpoints` more slots after the scratch
    one (`checkpoint_slots`), where the prefix cache keeps states that requests can continue from. A stage of
    a layer split holds the state of its own `layers` only. `extra_attention` are attention layers beyond the
    decoder's (the MTP head's, numbered after them) whose keys and values share the blocks.

    With `resident` below `blocks` (`--kv-resident`), only the first `resident` blocks (and the scratch
    block, then numbered `resident`) live on the device, `keys` and `values` being theirs; the others live in
    host RAM (`stream`, app/engine/kv_stream.py) and a batch that reads them streams them in layer by layer
    (`kv_view`). `block_kv` and `gather_blocks` reach a block wherever it lives.
    """

    def __init__(
        self,
        config: ModelConfig,
        blocks: int,
        block_size: int,
        slots: int,
        dtype: torch.dtype,
        device: torch.device,
        checkpoints: int = 0,
        layers: range | None = None,
        extra_attention: tuple[int, ...] = (),
        kv_dtype: torch.dtype | None = None,
        resident: int | None = None,
    ) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.resident = blocks if resident is None else min(resident, blocks)
        self.scratch_block = self.resident
        self.scratch_slot = slots
        self.checkpoint_slots = tuple(range(slots + 1, slots + 1 + checkpoints))
        self.device = device
        held = range(len(config.layer_types)) if layers is None else layers
        attention = [i for i in held if config.layer_types[i] == ATTENTION] + list(extra_attention)
        self._kv_layer = {i: n for n, i in enumerate(attention)}
        self._gdn_layer = {
            i: n for n, i in enumerate(i for i in held if config.layer_types[i] == LINEAR_ATTENTION)
        }
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        row = kv_quant.row_width(config.head_dim, kv_dtype)
        row_shape = (block_size, config.num_key_value_heads, row)
        self.stream: StreamedKV | None = None
        if self.resident < blocks:
            self.stream = StreamedKV(len(self._kv_layer), blocks, self.resident, row_shape, kv_dtype, device)
            self.keys, self.values = self.stream.on_device
        else:
            self.keys = torch.zeros(
                (len(self._kv_layer), blocks + 1, *row_shape), dtype=kv_dtype, device=device
            )
            self.values = torch.zeros_like(self.keys)
        self._reads = [0, 0]  # KV block reads of the windows counted (`count_reads`): VRAM, host RAM
        self.quantized = kv_quant.quantized(kv_dtype)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        gdn = len(self._gdn_layer)
        pool_slots = slots + 1 + checkpoints
        self.conv = torch.zeros(
            gdn, pool_slots, conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device
        )
        recurrent_shape = (
            gdn,
            pool_slots,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        self.recurrent = torch.zeros(recurrent_shape, dtype=STATE_DTYPE, device=device)
        self.block_tables: dict[int, list[int]] = {}
        self._device_tables: dict[int, torch.Tensor] = {}

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        """The blocks holding a slot's positions, in order (for the coming window)."""
        self.block_tables[slot] = list(blocks)
        self._device_tables.pop(slot, None)

    def layout(self, spans: list[SequenceSpan]) -> PagedLayout:
        """The batch's `PagedLayout` from the spans and the slots' block tables (one copy to the device)."""
        seqs = len(spans)
        size = self.block_size
        width = max(-(-(s.past + s.length) // size) for s in spans)
        streamed = self.stream is not None
        table_rows = np.full((seqs, width), -1 if streamed else self.scratch_block, dtype=np.int64)
        padding_only = self.scratch_slot if streamed else None  # streamed, its table is -1: the scratch block
        for i, span in enumerate(spans):  # numpy takes a list of ints several times faster than torch
            if span.seq != padding_only:
                table = self.block_tables[span.seq][: -(-(span.past + span.length) // size)]
                table_rows[i, : len(table)] = table
        lengths = np.fromiter((s.length for s in spans), np.int64, seqs)
        starts = [0, *np.cumsum(lengths).tolist()]
        row_seq = np.repeat(np.arange(seqs), lengths)
        positions = np.fromiter((s.past for s in spans), np.int64, seqs)[row_seq] + (
            np.arange(starts[-1]) - np.asarray(starts[:-1], np.int64)[row_seq]
        )
        tables = torch.from_numpy(table_rows)
        slot_mapping = [torch.from_numpy(table_rows[row_seq, positions // size] * size + positions % size)]
        plan = None
        if self.stream is not None:
            tables, plan = self.stream.place(tables)
            slot_mapping = [self.stream.place_slots(slot_mapping[0], size, plan)]
        saving = any(s.save_slot is not None for s in spans)
        saves = [*(s.save_at for s in spans), *(-1 if s.save_slot is None else s.save_slot for s in spans)]
        stepping = any(s.stepwise for s in spans)
        steps = np.zeros(seqs if stepping else 0, np.int64)
        row_saves = np.full(starts[-1] if stepping else 0, -1, np.int64)
        for i, span in enumerate(spans):
            if span.stepwise:
                steps[i] = 1
                row_saves[span.start : span.start + len(span.row_saves)] = span.row_saves
        small = torch.tensor(
            [
                *starts,
                *(s.past + s.length for s in spans),
                *(s.seq for s in spans),
                *(saves if saving else []),
            ],
            dtype=torch.int64,
        )
        row_slots = torch.from_numpy(np.repeat([s.seq for s in spans], [s.length for s in spans]))
        stepped = torch.from_numpy(np.concatenate((steps, row_saves)))
        packed = torch.cat((small, tables.flatten(), *slot_mapping, row_slots, stepped))
        packed = packed.to(self.device, non_blocking=True)
        query_start, seq_lens, state_slots, save_at, save_slots, table, mapping, rows, stepwise, saved = (
            packed.split(
                [
                    seqs + 1,
                    seqs,
                    seqs,
                    seqs if saving else 0,
                    seqs if saving else 0,
                    seqs * width,
                    starts[-1],
                    starts[-1],
                    len(steps),
                    len(row_saves),
                ]
            )
        )
        return PagedLayout(
            query_start=query_start.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_table=table.view(seqs, width).to(torch.int32),
            slot_mapping=mapping,
            state_slots=state_slots,
            max_query_len=max(s.length for s in spans),
            row_slots=rows,
            save_at=save_at.to(torch.int32) if saving else None,
            save_slots=save_slots if saving else None,
            stepwise=stepwise.to(torch.int32) if stepping else None,
            row_saves=saved if stepping else None,
            streamed=plan,
        )

    def holds_layer(self, layer: int) -> bool:
        """Whether the state has keys and values of attention layer `layer` (an MTP head's, beyond the
        decoder's, only where it drafts)."""
        return layer in self._kv_layer

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv_layer[layer]
        if self.stream is not None:
            return self.stream.cache(kv)
        return self.keys[kv], self.values[kv]

    def kv_view(self, layer: int, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor, PagedLayout]:
        keys, values = self.kv_cache(layer)
        plan = layout.streamed
        if plan is None:
            return keys, values, layout
        assert self.stream is not None and isinstance(plan, StreamPlan)
        shift = self.stream.ready(self._kv_layer[layer], plan)
        return (
            keys,
            values,
            replace(
                layout,
                block_table=shifted(layout.block_table, shift),
                slot_mapping=shifted(layout.slot_mapping, shift * self.block_size),
                streamed=None,
            ),
        )

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at flat slots (block * block_size + offset) of the layer's
        caches as `kv_cache` gives them (a `kv_view` layout's slot mapping), 8-bit rows quantized."""
        kv_quant.write(*self.kv_cache(layer), k, v, slot_mapping)

    def count_reads(self, tables: list[tuple[list[int], int]]) -> bool:
        """Count a window's KV block reads (a block once a sequence), each (block table, tokens it holds after
        the window) a sequence's, by where the blocks live (`take_reads`); whether any lives in host RAM.
        A pool wholly on the device counts nothing."""
        if self.stream is None:
            return False
        size, resident = self.block_size, self.resident
        host = 0
        for blocks, tokens in tables:
            read = blocks[: -(-tokens // size)]
            if read and max(read) >= resident:  # (most tables read no host block: max is one C loop)
                host += int(np.count_nonzero(np.fromiter(read, np.int64, len(read)) >= resident))
        self._reads[1] += host
        self._reads[0] += sum(-(-tokens // size) for _, tokens in tables) - host
        return host > 0

    def take_reads(self) -> tuple[int, int]:
        """The KV block reads counted since the last call: (from VRAM, streamed from host RAM)."""
        reads, self._reads = self._reads, [0, 0]
        return reads[0], reads[1]

    def settle(self) -> None:
        """Let the host side read and write blocks in host RAM (after a batch that streamed them)."""
        if self.stream is not None:
            self.stream.host_side()

    def block_kv(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys and values in every attention layer [layers, block_size, kv_heads, row], where it
        lives (on the device or, beyond `resident`, in host RAM); `settle` first."""
        if block < self.resident or self.stream is None:
            return self.keys[:, block], self.values[:, block]
        home = block - self.resident
        return self.stream.homes[0][:, home], self.stream.homes[1][:, home]

    def gather_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Keys and values of `blocks` on the device: [blocks, 2, attention layers, block, kv heads, row]."""
        if self.stream is None or all(b < self.resident for b in blocks):
            ids = device_tensor(blocks, torch.long, self.device)
            keys = self.keys.index_select(1, ids).transpose(0, 1)
            values = self.values.index_select(1, ids).transpose(0, 1)
            return torch.stack((keys, values), dim=1)
        self.settle()
        return torch.stack([torch.stack([t.to(self.device) for t in self.block_kv(b)]) for b in blocks])

    def linear_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._gdn_layer[layer]
        return self.conv[n], self.recurrent[n]

    def copy_slot(self, source: int, target: int) -> None:
        """Copy one slot's conv and recurrent state over another's (checkpoints are slots too)."""
        self.conv[:, target] = self.conv[:, source]
        self.recurrent[:, target] = self.recurrent[:, source]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks' keys and values, in every attention layer, over others', (source, target) in order;
        with a pool partly in host RAM in the device's order (`StreamedKV.copy_blocks`)."""
        if self.stream is not None:
            self.stream.copy_blocks(pairs)
            return
        for source, target in pairs:
            self.keys[:, target] = self.keys[:, source]
            self.values[:, target] = self.values[:, source]

    def reset_slot(self, slot: int) -> None:
        """Start a slot's recurrent state empty (a new request, or one read again after preemption)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def _table(self, slot: int) -> torch.Tensor:
        if slot not in self._device_tables:
            self._device_tables[slot] = torch.tensor(self.block_tables[slot], device=self.device)
        return self._device_tables[slot]

    def _positions(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self.device)
        return self._table(slot)[positions // self.block_size], positions % self.block_size

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv_layer[layer]
        if self.stream is not None:
            return self._extend_blockwise(kv, span, k, v)
        dtype = k.dtype
        keys, values = self.keys[kv], self.values[kv]
        if self.quantized:
            k, v = _bytes(kv_quant.quantize(k, keys.dtype)), _bytes(kv_quant.quantize(v, keys.dtype))
            keys, values = _bytes(keys), _bytes(values)
        blocks, offsets = self._positions(span.seq, span.past, span.past + span.length)
        keys[blocks, offsets] = k
        values[blocks, offsets] = v
        total = span.past + span.length
        used = self._table(span.seq)[: -(-total // self.block_size)]  # whole blocks, then the tail cut off
        keys = self.keys[kv].index_select(0, used).flatten(0, 1)[:total]
        values = self.values[kv].index_select(0, used).flatten(0, 1)[:total]
        return kv_quant.dequantize(keys, dtype), kv_quant.dequantize(values, dtype)

    def _extend_blockwise(
        self, kv: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`extend_kv` block by block, wherever each block lives (a pool partly in host RAM)."""
        self.settle()
        dtype, size, total = k.dtype, self.block_size, span.past + span.length
        rows = [k, v]
        if self.quantized:
            rows = [_bytes(kv_quant.quantize(t, self.keys.dtype)) for t in rows]
        read: list[list[torch.Tensor]] = [[], []]
        for n, block in enumerate(self.block_tables[span.seq][: -(-total // size)]):
            low, high = max(span.past, n * size), min(total, (n + 1) * size)
            for cache, new, out in zip(self.block_kv(block), rows, read, strict=True):
                cache = _bytes(cache[kv]) if self.quantized else cache[kv]
                if high > low:
                    cache[low - n * size : high - n * size] = new[low - span.past : high - span.past].to(
                        cache.device
                    )
                out.append(cache.to(self.device))
        keys, values = (torch.cat(out)[:total] for out in read)
        if self.quantized:
            keys, values = keys.view(self.keys.dtype), values.view(self.keys.dtype)
        return kv_quant.dequantize(keys, dtype), kv_quant.dequantize(values, dtype)

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        n = self._gdn_layer[layer]
        return self.conv[n, seq], self.recurrent[n, seq]

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        n = self._gdn_layer[layer]
        self.conv[n, seq] = conv
        self.recurrent[n, seq] = recurrent


@dataclass
class StateCopies:
    """A window's work on the state before its forward, in this order: `saves` copy a slot's recurrent
    state into a checkpoint slot, `block_copies` a KV block into another, `restores` a checkpoint into a
    slot, and `resets` start slots empty (requests read from their first token). Every stage of a layer
    split applies the same copies to its own layers' state."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)

    def apply(self, state: PagedState) -> None:
        for slot, checkpoint in self.saves:
            state.copy_slot(slot, checkpoint)
        state.copy_blocks(self.block_copies)
        for checkpoint, slot in self.restores:
            state.copy_slot(checkpoint, slot)
        for slot in self.resets:
            state.reset_slot(slot)
