"""The varlen Gated DeltaNet kernels against the per-sequence torch reference, in Triton's interpreter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from app.kernels.reference import delta_rule_chunked, delta_rule_recurrent
from app.kernels.triton_gdn import causal_conv_varlen, gated_delta_rule_paged, gated_delta_rule_varlen
from app.models.batch import PagedLayout
from app.models.gdn import causal_conv, delta_rule_qk

SLOTS = 7
KERNEL = 4


@dataclass(frozen=True)
class Sizes:
    """Head counts and dimensions of a tiny Gated DeltaNet layer."""

    k_heads: int
    v_heads: int
    dk: int
    dv: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.dk + self.v_heads * self.dv


SIZES = [Sizes(2, 4, 16, 16), Sizes(2, 2, 32, 16), Sizes(1, 2, 16, 32)]


def _layout(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64)


def _states(
    sizes: Sizes, generator: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv and recurrent pools with random contents, except slots 0 and 2, which start empty."""
    conv = torch.randn(SLOTS, sizes.conv_dim, KERNEL - 1, generator=generator).to(dtype)
    recurrent = 0.3 * torch.randn(SLOTS, sizes.v_heads, sizes.dk, sizes.dv, generator=generator)
    conv[[0, 2]] = 0
    recurrent[[0, 2]] = 0
    return conv, recurrent


def _inputs(sizes: Sizes, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Mixed qkv [tokens, conv_dim], conv weight, and g, beta [tokens, v_heads] as the layer makes them."""
    mixed = torch.randn(tokens, sizes.conv_dim, generator=generator)
    weight = 0.5 * torch.randn(sizes.conv_dim, KERNEL, generator=generator)
    g = -F.softplus(torch.randn(tokens, sizes.v_heads, generator=generator)) * 0.5
    beta = torch.randn(tokens, sizes.v_heads, generator=generator).sigmoid()
    return mixed, weight, g, beta


def _split(sizes: Sizes, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided q, k [tokens, k_heads, dk] and v [tokens, v_heads, dv] views of the conv output."""
    key_dim = sizes.k_heads * sizes.dk
    q, k, v = conv_out.split([key_dim, key_dim, sizes.v_heads * sizes.dv], dim=-1)
    tokens = conv_out.shape[0]
    return (
        q.view(tokens, sizes.k_heads, sizes.dk),
        k.view(tokens, sizes.k_heads, sizes.dk),
        v.view(tokens, sizes.v_heads, sizes.dv),
    )


def _reference_rule(
    sizes: Sizes,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    pasts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's reference path sequence by sequence: l2norm, scaling, head repeat, then the delta rule.

    Prompt chunks (more than one row) use the chunked form with chunks at multiples of CHUNK positions after
    each sequence's past (`pasts`, zero when None); single rows the recurrent form.
    """
    out = torch.empty(v.shape, dtype=torch.float32)
    state = state.clone()
    bounds = query_start.tolist()
    for seq, slot in enumerate(slots.tolist()):
        rows = slice(bounds[seq], bounds[seq + 1])
        qn, kn = delta_rule_qk(q[rows], k[rows], sizes.v_heads)
        inputs = (qn, kn, v[rows].float(), g[rows], beta[rows], state[slot])
        if rows.stop - rows.start == 1:
            out[rows], state[slot] = delta_rule_recurrent(*inputs)
        else:
            out[rows], state[slot] = delta_rule_chunked(*inputs, offset=pasts[seq] if pasts else 0)
    return out, state


def _reference_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    conv_state = conv_state.clone()
    bounds = query_start.tolist()
    for seq, slot in enumerate(slots.tolist()):
        rows = slice(bounds[seq], bounds[seq + 1])
        out[rows], conv_state[slot] = causal_conv(x[rows], weight, conv_state[slot])
    return out, conv_state


# Decode rows and prompt chunks mixed; slots out of sequence order, two of them starting empty.
LENGTHS = [1, 13, 1, 20, 2, 1]
SLOT_ORDER = [3, 0, 6, 2, 5, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_matches_the_reference_per_sequence(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    sizes = SIZES[0]
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    mixed, weight, _, _ = _inputs(sizes, sum(LENGTHS), generator)
    conv_state, _ = _states(sizes, generator, dtype)
    x, weight = mixed.to(dtype), weight.to(dtype)
    expected, expected_state = _reference_conv(
        x.float(), weight.float(), conv_state.float(), query_start, slots
    )

    got = causal_conv_varlen(x, weight, conv_state, query_start, slots)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    # The new state is a copy of inputs: exact, and slots not in the batch (4) untouched.
    assert torch.equal(conv_state.float(), expected_state)


@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_delta_rule_matches_the_reference_per_sequence(sizes: Sizes) -> None:
    generator = torch.Generator().manual_seed(1)
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    mixed, _, g, beta = _inputs(sizes, sum(LENGTHS), generator)
    q, k, v = _split(sizes, mixed)  # strided views, as the layer passes them
    _, state = _states(sizes, generator, torch.float32)
    expected, expected_state = _reference_rule(sizes, q, k, v, g, beta, state, query_start, slots)
    untouched = state[4].clone()

    got = gated_delta_rule_varlen(q, k, v, g, beta, state, query_start, slots)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(state[4], untouched)


def test_the_layer_path_conv_then_delta_rule() -> None:
    """Conv output split into strided q, k, v views feeds the delta rule, as in the layer."""
    generator = torch.Generator().manual_seed(2)
    sizes = SIZES[0]
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    mixed, weight, g, beta = _inputs(sizes, sum(LENGTHS), generator)
    conv_state, state = _states(sizes, generator, torch.float32)
    conv_expected, conv_state_expected = _reference_conv(mixed, weight, conv_state, query_start, slots)
    expected, state_expected = _reference_rule(
        sizes, *_split(sizes, conv_expected), g, beta, state, query_start, slots
    )

    conv_out = causal_conv_varlen(mixed, weight, conv_state, query_start, slots)
    got = gated_delta_rule_varlen(*_split(sizes, conv_out), g, beta, state, query_start, slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(conv_state, conv_state_expected)


def test_two_chunks_continue_one_sequence() -> None:
    """A prompt cut into pieces (two chunks and a decode row) gives what it gives in one piece."""
    generator = torch.Generator().manual_seed(3)
    sizes = SIZES[0]
    mixed, weight, g, beta = _inputs(sizes, 20, generator)
    conv_state, state = _states(sizes, generator, torch.float32)
    whole_conv, whole_state = conv_state.clone(), state.clone()
    whole = gated_delta_rule_varlen(
        *_split(sizes, causal_conv_varlen(mixed, weight, whole_conv, *_layout([20], [5]))),
        g,
        beta,
        whole_state,
        *_layout([20], [5]),
    )
    pieces = []
    for rows in (slice(0, 2), slice(2, 19), slice(19, 20)):
        layout = _layout([rows.stop - rows.start], [5])
        conv_out = causal_conv_varlen(mixed[rows], weight, conv_state, *layout)
        pieces.append(gated_delta_rule_varlen(*_split(sizes, conv_out), g[rows], beta[rows], state, *layout))
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_state, whole_conv)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


def test_a_sequence_is_bit_identical_alone_or_batched() -> None:
    generator = torch.Generator().manual_seed(4)
    sizes = SIZES[0]
    mixed, weight, g, beta = _inputs(sizes, sum(LENGTHS), generator)
    conv_state, state = _states(sizes, generator, torch.float32)
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    batch_conv, batch_state = conv_state.clone(), state.clone()
    conv_out = causal_conv_varlen(mixed, weight, batch_conv, query_start, slots)
    batched = gated_delta_rule_varlen(*_split(sizes, conv_out), g, beta, batch_state, query_start, slots)

    bounds = query_start.tolist()
    for seq, slot in [(2, 6), (3, 2)]:
        rows = slice(bounds[seq], bounds[seq + 1])
        alone_conv, alone_state = conv_state.clone(), state.clone()
        layout = _layout([rows.stop - rows.start], [slot])
        alone_conv_out = causal_conv_varlen(mixed[rows].clone(), weight, alone_conv, *layout)
        alone = gated_delta_rule_varlen(
            *_split(sizes, alone_conv_out), g[rows].clone(), beta[rows].clone(), alone_state, *layout
        )
        assert torch.equal(alone_conv_out, conv_out[rows])
        assert torch.equal(alone, batched[rows])
        assert torch.equal(alone_conv[slot], batch_conv[slot])
        assert torch.equal(alone_state[slot], batch_state[slot])


def test_slots_outside_the_batch_are_untouched_and_empty_sequences_keep_their_state() -> None:
    generator = torch.Generator().manual_seed(5)
    sizes = SIZES[2]
    mixed, weight, g, beta = _inputs(sizes, 3, generator)
    conv_state, state = _states(sizes, generator, torch.float32)
    before_conv, before_state = conv_state.clone(), state.clone()
    query_start, slots = _layout([0, 3, 0], [4, 1, 6])
    conv_out = causal_conv_varlen(mixed, weight, conv_state, query_start, slots)
    gated_delta_rule_varlen(*_split(sizes, conv_out), g, beta, state, query_start, slots)
    untouched = [0, 2, 3, 4, 5, 6]
    assert torch.equal(conv_state[untouched], before_conv[untouched])
    assert torch.equal(state[untouched], before_state[untouched])
    assert not torch.equal(state[1], before_state[1])


# The engine's entry: prompt chunks at several positions of their sequences (inside a chunk, on a boundary,
# across several chunks) beside decode rows.
PAGED_LENGTHS = [1, 70, 1, 3, 130, 64, 2]
PAGED_PASTS = [5, 0, 9, 62, 100, 128, 0]
PAGED_SLOTS = [3, 0, 6, 2, 5, 1, 4]


def _paged(lengths: list[int], pasts: list[int], slots: list[int]) -> PagedLayout:
    """A layout with what the delta rule reads: rows, positions (seq_lens - rows) and state slots."""
    query_start, state_slots = _layout(lengths, slots)
    return PagedLayout(
        query_start=query_start,
        seq_lens=torch.tensor([p + n for p, n in zip(pasts, lengths, strict=True)], dtype=torch.int32),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(lengths), dtype=torch.int64),
        state_slots=state_slots,
        max_query_len=max(lengths, default=0),
    )


@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_paged_rule_reads_prompt_chunks_in_the_chunked_form(sizes: Sizes) -> None:
    generator = torch.Generator().manual_seed(6)
    layout = _paged(PAGED_LENGTHS, PAGED_PASTS, PAGED_SLOTS)
    mixed, _, g, beta = _inputs(sizes, sum(PAGED_LENGTHS), generator)
    q, k, v = _split(sizes, mixed)
    _, state = _states(sizes, generator, torch.float32)
    expected, expected_state = _reference_rule(
        sizes, q, k, v, g, beta, state, layout.query_start, layout.state_slots, PAGED_PASTS
    )
    untouched = state[[s for s in range(SLOTS) if s not in PAGED_SLOTS]].clone()

    got = gated_delta_rule_paged(q, k, v, g, beta, state, layout)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(state[[s for s in range(SLOTS) if s not in PAGED_SLOTS]], untouched)


def _run_paged(
    sizes: Sizes,
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    rows: slice,
    layout: PagedLayout,
) -> torch.Tensor:
    """The paged rule on a copy of `rows` of the inputs (mixed, g, beta), updating `state`."""
    mixed, g, beta = (t[rows].clone() for t in inputs)
    return gated_delta_rule_paged(*_split(sizes, mixed), g, beta, state, layout)


@pytest.mark.parametrize("past", [0, 10])
def test_paged_prompt_cut_at_chunk_multiples_is_bit_identical_to_one_piece(past: int) -> None:
    generator = torch.Generator().manual_seed(7)
    sizes = SIZES[0]
    mixed, _, g, beta = _inputs(sizes, 200, generator)
    _, state = _states(sizes, generator, torch.float32)
    whole_state = state.clone()
    whole = _run_paged(sizes, (mixed, g, beta), whole_state, slice(0, 200), _paged([200], [past], [5]))
    pieces = []
    for rows in (slice(0, 64 - past), slice(64 - past, 192 - past), slice(192 - past, 200)):
        length = rows.stop - rows.start
        pieces.append(
            _run_paged(sizes, (mixed, g, beta), state, rows, _paged([length], [past + rows.start], [5]))
        )
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(state, whole_state)


def test_paged_sequences_are_bit_identical_alone_or_batched() -> None:
    generator = torch.Generator().manual_seed(8)
    sizes = SIZES[1]
    mixed, _, g, beta = _inputs(sizes, sum(PAGED_LENGTHS), generator)
    _, state = _states(sizes, generator, torch.float32)
    batch_state = state.clone()
    batched = _run_paged(
        sizes,
        (mixed, g, beta),
        batch_state,
        slice(0, len(mixed)),
        _paged(PAGED_LENGTHS, PAGED_PASTS, PAGED_SLOTS),
    )
    bounds = _layout(PAGED_LENGTHS, PAGED_SLOTS)[0].tolist()
    for seq in (0, 3, 4):
        rows = slice(bounds[seq], bounds[seq + 1])
        slot = PAGED_SLOTS[seq]
        alone_state = state.clone()
        layout = _paged([PAGED_LENGTHS[seq]], [PAGED_PASTS[seq]], [slot])
        alone = _run_paged(sizes, (mixed, g, beta), alone_state, rows, layout)
        assert torch.equal(alone, batched[rows])
        assert torch.equal(alone_state[slot], batch_state[slot])


def test_a_prompt_chunk_leaves_its_state_at_a_save_position() -> None:
    """The state saved inside a 150-row chunk at position 128 is the state after reading only up to it."""
    generator = torch.Generator().manual_seed(9)
    sizes = SIZES[0]
    mixed, _, g, beta = _inputs(sizes, 150, generator)
    _, state = _states(sizes, generator, torch.float32)
    alone_state = state.clone()
    _run_paged(sizes, (mixed, g, beta), alone_state, slice(0, 118), _paged([118], [10], [5]))
    layout = dataclasses.replace(
        _paged([140], [10], [5]),
        save_at=torch.tensor([128], dtype=torch.int32),
        save_slots=torch.tensor([6], dtype=torch.int64),
    )
    whole_state = state.clone()
    whole = _run_paged(sizes, (mixed, g, beta), whole_state, slice(0, 140), layout)
    assert torch.equal(whole_state[6], alone_state[5])
    plain_state = state.clone()
    plain = _run_paged(sizes, (mixed, g, beta), plain_state, slice(0, 140), _paged([140], [10], [5]))
    assert torch.equal(whole, plain) and torch.equal(whole_state[5], plain_state[5])


def test_stepwise_sequences_are_read_as_decode_rows_leaving_the_state_after_each_row() -> None:
    """Draft rows being verified (stepwise sequences) beside a prompt chunk and a decode row: one launch of
    the conv and of the rule gives, bit for bit, what reading them one row a window gives, and leaves the
    state after each row that has a save slot there."""
    generator = torch.Generator().manual_seed(10)
    sizes = SIZES[0]
    lengths, pasts, slots = [70, 4, 1, 3], [0, 9, 5, 2], [0, 3, 6, 2]
    stepwise = [False, True, False, True]
    saves = {1: [7, 8, 9], 3: [-1, 10]}  # sequence -> the save slot after each of its rows
    mixed, weight, g, beta = _inputs(sizes, sum(lengths), generator)
    conv = torch.randn(12, sizes.conv_dim, KERNEL - 1, generator=generator)
    state = 0.3 * torch.randn(12, sizes.v_heads, sizes.dk, sizes.dv, generator=generator)
    bounds = _layout(lengths, slots)[0].tolist()
    row_saves = torch.full((sum(lengths),), -1, dtype=torch.int64)
    for seq, targets in saves.items():
        row_saves[bounds[seq] : bounds[seq] + len(targets)] = torch.tensor(targets)
    layout = dataclasses.replace(
        _paged(lengths, pasts, slots),
        stepwise=torch.tensor(stepwise, dtype=torch.int32),
        row_saves=row_saves,
    )
    got_conv, got_state = conv.clone(), state.clone()
    query_start, slots = layout.query_start, layout.state_slots
    conv_out = causal_conv_varlen(mixed, weight, got_conv, query_start, slots, layout=layout)
    got = gated_delta_rule_paged(*_split(sizes, conv_out), g, beta, got_state, layout)

    # One row of each stepwise sequence a window (the first beside every other sequence whole).
    want_conv, want_state = conv.clone(), state.clone()
    want_conv_out, want = torch.empty_like(conv_out), torch.empty_like(got)
    for j in range(max(lengths[s] for s in range(4) if stepwise[s])):
        rows: list[int] = []
        step_lengths, step_pasts, step_slots = [], [], []
        for seq in range(4):
            if stepwise[seq] and j < lengths[seq]:
                taken = [bounds[seq] + j]
                step_pasts.append(pasts[seq] + j)
            elif not stepwise[seq] and j == 0:
                taken = list(range(bounds[seq], bounds[seq + 1]))
                step_pasts.append(pasts[seq])
            else:
                continue
            rows += taken
            step_lengths.append(len(taken))
            step_slots.append(slots[seq])
        index = torch.tensor(rows)
        step = _paged(step_lengths, step_pasts, step_slots)
        part = causal_conv_varlen(mixed[index], weight, want_conv, step.query_start, step.state_slots)
        want_conv_out[index] = part
        want[index] = gated_delta_rule_paged(*_split(sizes, part), g[index], beta[index], want_state, step)
        for seq, targets in saves.items():
            if j < len(targets) and targets[j] >= 0:
                want_conv[targets[j]], want_state[targets[j]] = want_conv[slots[seq]], want_state[slots[seq]]
    assert torch.equal(conv_out, want_conv_out)
    assert torch.equal(got, want)
    assert torch.equal(got_conv, want_conv)
    assert torch.equal(got_state, want_state)


def test_the_conv_leaves_its_state_at_a_save_position() -> None:
    """The conv state a 140-row chunk saves at position 128 is the state after reading only up to it; the
    chunk's outputs and final state are those of reading it without the save."""
    generator = torch.Generator().manual_seed(11)
    sizes = SIZES[0]
    mixed, weight, _, _ = _inputs(sizes, 140, generator)
    conv, _ = _states(sizes, generator, torch.float32)
    alone = conv.clone()
    causal_conv_varlen(mixed[:118].clone(), weight, alone, *_layout([118], [5]))
    layout = dataclasses.replace(
        _paged([140], [10], [5]),
        save_at=torch.tensor([128], dtype=torch.int32),
        save_slots=torch.tensor([6], dtype=torch.int64),
    )
    saving = conv.clone()
    out = causal_conv_varlen(mixed, weight, saving, layout.query_start, layout.state_slots, layout=layout)
    assert torch.equal(saving[6], alone[5])
    plain = conv.clone()
    assert torch.equal(out, causal_conv_varlen(mixed, weight, plain, *_layout([140], [5])))
    assert torch.equal(saving[5], plain[5])
