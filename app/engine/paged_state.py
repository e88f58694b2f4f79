"""Model state of the batch slots: a paged KV pool for attention layers, per-slot Gated DeltaNet state."""

from __future__ import annotations

import torch

from app.models.batch import SequenceSpan
from app.models.config import ATTENTION, LINEAR_ATTENTION, ModelConfig

STATE_DTYPE = torch.float32  # Gated DeltaNet recurrent state is carried in fp32


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all attention layers (keys and values)."""
    layers = config.layer_types.count(ATTENTION)
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * config.num_key_value_heads * config.head_dim * item


def slot_state_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one slot's conv and recurrent state across all Gated DeltaNet layers."""
    layers = config.layer_types.count(LINEAR_ATTENTION)
    if layers == 0:
        return 0
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    conv = conv_dim * (config.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return layers * (conv + recurrent)


class PagedState:
    """Implements the model's `SequenceState` over slots: `seq` in a span is the slot index.

    Keys and values live in blocks [blocks, block_size, kv_heads, head_dim] per attention layer; each slot's
    block table (set per window by the runner) maps its positions to blocks.
    """

    def __init__(
        self,
        config: ModelConfig,
        blocks: int,
        block_size: int,
        slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self._kv_layer = {
            i: n for n, i in enumerate(i for i, t in enumerate(config.layer_types) if t == ATTENTION)
        }
        self._gdn_layer = {
            i: n for n, i in enumerate(i for i, t in enumerate(config.layer_types) if t == LINEAR_ATTENTION)
        }
        kv_shape = (len(self._kv_layer), blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.values = torch.zeros(kv_shape, dtype=dtype, device=device)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        gdn = len(self._gdn_layer)
        self.conv = torch.zeros(
            gdn, slots, conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device
        )
        recurrent_shape = (
            gdn,
            slots,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        self.recurrent = torch.zeros(recurrent_shape, dtype=STATE_DTYPE, device=device)
        self.block_tables: dict[int, torch.Tensor] = {}

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        """The blocks holding a slot's positions, in order (for the coming window)."""
        self.block_tables[slot] = torch.tensor(blocks, dtype=torch.long, device=self.keys.device)

    def reset_slot(self, slot: int) -> None:
        """Start a slot's recurrent state empty (a new request, or one read again after preemption)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def _positions(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self.keys.device)
        return self.block_tables[slot][positions // self.block_size], positions % self.block_size

    def extend_kv(
        self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv_layer[layer]
        blocks, offsets = self._positions(span.seq, span.past, span.past + span.length)
        self.keys[kv, blocks, offsets] = k
        self.values[kv, blocks, offsets] = v
        blocks, offsets = self._positions(span.seq, 0, span.past + span.length)
        return self.keys[kv, blocks, offsets], self.values[kv, blocks, offsets]

    def linear_state(self, layer: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        n = self._gdn_layer[layer]
        return self.conv[n, seq], self.recurrent[n, seq]

    def set_linear_state(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        n = self._gdn_layer[layer]
        self.conv[n, seq] = conv
        self.recurrent[n, seq] = recurrent
