"""Drafts on the GPU: windows that verify guesses (n-gram or the MTP head, whose pass reads hidden states
kept by replayed windows) give the tokens of decoding one token a window, with the kernels' tiles fixed."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_core, request, run
from tokenizers import Tokenizer

from app.default_model import default_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TEXTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
    "for i in range(10):",
]


SPLIT = {"layer_split": "2", "stage_gpus": (0, 0), "batch_groups": 2}  # both stages on one card


@pytest.mark.parametrize("split", [False, True], ids=["one stage", "split in two"])
@pytest.mark.parametrize("spec", ["ngram", "mtp"])
def test_drafting_windows_on_the_gpu_give_the_tokens_of_one_token_a_window(spec: str, split: bool) -> None:
    """On one card, or split in two (every stage replaying its window graphs, two groups in flight)."""
    demo = default_model_dir()
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in TEXTS]

    def answers(**config: object) -> tuple[list[list[int]], list]:
        core = make_core(demo, device="cuda", dtype="bfloat16", parallel=4, exact=True, **config)
        try:
            assert core.runner.graphs is not None
            arrivals = [
                (i, request(p, max_tokens=48, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)
            ]
            results, windows = run(core, arrivals)
        finally:
            core.close()
        return [results[a.request_id].token_ids for _, a in arrivals], windows

    plain, _ = answers()
    drafted, windows = answers(spec=spec, spec_tokens=3, **(SPLIT if split else {}))
    assert drafted == plain
    assert sum(n for w in windows for _, _, n in w.drafts) > 0
    assert any(w.replayed and w.drafts for w in windows)
