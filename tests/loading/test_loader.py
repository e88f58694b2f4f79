"""Loading: memory-mapped tensors, dtype at load, the MTP head, a stage's part, eos ids, the progress bar."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from app.default_model import DEMO_MODEL_DIR
from app.kernels.backends import select_backends
from app.loading.checkpoint import CheckpointDir
from app.loading.loader import load_model, resolve_dtype
from app.loading.progress import Progress
from app.models.qwen3 import Absent, ModelPart


def test_weights_that_need_no_conversion_stay_mapped_from_the_file(tmp_path: Path) -> None:
    model, _ = load_model(write_checkpoint(tmp_path, "qwen3_moe"), dtype="float32", progress=False)
    layer = model.model.layers[0]
    o, router = layer.self_attn.o_proj.weight, layer.mlp.gate.weight
    # Two tensors of one file live in one storage: the mapping of that file, not two copies.
    assert o.untyped_storage().data_ptr() == router.untyped_storage().data_ptr()
    assert o.data_ptr() != router.data_ptr()
    assert not model.model.embed_tokens.weight.requires_grad


def test_dtype_is_chosen_at_load(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_next")
    model, _ = load_model(path, dtype="bfloat16", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    auto, _ = load_model(path, dtype="auto", progress=False)
    assert {p.dtype for p in auto.parameters()} == {torch.float32}


def test_auto_widens_16_bit_weights_to_fp32_on_a_cpu_where_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model is stored in bf16: a GPU keeps it, a CPU computes it in fp32 (faster there), unless
    fp32 weights would take more than their share of the host's RAM."""
    demo = CheckpointDir(DEMO_MODEL_DIR)
    assert demo.config.dtype == "bfloat16"
    assert resolve_dtype("auto", demo, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", demo, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", demo, "cpu") == torch.bfloat16
    monkeypatch.setattr("app.loading.loader.CPU_FP32_RAM_SHARE", 0.0)
    assert resolve_dtype("auto", demo, "cpu") == torch.bfloat16


def test_the_cpu_set_keeps_a_bf16_checkpoints_matrices_in_bf16() -> None:
    """Computed in fp32 on a CPU, the demo model's routed experts and projections stay bf16 for the CPU set's
    kernels (the same values, half the bytes to read); embeddings, norms and the conv widen, and other sets
    widen everything."""
    cpu, _ = load_model(DEMO_MODEL_DIR, progress=False, backends=select_backends("cpu", "cpu"))
    narrow = {name for name, p in cpu.named_parameters() if p.dtype == torch.bfloat16}
    layer = "model.layers.0"
    assert {
        f"{layer}.mlp.experts.gate_up",
        f"{layer}.linear_attn.in_proj_qkvz.weight",
        "lm_head.weight",
    } <= narrow
    assert "model.layers.3.self_attn.qkv_weight" in narrow
    wide = {
        "model.embed_tokens.weight",
        f"{layer}.input_layernorm.weight",
        f"{layer}.linear_attn.conv1d.weight",
    }
    assert not wide & narrow
    reference, _ = load_model(DEMO_MODEL_DIR, progress=False)
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    for name in narrow:
        assert torch.equal(cpu.get_parameter(name).float(), reference.get_parameter(name))


def test_mtp_tensors_load_into_the_mtp_head(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_next", mtp_layers=1)
    model, checkpoint = load_model(path, dtype="float32", progress=False)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    expected = checkpoint.tensor("mtp.layers.0.mlp.experts.3.up_proj.weight")
    torch.testing.assert_close(model.mtp.layers[0].mlp.experts.gate_up[3, 32:], expected)
    torch.testing.assert_close(model.mtp.fc.weight, checkpoint.tensor("mtp.fc.weight"))


def test_checkpoint_without_mtp_has_no_head(tmp_path: Path) -> None:
    model, _ = load_model(write_checkpoint(tmp_path, "qwen3_next"), progress=False)
    assert model.mtp is None


def test_a_stage_of_a_layer_split_loads_only_its_part(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_next", mtp_layers=1)
    whole, _ = load_model(path, dtype="float32", progress=False)
    middle, _ = load_model(path, dtype="float32", progress=False, part=ModelPart(range(1, 3), False, False))
    held = dict(middle.named_parameters())
    assert held and all(name.startswith(("model.layers.1.", "model.layers.2.")) for name in held)
    for name, tensor in held.items():
        assert torch.equal(tensor, dict(whole.named_parameters())[name])
    assert isinstance(middle.model.embed_tokens, Absent) and middle.mtp is None
    first, _ = load_model(path, dtype="float32", progress=False, part=ModelPart(range(0, 1), True, False))
    assert first.mtp is not None and isinstance(first.model.norm, Absent)
    last, _ = load_model(path, dtype="float32", progress=False, part=ModelPart(range(3, 4), False, True))
    assert {name.split(".")[1] for name, _ in last.named_parameters()} == {"layers", "norm"}


def test_eos_ids_come_from_generation_config_then_config(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_moe", eos_token_id=[7, 9])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert CheckpointDir(path).eos_token_ids() == (2, 7, 9)


def test_progress_bar_draws_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    bar = Progress(4, "loading", width=8)
    for _ in range(4):
        bar.advance()
    bar.close()
    assert screen.getvalue().endswith("\rloading 100% [########] 4/4\n")


def test_progress_bar_is_silent_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress(2, "loading")
    bar.advance(2)
    bar.close()
    assert capsys.readouterr().err == ""
