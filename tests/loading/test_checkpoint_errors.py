"""Bad checkpoints fail with one line that names what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from app.errors import StrataError
from app.loading.loader import load_model


def _edit_config(path: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _no_moe_gate(t: dict) -> None:
    del t["model.layers.1.mlp.gate.weight"]


def _extra_tensor(t: dict) -> None:
    t["model.layers.1.mlp.surprise.weight"] = torch.zeros(2)


def _wrong_shape(t: dict) -> None:
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)


def _missing_expert(t: dict) -> None:
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]


def _llama(c: dict) -> None:
    c.update(model_type="llama", architectures=["LlamaForCausalLM"])


def _no_hidden(c: dict) -> None:
    del c["hidden_size"]


def _dynamic_rope(c: dict) -> None:
    c["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}


def _corrupt_file(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\xff" * 16)


def _config_not_json(path: Path) -> None:
    (path / "config.json").write_text("{not json")


def _no_weights(path: Path) -> None:
    (path / "model.safetensors").unlink()


CASES: list[tuple[str, Callable[[Path], None], str]] = [
    (
        "missing tensor",
        lambda p: _edit_tensors(p, _no_moe_gate),
        "missing tensor model.layers.1.mlp.gate.weight",
    ),
    (
        "missing expert",
        lambda p: _edit_tensors(p, _missing_expert),
        "model.layers.2.mlp.experts.5.up_proj.weight",
    ),
    (
        "unexpected tensor",
        lambda p: _edit_tensors(p, _extra_tensor),
        "unexpected tensor model.layers.1.mlp.surprise",
    ),
    (
        "wrong shape",
        lambda p: _edit_tensors(p, _wrong_shape),
        "wrong shape for model.layers.0.self_attn.k_proj",
    ),
    (
        "unsupported architecture",
        lambda p: _edit_config(p, _llama),
        "unsupported architecture LlamaForCausalLM",
    ),
    ("missing config field", lambda p: _edit_config(p, _no_hidden), "config.json has no hidden_size"),
    ("unsupported rope", lambda p: _edit_config(p, _dynamic_rope), "unsupported rope_type 'dynamic'"),
    ("corrupt safetensors", _corrupt_file, "cannot read safetensors file"),
    ("config not json", _config_not_json, "config.json is not valid JSON"),
    ("no weights", _no_weights, "has neither model.safetensors nor model.safetensors.index.json"),
    ("no config", lambda p: (p / "config.json").unlink(), "has no config.json"),
]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", "qwen3_moe")


@pytest.mark.parametrize(("name", "damage", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_gives_one_line_error(
    checkpoint: Path, name: str, damage: Callable, message: str
) -> None:
    damage(checkpoint)
    with pytest.raises(StrataError) as error:
        load_model(checkpoint, progress=False)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", "qwen3_moe", shard_size="60KB")
    shard = sorted(path.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        StrataError, match=f"shard {shard.name} listed in model.safetensors.index.json is missing"
    ):
        load_model(path, progress=False)


def test_wrong_mtp_shape_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", "qwen3_next", mtp_layers=1)
    tensors = load_file(str(path / "model-mtp.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(path / "model-mtp.safetensors"))
    with pytest.raises(
        StrataError, match=r"wrong shape for mtp\.fc\.weight .* has \[64, 64\], model expects \[64, 128\]"
    ):
        load_model(path, progress=False)


def test_cli_reports_a_bad_checkpoint_in_one_line(checkpoint: Path) -> None:
    _edit_tensors(checkpoint, _no_moe_gate)
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(checkpoint), "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("strata: error: missing tensor model.layers.1.mlp.gate.weight")
