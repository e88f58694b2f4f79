"""The shipped demo model: loaded by the normal HF-directory path, under 40 MB, its card true to its run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import app.default_model as default_model
from app.errors import StrataError
from app.loading.loader import load_model
from app.text.tokenizer import Tokenizer

DEMO = default_model.DEMO_MODEL_DIR
CARD = Path(__file__).resolve().parents[1] / "docs" / "DEMO_MODEL.md"


def _record() -> dict:
    return json.loads((DEMO / "training.json").read_text())


def test_the_demo_model_loads_through_the_hf_directory_path_and_fits_40_mb() -> None:
    assert default_model.default_model_dir() == DEMO
    model, checkpoint = load_model(DEMO, dtype="auto", progress=False)
    assert checkpoint.config.dtype == "bfloat16"  # stored in bf16, computed in fp32 on a CPU (`--dtype auto`)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.mtp is not None and model.config.model_type == "qwen3_next"
    assert 16 <= model.config.num_experts <= 64 and model.config.shared_expert_intermediate_size
    assert sum(p.numel() for p in model.parameters()) == _record()["parameters"]
    assert sum(f.stat().st_size for f in DEMO.iterdir() if f.name != "training.json") < 40e6
    tokenizer = Tokenizer.from_dir(DEMO)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template is not None


def test_a_missing_demo_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default_model, "DEMO_MODEL_DIR", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StrataError, match=r"incomplete \(model\.safetensors, tokenizer\.json"):
        default_model.default_model_dir()


def test_the_card_states_the_recorded_measurements() -> None:
    card, record = CARD.read_text(), _record()
    held = record["held_out_saved_weights"]  # the shipped bf16 weights
    assert f"**MTP first-draft acceptance: {100 * held['mtp_first_draft_acceptance']:.1f}%.**" in card
    assert f"{held['loss']:.2f} nats per token for the next token and {held['mtp_loss']:.2f}" in card
    for layer in held["routing_skew"]:
        row = f"| {layer['layer']} | {100 * layer['top_10pct']:.1f}% | {100 * layer['top_25pct']:.1f}% |"
        assert row in card, row
    for source in record["data"]["sources"]:
        assert f"| {source['source']} | {source['version']} | " in card
        assert re.search(rf"\| {re.escape(source['source'])} \|.*\| {source['files']:,} \|", card), source
    assert f"{record['parameters']:,} parameters" in card
    assert f"| steps | {record['steps']:,} in " in card
    assert "python tools/train_demo.py app/strata-demo --minutes 8\n" in card
