"""The demo model's training tool, for a few seconds on the CPU: it writes a directory the loader opens."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from app.loading.loader import load_model
from app.models.config import ModelConfig
from app.models.qwen3 import CausalLM
from app.text.tokenizer import Tokenizer

TOOL = Path(__file__).resolve().parents[1] / "tools" / "train_demo.py"


def _tool():
    spec = importlib.util.spec_from_file_location("train_demo", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = module
    spec.loader.exec_module(module)
    return module


def test_a_short_run_writes_a_loadable_model_and_its_record(tmp_path: Path) -> None:
    tool = _tool()
    record = tool.train(tmp_path, minutes=0.05, device="cpu", size_name="smoke", limit_bytes=200_000)
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["steps"] == record["steps"] >= 1 and len(saved["curve"]) == saved["steps"]
    assert "Python Software Foundation" in saved["license"]
    assert all(math.isfinite(point["loss"]) and math.isfinite(point["mtp_loss"]) for point in saved["curve"])
    held = saved["held_out"]
    assert 0 <= held["mtp_first_draft_acceptance"] <= 1
    skew = held["routing_skew"]
    assert [s["layer"] for s in skew] == list(range(tool.SIZES["smoke"]["layers"]))
    assert all(0.1 <= s["top_10pct"] <= s["top_25pct"] <= 1 for s in skew)
    model, _ = load_model(tmp_path, dtype="float32", progress=False)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert model.mtp is not None and model.config.num_experts == tool.SIZES["smoke"]["experts"]
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert sum(p.numel() for p in model.parameters()) == saved["parameters"]
    assert torch.isfinite(next(model.parameters())).all()


def test_the_demo_size_fits_the_gpu_kernels_and_40_mb() -> None:
    tool = _tool()
    config = tool.model_config(tool.SIZES["demo"])
    for key in ("head_dim", "linear_key_head_dim", "linear_value_head_dim"):
        assert config[key] & (config[key] - 1) == 0  # the Triton kernels take powers of two
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(config), mtp_layers=1)
    assert 16 <= config["num_experts"] <= 64 and config["shared_expert_intermediate_size"] > 0
    assert 2 * sum(p.numel() for p in model.parameters()) < 40e6  # bytes in bf16
