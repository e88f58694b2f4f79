"""The model on a CUDA device: the logits and greedy tokens of transformers on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, write_checkpoint
from contiguous_state import ContiguousState
from engine_helpers import complete, make_core

from app.loading.loader import load_model
from app.models.batch import ForwardBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    batch = ForwardBatch.build([(0, ids.tolist(), 0)], ContiguousState(), device="cuda")
    return model.logits(model(batch)).cpu()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_cuda_matches_transformers_on_cpu(tmp_path: Path, arch: str) -> None:
    path = write_checkpoint(tmp_path, arch)
    reference = hf_model(arch)
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]

    fp32, _ = load_model(path, dtype="float32", device="cuda", progress=False)
    got = _logits(fp32, ids)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-3

    prompt = ids[:20]
    with torch.no_grad():
        hf_tokens = reference.generate(
            prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 20:].tolist()
    core = make_core(path, device="cuda")
    assert (
        complete(core, prompt.tolist(), max_tokens=32, temperature=0, ignore_eos=True).token_ids == hf_tokens
    )

    bf16, _ = load_model(path, dtype="bfloat16", device="cuda", progress=False)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        reference_bf16 = reference.to(torch.bfloat16)(ids[None]).logits[0].float()
    # bf16 rounding alone moves a random tiny model's logits a lot; ours may drift no more than transformers'.
    assert _mean_error(_logits(bf16, ids), expected) < 1.5 * _mean_error(reference_bf16, expected)


def _mean_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().mean() / expected.abs().mean())
