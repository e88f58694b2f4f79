"""The MTP head's forward: the token after next from the main model's hidden states, with its own KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from contiguous_state import ContiguousState

from app.loading.loader import load_model
from app.models.batch import ForwardBatch
from app.models.qwen3 import CausalLM


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = write_checkpoint(tmp_path_factory.mktemp("mtp"), "qwen3_next", mtp_layers=1)
    loaded = load_model(path, dtype="float32", progress=False)[0]
    assert loaded.mtp is not None
    return loaded


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _mtp_logits(model: CausalLM, pieces: list[list[tuple[int, list[int], int]]], nexts: list[list[int]]):
    """Main forward, then the MTP head, window by window on one state; the MTP logits of every row."""
    state = ContiguousState()
    out = []
    with torch.no_grad():
        for chunks, next_ids in zip(pieces, nexts, strict=True):
            batch = ForwardBatch.build(chunks, state)
            hidden = model(batch)
            mtp = model.mtp_forward(hidden, torch.tensor(next_ids), batch)
            out.append(model.logits(mtp))
    return torch.cat(out)


def test_reading_a_sequence_in_pieces_gives_the_logits_of_one_piece(model: CausalLM) -> None:
    """The head's layer extends its own keys and values: two pieces continue where one would."""
    tokens = _tokens(81, 1)
    inputs, nexts = tokens[:-1], tokens[1:]
    whole = _mtp_logits(model, [[(0, inputs, 0)]], [nexts])
    pieces = _mtp_logits(model, [[(0, inputs[:50], 0)], [(0, inputs[50:], 50)]], [nexts[:50], nexts[50:]])
    assert whole.shape == (80, model.config.vocab_size)
    torch.testing.assert_close(pieces, whole, rtol=1e-4, atol=1e-4)


def test_sequences_batched_equal_each_alone(model: CausalLM) -> None:
    a, b = _tokens(40, 2), _tokens(23, 3)
    batched = _mtp_logits(model, [[(0, a[:-1], 0), (1, b[:-1], 0)]], [a[1:] + b[1:]])
    alone_a = _mtp_logits(model, [[(0, a[:-1], 0)]], [a[1:]])
    alone_b = _mtp_logits(model, [[(1, b[:-1], 0)]], [b[1:]])
    torch.testing.assert_close(batched, torch.cat((alone_a, alone_b)), rtol=1e-4, atol=1e-4)


def test_the_next_token_changes_the_prediction_and_a_model_without_head_refuses(
    model: CausalLM, tmp_path: Path
) -> None:
    tokens = _tokens(20, 4)
    one = _mtp_logits(model, [[(0, tokens, 0)]], [[*tokens[1:], 5]])
    other = _mtp_logits(model, [[(0, tokens, 0)]], [[*tokens[1:], 6]])
    torch.testing.assert_close(one[:-1], other[:-1], rtol=1e-5, atol=1e-5)  # causal: only the last row moves
    assert (one[-1] - other[-1]).abs().max() > 1e-3
    plain = load_model(write_checkpoint(tmp_path, "qwen3_next"), dtype="float32", progress=False)[0]
    batch = ForwardBatch.build([(0, tokens, 0)], ContiguousState())
    with pytest.raises(ValueError, match="no MTP head"):
        plain.mtp_forward(plain(batch), torch.tensor(tokens), batch)
