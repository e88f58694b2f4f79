"""Structured output on the GPU: masks copied from pinned memory beside replayed windows keep the outputs
inside their grammars, and the free requests beside them draw what they draw alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import make_core, random_prompt, request, run

from app.engine.protocol import Grammar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_constrained_and_free_requests_share_replayed_windows(tmp_path: Path, arch: str) -> None:
    checkpoint = write_checkpoint(tmp_path, arch, max_position_embeddings=4096)
    core = make_core(checkpoint, device="cuda", parallel=8)
    assert core.runner.graphs is not None
    free = [
        request(random_prompt(10 + i, i), max_tokens=16, temperature=0, ignore_eos=True) for i in range(3)
    ]
    alone, _ = run(core, [(0, add) for add in free])
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    again = [request(list(a.prompt_token_ids), max_tokens=16, temperature=0, ignore_eos=True) for a in free]
    constrained = [
        request(random_prompt(7, 10 + i), max_tokens=40, temperature=1.0, seed=i, grammar=grammar)
        for i in range(5)
    ]
    together, _ = run(core, [(0, add) for add in again + constrained])
    for first, second in zip(free, again, strict=True):
        assert together[second.request_id].token_ids == alone[first.request_id].token_ids
    finished = [together[c.request_id] for c in constrained if together[c.request_id].finish_reason == "stop"]
    assert finished
    for result in finished:
        value = json.loads(result.text)
        assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
