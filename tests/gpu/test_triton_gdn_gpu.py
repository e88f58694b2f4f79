"""The varlen Gated DeltaNet kernels on a CUDA device at Qwen3-Next-80B-A3B's sizes, in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.kernels.reference import delta_rule_recurrent
from app.kernels.triton_gdn import causal_conv_varlen, gated_delta_rule_paged, gated_delta_rule_varlen
from app.models.batch import PagedLayout
from app.models.gdn import causal_conv, delta_rule_qk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

K_HEADS, V_HEADS, DK, DV, KERNEL = 16, 32, 128, 128, 4
KEY_DIM = K_HEADS * DK
CONV_DIM = 2 * KEY_DIM + V_HEADS * DV  # 8192
SLOTS = 16
# Eight decode rows around one 1000-token prompt chunk; slots out of order, one decode slot starting empty.
LENGTHS = [1, 1, 1, 1, 1000, 1, 1, 1, 1]
SLOT_ORDER = [9, 2, 14, 5, 0, 11, 7, 3, 12]
EMPTY_SLOT = 14


def _layout(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return (
        torch.tensor(offsets, dtype=torch.int32, device="cuda"),
        torch.tensor(slots, dtype=torch.int64, device="cuda"),
    )


def _inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 mixed qkv, conv weight and conv state; fp32 g, beta and recurrent state, as the layer has them."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda")

    conv_state = randn(SLOTS, CONV_DIM, KERNEL - 1).bfloat16()
    state = 0.1 * randn(SLOTS, V_HEADS, DK, DV)
    conv_state[EMPTY_SLOT] = 0
    state[EMPTY_SLOT] = 0
    return {
        "mixed": randn(tokens, CONV_DIM).bfloat16(),
        "weight": (0.5 * randn(CONV_DIM, KERNEL)).bfloat16(),
        "g": -F.softplus(randn(tokens, V_HEADS) - 1.0),
        "beta": randn(tokens, V_HEADS).sigmoid(),
        "conv_state": conv_state,
        "state": state,
    }


def _split(conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = conv_out.split([KEY_DIM, KEY_DIM, V_HEADS * DV], dim=-1)
    tokens = conv_out.shape[0]
    return q.view(tokens, K_HEADS, DK), k.view(tokens, K_HEADS, DK), v.view(tokens, V_HEADS, DV)


def _run(
    inputs: dict[str, torch.Tensor], query_start: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels over the batch, updating the state pools in `inputs` in place."""
    conv_out = causal_conv_varlen(inputs["mixed"], inputs["weight"], inputs["conv_state"], query_start, slots)
    out = gated_delta_rule_varlen(
        *_split(conv_out), inputs["g"], inputs["beta"], inputs["state"], query_start, slots
    )
    return conv_out, out


def _recurrent_reference(
    conv_out: torch.Tensor, before: dict[str, torch.Tensor], rows: slice, slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 token-by-token delta rule of one sequence's conv output, from the state before the batch."""
    q, k, v = (t.float() for t in _split(conv_out))
    q, k = delta_rule_qk(q, k, V_HEADS)
    return delta_rule_recurrent(q, k, v, before["g"][rows], before["beta"][rows], before["state"][slot])


def _copy(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in inputs.items()}


def test_matches_the_fp32_reference() -> None:
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    inputs = _inputs(sum(LENGTHS), seed=0)
    before = _copy(inputs)
    conv_out, out = _run(inputs, query_start, slots)
    assert conv_out.dtype == torch.bfloat16 and out.dtype == torch.float32

    bounds = query_start.tolist()
    weight = before["weight"].float()
    for seq, slot in enumerate(SLOT_ORDER):
        rows = slice(bounds[seq], bounds[seq + 1])
        expected_conv, expected_conv_state = causal_conv(
            before["mixed"][rows].float(), weight, before["conv_state"][slot].float()
        )
        torch.testing.assert_close(conv_out[rows].float(), expected_conv, rtol=1e-2, atol=1e-2)
        assert torch.equal(inputs["conv_state"][slot], expected_conv_state.bfloat16())

        # The delta rule from the same bf16 conv output, in fp32 token by token.
        expected, expected_state = _recurrent_reference(conv_out[rows], before, rows, slot)
        torch.testing.assert_close(out[rows], expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(inputs["state"][slot], expected_state, rtol=2e-3, atol=2e-3)

    untouched = [s for s in range(SLOTS) if s not in SLOT_ORDER]
    assert torch.equal(inputs["conv_state"][untouched], before["conv_state"][untouched])
    assert torch.equal(inputs["state"][untouched], before["state"][untouched])


def test_a_sequence_is_bit_identical_alone_or_batched() -> None:
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    inputs = _inputs(sum(LENGTHS), seed=1)
    batched = _copy(inputs)
    conv_out, out = _run(batched, query_start, slots)

    bounds = query_start.tolist()
    for seq in (4, 0, 6):
        rows = slice(bounds[seq], bounds[seq + 1])
        slot = SLOT_ORDER[seq]
        alone = _copy(inputs)
        alone["mixed"], alone["g"], alone["beta"] = (
            inputs[name][rows].clone() for name in ("mixed", "g", "beta")
        )
        alone_conv_out, alone_out = _run(alone, *_layout([rows.stop - rows.start], [slot]))
        assert torch.equal(alone_conv_out, conv_out[rows])
        assert torch.equal(alone_out, out[rows])
        assert torch.equal(alone["conv_state"][slot], batched["conv_state"][slot])
        assert torch.equal(alone["state"][slot], batched["state"][slot])


def test_runs_inside_a_cuda_graph() -> None:
    query_start, slots = _layout(LENGTHS, SLOT_ORDER)
    initial = _inputs(sum(LENGTHS), seed=2)
    eager = _copy(initial)
    expected_conv, expected = _run(eager, query_start, slots)

    static = _copy(initial)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(static, query_start, slots)
    torch.cuda.current_stream().wait_stream(side)
    for name in ("conv_state", "state"):
        static[name].copy_(initial[name])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_out, out = _run(static, query_start, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(conv_out, expected_conv)
    assert torch.equal(out, expected)
    assert torch.equal(static["conv_state"], eager["conv_state"])
    assert torch.equal(static["state"], eager["state"])


def _paged(lengths: list[int], pasts: list[int], slots: list[int]) -> PagedLayout:
    query_start, state_slots = _layout(lengths, slots)
    return PagedLayout(
        query_start=query_start,
        seq_lens=torch.tensor(
            [p + n for p, n in zip(pasts, lengths, strict=True)], dtype=torch.int32, device="cuda"
        ),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(sum(lengths), dtype=torch.int64, device="cuda"),
        state_slots=state_slots,
        max_query_len=max(lengths),
    )


# Decode rows beside prompt chunks starting on, inside and across chunk boundaries.
PAGED_LENGTHS = [1, 1000, 1, 300, 1, 64]
PAGED_PASTS = [40, 0, 7, 37, 500, 128]
PAGED_SLOTS = [9, 0, 14, 5, 2, 11]


def _run_paged(inputs: dict[str, torch.Tensor], layout: PagedLayout) -> torch.Tensor:
    conv_out = causal_conv_varlen(
        inputs["mixed"], inputs["weight"], inputs["conv_state"], layout.query_start, layout.state_slots
    )
    return gated_delta_rule_paged(*_split(conv_out), inputs["g"], inputs["beta"], inputs["state"], layout)


def test_paged_rule_matches_the_fp32_recurrent_reference() -> None:
    layout = _paged(PAGED_LENGTHS, PAGED_PASTS, PAGED_SLOTS)
    inputs = _inputs(sum(PAGED_LENGTHS), seed=3)
    before = _copy(inputs)
    out = _run_paged(inputs, layout)
    conv_out = causal_conv_varlen(
        before["mixed"],
        before["weight"],
        before["conv_state"].clone(),
        layout.query_start,
        layout.state_slots,
    )
    bounds = layout.query_start.tolist()
    for seq, slot in enumerate(PAGED_SLOTS):
        rows = slice(bounds[seq], bounds[seq + 1])
        expected, expected_state = _recurrent_reference(conv_out[rows], before, rows, slot)
        torch.testing.assert_close(out[rows], expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(inputs["state"][slot], expected_state, rtol=2e-3, atol=2e-3)


def test_paged_sequences_are_bit_identical_alone_or_batched() -> None:
    layout = _paged(PAGED_LENGTHS, PAGED_PASTS, PAGED_SLOTS)
    inputs = _inputs(sum(PAGED_LENGTHS), seed=4)
    batched = _copy(inputs)
    out = _run_paged(batched, layout)
    bounds = layout.query_start.tolist()
    for seq in (1, 3, 4):
        rows = slice(bounds[seq], bounds[seq + 1])
        slot = PAGED_SLOTS[seq]
        alone = _copy(inputs)
        for name in ("mixed", "g", "beta"):
            alone[name] = inputs[name][rows].clone()
        alone_out = _run_paged(alone, _paged([PAGED_LENGTHS[seq]], [PAGED_PASTS[seq]], [slot]))
        assert torch.equal(alone_out, out[rows])
        assert torch.equal(alone["state"][slot], batched["state"][slot])


def test_a_prompt_cut_at_chunk_multiples_is_bit_identical_to_one_piece() -> None:
    inputs = _inputs(1000, seed=5)
    whole = _copy(inputs)
    expected = _run_paged(whole, _paged([1000], [0], [3]))
    pieces = []
    for rows in (slice(0, 128), slice(128, 192), slice(192, 960), slice(960, 1000)):
        piece = _copy(inputs)
        piece["conv_state"], piece["state"] = inputs["conv_state"], inputs["state"]
        for name in ("mixed", "g", "beta"):
            piece[name] = inputs[name][rows].clone()
        pieces.append(_run_paged(piece, _paged([rows.stop - rows.start], [rows.start], [3])))
    assert torch.equal(torch.cat(pieces), expected)
    assert torch.equal(inputs["state"][3], whole["state"][3])
