"""One forward over a flat batch of several sequences equals each sequence run alone, chunked or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from contiguous_state import ContiguousState

from app.loading.loader import load_model
from app.models.batch import ForwardBatch, SequenceSpan
from app.models.qwen3 import CausalLM


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _last_logits(
    model: CausalLM, chunks: list[tuple[int, list[int], int]], state: ContiguousState
) -> torch.Tensor:
    batch = ForwardBatch.build(chunks, state)
    return model.logits(model(batch)[batch.last_rows()])


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(path, dtype="float32", progress=False)[0]


def test_prompt_chunks_and_decode_rows_share_one_forward(model: CausalLM) -> None:
    prompts = {0: _tokens(90, 1), 1: _tokens(7, 2), 2: _tokens(130, 3)}
    solo = {}
    for seq, tokens in prompts.items():
        state = ContiguousState()
        first = _last_logits(model, [(seq, tokens[:-1], 0)], state)
        assert first.shape == (1, model.config.vocab_size)
        solo[seq] = _last_logits(model, [(seq, tokens[-1:], len(tokens) - 1)], state)[0]

    shared = ContiguousState()
    # Window 1: the start of sequence 0's prompt and all but the last token of sequence 1.
    _last_logits(model, [(0, prompts[0][:40], 0), (1, prompts[1][:-1], 0)], shared)
    # Window 2: the rest of 0's prompt, a decode row of 1, and the first chunk of 2.
    _last_logits(
        model, [(0, prompts[0][40:-1], 40), (1, prompts[1][-1:], 6), (2, prompts[2][:70], 0)], shared
    )
    # Window 3: decode rows of 0 and of 2 after the rest of its prompt.
    last = _last_logits(model, [(0, prompts[0][-1:], 89), (2, prompts[2][70:], 70)], shared)
    torch.testing.assert_close(last[0], solo[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last[1], solo[2], rtol=1e-4, atol=1e-4)


def test_a_window_of_decode_rows_runs_the_delta_rule_for_all_at_once_as_for_each_alone(
    tmp_path: Path,
) -> None:
    """A Gated DeltaNet layer given decode rows only (one per sequence) runs conv and delta-rule step for all
    the sequences at once: the same outputs and states, bit for bit, as sequence by sequence."""
    model = load_model(write_checkpoint(tmp_path, "qwen3_next"), dtype="float32", progress=False)[0]
    layer = next(d.linear_attn for d in model.model.layers if d.linear_attn is not None)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(12))
    spans = [(seq, [0], 5 + seq) for seq in range(3)]
    results = []
    for per_sequence in (True, False):
        state = ContiguousState()
        for seq in range(1, 3):  # sequence 0 starts without a state
            seeded = torch.Generator().manual_seed(seq)
            conv = torch.randn(layer.conv1d.weight.shape[0], 3, generator=seeded)
            rule = torch.randn(layer.v_heads, layer.dk, layer.dv, generator=seeded)
            state.set_linear_state(layer.layer, seq, conv, rule)
        batch = ForwardBatch.build(spans, state)
        mixed, _, b, a = layer._split(x)
        beta = b.float().sigmoid()
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias.float())
        weight = layer.conv1d.weight[:, 0, :]
        run = layer._per_sequence if per_sequence else layer._decode_rows
        out = run(mixed, weight, g, beta, batch)
        results.append((out, [state.linear_state(layer.layer, seq) for seq in range(3)]))
    (alone, alone_states), (together, together_states) = results
    assert torch.equal(alone, together)
    for (conv, rule), (batched_conv, batched_rule) in zip(alone_states, together_states, strict=True):
        assert torch.equal(conv, batched_conv) and torch.equal(rule, batched_rule)


def test_dropped_sequence_keeps_no_state(model: CausalLM) -> None:
    state = ContiguousState()
    _last_logits(model, [(5, _tokens(10, 4), 0)], state)
    attention_layer = model.config.layer_types.index("full_attention")
    state.drop(5)
    span = SequenceSpan(seq=5, start=0, length=1, past=10)
    with pytest.raises(ValueError, match="no state"):
        state.extend_kv(attention_layer, span, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    assert state.linear_state(0, 5) == (None, None)
