"""The tiny random model's writer (the long-context CPU benchmark's model): a checkpoint the loader opens."""

from __future__ import annotations

from pathlib import Path

from app.loading.loader import load_model
from app.random_model import CONFIG, write_random_model
from app.text.tokenizer import Tokenizer


def test_the_random_model_is_a_loadable_hf_directory(tmp_path: Path) -> None:
    path = tmp_path / "random"
    write_random_model(path)
    model, checkpoint = load_model(path, dtype="auto", progress=False)
    assert checkpoint.config.dtype == "bfloat16" and model.mtp is not None
    assert model.config.num_experts == CONFIG["num_experts"]
    assert Tokenizer.from_dir(path).vocab_size == CONFIG["vocab_size"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left
