"""The CPU set's native sequence mixers (native/cpu_sequence.cpp) against their torch references and the
model's per-sequence layers: paged attention, Gated DeltaNet's conv and delta rule, q/k norm with rotary."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from checkpoints import write_checkpoint

from app.engine.paged_state import PagedState
from app.kernels import cpu_sequence
from app.kernels.backends import select_backends
from app.kernels.cpu_experts import native_available
from app.kernels.cpu_sequence import conv_varlen, delta_rule_paged, paged_attention, qk_norm_rope
from app.kernels.reference import causal_attention, delta_rule_recurrent
from app.loading.loader import load_model
from app.models.batch import ForwardBatch, PagedLayout
from app.models.gdn import causal_conv, delta_rule_qk
from app.models.layers import RMSNorm, apply_rotary
from app.models.qwen3 import CausalLM

pytestmark = pytest.mark.skipif(not native_available(), reason="the native CPU kernels are not built")

BLOCK = 4
# Decode rows with short and long pasts, prompt chunks with and without a past: (past, rows) per sequence.
SPANS = [(9, 1), (0, 6), (21, 1), (5, 3), (0, 1), (40, 1)]


def _layout(spans: list[tuple[int, int]], slots: list[int], tables: torch.Tensor) -> PagedLayout:
    starts = [0]
    for _, rows in spans:
        starts.append(starts[-1] + rows)
    return PagedLayout(
        query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([past + rows for past, rows in spans], dtype=torch.int32),
        block_table=tables,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        state_slots=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(rows for _, rows in spans),
    )


def _attention_case(
    spans: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int = 0
) -> tuple:
    """q, NaN-filled caches with each sequence's keys on shuffled blocks, the layout, and the keys."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(past + rows) // BLOCK) for past, rows in spans]
    blocks = sum(needed) + 2
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = torch.zeros(len(spans), max(needed), dtype=torch.int32)
    keys = torch.full((blocks, BLOCK, kv_heads, dim), float("nan"))
    values = torch.full((blocks, BLOCK, kv_heads, dim), float("nan"))
    q, sequences = [], []
    for i, (past, rows) in enumerate(spans):
        own, order = order[: needed[i]], order[needed[i] :]
        tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        k, v = (torch.randn(past + rows, kv_heads, dim, generator=gen) for _ in range(2))
        at = tables[i, torch.arange(past + rows) // BLOCK].long() * BLOCK + torch.arange(past + rows) % BLOCK
        keys.view(-1, kv_heads, dim)[at], values.view(-1, kv_heads, dim)[at] = k, v
        q.append(torch.randn(rows, heads, dim, generator=gen))
        sequences.append((k, v))
    return torch.cat(q), keys, values, _layout(spans, list(range(len(spans))), tables), sequences


def _attention_reference(q: torch.Tensor, layout: PagedLayout, sequences: list, scale: float) -> torch.Tensor:
    bounds = layout.query_start.tolist()
    return torch.cat(
        [causal_attention(q[bounds[i] : bounds[i + 1]], k, v, scale) for i, (k, v) in enumerate(sequences)]
    )


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (2, 2, 32), (8, 1, 16)])
def test_paged_attention_matches_each_sequence_alone(heads: int, kv_heads: int, dim: int) -> None:
    q, keys, values, layout, sequences = _attention_case(SPANS, heads, kv_heads, dim)
    got = paged_attention(q, keys, values, layout, dim**-0.5)
    expected = _attention_reference(q, layout, sequences, dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    reference = cpu_sequence.paged_attention_reference(q, keys, values, layout, dim**-0.5)
    torch.testing.assert_close(reference, expected, atol=1e-6, rtol=1e-6)


def test_a_decode_row_is_bit_identical_alone_or_batched() -> None:
    q, keys, values, layout, _ = _attention_case(SPANS, 4, 2, 64)
    batched = paged_attention(q, keys, values, layout, 0.125)
    for seq in (0, 2, 5):
        row = int(layout.query_start[seq])
        alone = dataclasses.replace(
            layout,
            query_start=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=layout.seq_lens[seq : seq + 1],
            block_table=layout.block_table[seq : seq + 1],
            state_slots=layout.state_slots[seq : seq + 1],
            max_query_len=1,
        )
        assert torch.equal(paged_attention(q[row : row + 1], keys, values, alone, 0.125)[0], batched[row])


def test_a_layout_pointing_outside_the_cache_is_refused() -> None:
    q, keys, values, layout, _ = _attention_case(SPANS, 4, 2, 64)
    tables = layout.block_table.clone()
    tables[0, 0] = keys.shape[0]
    with pytest.raises(ValueError, match="block_table entries"):
        paged_attention(q, keys, values, dataclasses.replace(layout, block_table=tables), 0.125)
    lens = layout.seq_lens.clone()
    lens[2] = tables.shape[1] * BLOCK + 1
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, keys, values, dataclasses.replace(layout, seq_lens=lens), 0.125)


def test_other_dtypes_take_the_torch_reference() -> None:
    q, keys, values, layout, sequences = _attention_case(SPANS, 4, 2, 32)
    got = paged_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), layout, 32**-0.5)
    assert got.dtype == torch.bfloat16
    expected = _attention_reference(q, layout, sequences, 32**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.05)


K_HEADS, V_HEADS, DK, DV, KERNEL = 2, 4, 16, 32, 4
CONV_DIM = 2 * K_HEADS * DK + V_HEADS * DV
ROWS = [1, 13, 1, 70, 2, 1]
SLOTS = [3, 0, 6, 2, 5, 1]


def _gdn_case(rows: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Mixed qkv [tokens, conv_dim], conv weight, g, beta, and conv / recurrent pools of 8 slots."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(rows)
    mixed = torch.randn(tokens, CONV_DIM, generator=gen)
    weight = 0.5 * torch.randn(CONV_DIM, KERNEL, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(tokens, V_HEADS, generator=gen)) * 0.5
    beta = torch.randn(tokens, V_HEADS, generator=gen).sigmoid()
    conv = torch.randn(8, CONV_DIM, KERNEL - 1, generator=gen)
    recurrent = 0.3 * torch.randn(8, V_HEADS, DK, DV, generator=gen)
    return mixed, weight, g, beta, conv, recurrent


def _gdn_layout(rows: list[int], pasts: list[int], slots: list[int]) -> PagedLayout:
    return _layout(list(zip(pasts, rows, strict=True)), slots, torch.zeros(len(rows), 1, dtype=torch.int32))


def _split(conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided q, k and v views of the conv output, as the layer passes them."""
    q, k, v = conv_out.split([K_HEADS * DK, K_HEADS * DK, V_HEADS * DV], dim=-1)
    tokens = conv_out.shape[0]
    return q.view(tokens, K_HEADS, DK), k.view(tokens, K_HEADS, DK), v.view(tokens, V_HEADS, DV)


def test_conv_matches_the_layers_conv_per_sequence() -> None:
    mixed, weight, _, _, conv, _ = _gdn_case(ROWS)
    layout = _gdn_layout(ROWS, [0] * len(ROWS), SLOTS)
    native_state = conv.clone()
    got = conv_varlen(mixed, weight, native_state, layout.query_start, layout.state_slots)
    reference_state = conv.clone()
    reference = cpu_sequence.conv_varlen_reference(
        mixed, weight, reference_state, layout.query_start, layout.state_slots
    )
    bounds = layout.query_start.tolist()
    for seq, slot in enumerate(SLOTS):
        rows = slice(bounds[seq], bounds[seq + 1])
        expected, state = causal_conv(mixed[rows], weight, conv[slot])
        torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference[rows], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(native_state[slot], state) and torch.equal(reference_state[slot], state)
    assert torch.equal(native_state[[4, 7]], conv[[4, 7]])  # slots of no sequence are untouched


def _reference_rule(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, layout: PagedLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's arithmetic sequence by sequence, token by token: q, k normalised, the recurrent rule."""
    q, k, v = _split(mixed)
    out, state = torch.empty(mixed.shape[0], V_HEADS, DV), state.clone()
    bounds = layout.query_start.tolist()
    for seq, slot in enumerate(layout.state_slots.tolist()):
        rows = slice(bounds[seq], bounds[seq + 1])
        qn, kn = delta_rule_qk(q[rows], k[rows], V_HEADS)
        out[rows], state[slot] = delta_rule_recurrent(qn, kn, v[rows], g[rows], beta[rows], state[slot])
    return out, state


def test_delta_rule_matches_the_recurrent_rule_per_sequence() -> None:
    mixed, _, g, beta, _, recurrent = _gdn_case(ROWS)
    layout = _gdn_layout(ROWS, [5, 0, 64, 3, 0, 9], SLOTS)
    expected, expected_state = _reference_rule(mixed, g, beta, recurrent, layout)
    state = recurrent.clone()
    got = delta_rule_paged(*_split(mixed), g, beta, state, layout)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
    reference_state = recurrent.clone()
    reference = cpu_sequence.delta_rule_paged_reference(*_split(mixed), g, beta, reference_state, layout)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)


def test_delta_rule_in_pieces_or_alone_is_bit_identical_to_one_batch() -> None:
    mixed, _, g, beta, _, recurrent = _gdn_case(ROWS, seed=1)
    pasts = [5, 0, 64, 3, 0, 9]
    batch_state = recurrent.clone()
    batched = delta_rule_paged(*_split(mixed), g, beta, batch_state, _gdn_layout(ROWS, pasts, SLOTS))
    bounds = _gdn_layout(ROWS, pasts, SLOTS).query_start.tolist()
    seq, slot = 3, SLOTS[3]  # 70 rows, read alone in three pieces
    state = recurrent.clone()
    pieces = []
    for first, last in ((0, 20), (20, 21), (21, 70)):
        rows = slice(bounds[seq] + first, bounds[seq] + last)
        layout = _gdn_layout([last - first], [pasts[seq] + first], [slot])
        pieces.append(delta_rule_paged(*_split(mixed[rows].clone()), g[rows], beta[rows], state, layout))
    assert torch.equal(torch.cat(pieces), batched[bounds[seq] : bounds[seq + 1]])
    assert torch.equal(state[slot], batch_state[slot])


def test_delta_rule_leaves_its_state_at_a_save_position() -> None:
    mixed, _, g, beta, _, recurrent = _gdn_case([70], seed=2)
    layout = dataclasses.replace(
        _gdn_layout([70], [10], [2]),
        save_at=torch.tensor([64], dtype=torch.int32),
        save_slots=torch.tensor([7], dtype=torch.int64),
    )
    state = recurrent.clone()
    delta_rule_paged(*_split(mixed), g, beta, state, layout)
    head = recurrent.clone()
    delta_rule_paged(*_split(mixed[:54].clone()), g[:54], beta[:54], head, _gdn_layout([54], [10], [2]))
    assert torch.equal(state[7], head[2])
    reference_state = recurrent.clone()
    cpu_sequence.delta_rule_paged_reference(*_split(mixed), g, beta, reference_state, layout)
    torch.testing.assert_close(reference_state[7], head[2], atol=1e-5, rtol=1e-5)


def test_state_slots_outside_the_pools_are_refused() -> None:
    mixed, weight, g, beta, conv, recurrent = _gdn_case(ROWS)
    layout = _gdn_layout(ROWS, [0] * len(ROWS), [*SLOTS[:-1], 8])
    with pytest.raises(ValueError, match="state_slots"):
        conv_varlen(mixed, weight, conv, layout.query_start, layout.state_slots)
    with pytest.raises(ValueError, match="state_slots"):
        delta_rule_paged(*_split(mixed), g, beta, recurrent, layout)


@pytest.mark.parametrize("offset", [False, True])
def test_qk_norm_rope_matches_the_layers(offset: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, dim, rotary = 5, 64, 16
    qkv = torch.randn(tokens, 6 * dim, generator=gen)
    q, k = qkv[:, : 4 * dim].view(tokens, 4, dim), qkv[:, 4 * dim :].view(tokens, 2, dim)
    q_norm, k_norm = RMSNorm(dim, 1e-6, offset=offset), RMSNorm(dim, 1e-6, offset=offset)
    with torch.no_grad():
        q_norm.weight.normal_(generator=gen)
        k_norm.weight.normal_(generator=gen)
    angles = torch.randn(tokens, rotary, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    got_q, got_k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, 1e-6, offset, cos, sin)
    with torch.no_grad():
        torch.testing.assert_close(got_q, apply_rotary(q_norm(q), cos, sin), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, apply_rotary(k_norm(k), cos, sin), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gdn_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = write_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
    return load_model(path, dtype="float32", progress=False, backends=select_backends("cpu", "cpu"))[0]


def _three_paths(
    layer: torch.nn.Module,
    narrow: list[torch.nn.Parameter],
    state: PagedState,
    pools: tuple[torch.Tensor, torch.Tensor],
    tables: dict[int, list[int]],
    spans: list[tuple[int, list[int], int]],
    run: Callable[[ForwardBatch], torch.Tensor],
) -> None:
    """Run a decode window through the layer's fused step, its native pieces and its torch path, from the
    same random pools (`narrow` parameters in bf16 first, as a bf16 checkpoint leaves them): the outputs and
    the pools afterwards agree, and the pools changed."""
    fused_step, saved = layer.decode_step, {name: p.data for name, p in layer.named_parameters()}
    for parameter in narrow:
        parameter.data = parameter.data.bfloat16()
    generator = torch.Generator().manual_seed(13)
    for pool in pools:
        pool.copy_(0.3 * torch.randn(pool.shape, generator=generator))
    start = [pool.clone() for pool in pools]
    results = []
    try:
        for path in ("fused", "native pieces", "torch"):
            for pool, first in zip(pools, start, strict=True):
                pool.copy_(first)
            for slot, blocks in tables.items():
                state.set_block_table(slot, blocks)
            batch = ForwardBatch.build(spans, state)
            if path != "torch":
                batch.layout = state.layout(batch.spans)
            layer.decode_step = fused_step if path == "fused" else None
            with torch.inference_mode():
                results.append((run(batch), *(pool.clone() for pool in pools)))
    finally:
        layer.decode_step = fused_step
        for name, p in layer.named_parameters():
            p.data = saved[name]
    for other in results[1:]:
        for got, expected in zip(results[0], other, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.equal(results[0][-1], start[-1])


def _paged_state(model: CausalLM, block_size: int) -> PagedState:
    cpu = torch.device("cpu")
    return PagedState(model.config, blocks=8, block_size=block_size, slots=4, dtype=torch.float32, device=cpu)


@pytest.mark.parametrize("narrow", [False, True], ids=["fp32", "bf16-projections"])
def test_a_fused_gated_deltanet_decode_step_equals_the_layers_pieces(
    gdn_model: CausalLM, narrow: bool
) -> None:
    """One native call for a window of decode rows against the same layer's pieces: the native conv and
    delta rule over the pools, and the torch step sequence by sequence; outputs and states alike."""
    layer = next(d.linear_attn for d in gdn_model.model.layers if d.linear_attn is not None)
    assert layer.decode_step is not None
    state = _paged_state(gdn_model, 16)
    pools = state.linear_pools(layer.layer)
    x = torch.randn(3, gdn_model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    linears = (layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj)
    _three_paths(
        layer,
        [linear.weight for linear in linears] if narrow else [],
        state,
        pools,
        {slot: [slot] for slot in (2, 0, 3)},
        [(slot, [0], 9 + slot) for slot in (2, 0, 3)],
        lambda batch: layer(x, batch),
    )


@pytest.mark.parametrize("narrow", [False, True], ids=["fp32", "bf16-projections"])
def test_a_fused_attention_decode_step_equals_the_layers_pieces(gdn_model: CausalLM, narrow: bool) -> None:
    """One native call for a window of decode rows against the same attention layer's pieces (native norm,
    rotary and paged attention; torch sequence by sequence): outputs and the keys and values written."""
    layer = next(d.self_attn for d in gdn_model.model.layers if d.linear_attn is None)
    assert layer.decode_step is not None and layer.gated
    state = _paged_state(gdn_model, 4)
    pools = state.kv_cache(layer.layer)
    x = torch.randn(3, gdn_model.config.hidden_size, generator=torch.Generator().manual_seed(2))

    def run(batch: ForwardBatch) -> torch.Tensor:
        return layer(x, batch, gdn_model.model.rotary.cos_sin(batch.positions, torch.float32))

    _three_paths(
        layer,
        [layer.qkv_weight, layer.o_proj.weight] if narrow else [],
        state,
        pools,
        {2: [5, 1, 7], 0: [3, 0], 3: [6, 2, 4]},
        [(slot, [0], past) for slot, past in ((2, 9), (0, 4), (3, 11))],
        run,
    )
