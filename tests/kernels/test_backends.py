"""The backend interface: selection, errors, and that the model calls what it is given."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import write_checkpoint
from contiguous_state import ContiguousState
from spies import recorded

from app.errors import StrataError
from app.kernels import triton_launch
from app.kernels.backends import select_backends
from app.kernels.cpu_experts import dense, routed_experts
from app.kernels.cpu_sequence import delta_rule_paged, paged_attention
from app.kernels.reference import REFERENCE
from app.loading.loader import load_model
from app.models.batch import ForwardBatch


def test_auto_picks_the_cpu_set_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU set is the reference with the native kernels (the reference where they are not built),
    whole-batch sequence mixers included; the pure reference stays available by name."""
    cpu = select_backends("auto", "cpu")
    assert cpu.name == "cpu" and cpu.experts is routed_experts
    assert cpu.linear is dense and cpu.rms_norm is not None and cpu.gated_rms_norm is not None
    assert cpu.paged_attention is paged_attention and cpu.delta_rule_varlen is delta_rule_paged
    native = {"linear", "route", "rms_norm", "add_rms_norm", "gated_rms_norm", "qk_norm_rope"}
    native |= {"paged_attention", "conv_varlen", "delta_rule_varlen", "moe_block", "gdn_decode"}
    native |= {"attention_decode"}
    pure = dataclasses.replace(
        cpu,
        name="torch",
        experts=REFERENCE.experts,
        bf16_weights=False,
        held_blocks=frozenset(),
        held_apart=False,
        **dict.fromkeys(native),
    )
    assert pure == REFERENCE
    assert select_backends("torch", "cpu") is REFERENCE
    monkeypatch.setattr("app.kernels.cpu_experts._native", None)
    assert select_backends("auto", "cpu") is REFERENCE
    with pytest.raises(StrataError, match="backend 'cpu' does not run on cuda"):
        select_backends("cpu", "cuda")


def test_triton_runs_on_the_cpu_only_in_its_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton runs on CPU tensors only in its interpreter, which the tests switch on.
    assert select_backends("triton", "cpu").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(StrataError, match="backend 'triton' does not run on cpu"):
        select_backends("triton", "cpu")


def test_exact_backends_name_themselves() -> None:
    assert select_backends("triton", "cpu", exact=True).name == "triton+exact"
    assert select_backends("torch", "cpu", exact=True).exact
    exact_cpu = select_backends("cpu", "cpu", exact=True)
    assert exact_cpu.name == "cpu+exact" and exact_cpu.linear is None and exact_cpu.experts is routed_experts
    assert exact_cpu.moe_block is None and exact_cpu.gdn_decode is None and exact_cpu.attention_decode is None


def test_unknown_backend_is_a_one_line_error() -> None:
    message = "unknown backend 'cutlass'; choose one of auto, triton, torch, cpu"
    with pytest.raises(StrataError, match=message):
        select_backends("cutlass", "cpu")


def test_the_model_calls_the_backends_it_was_built_with(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3_next")
    calls: list[str] = []

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return recorded(calls, name, fn)

    traced = dataclasses.replace(
        REFERENCE,
        name="traced",
        attention=spy("attention", REFERENCE.attention),
        delta_rule_prompt=spy("prompt", REFERENCE.delta_rule_prompt),
        delta_rule_step=spy("step", REFERENCE.delta_rule_step),
        experts=spy("experts", REFERENCE.experts),
    )
    model, _ = load_model(path, dtype="float32", progress=False, backends=traced)
    reference, _ = load_model(path, dtype="float32", progress=False)
    ids = list(range(3, 40))
    got = model(ForwardBatch.build([(0, ids, 0), (1, [5], 0)], ContiguousState()))
    expected = reference(ForwardBatch.build([(0, ids, 0), (1, [5], 0)], ContiguousState()))
    torch.testing.assert_close(got, expected)
    assert {"attention", "prompt", "step", "experts"} <= set(calls)


def test_the_model_imports_only_the_backend_interface() -> None:
    """app/models reaches the kernels through app/kernels/interface.py alone; the kernels import nothing of
    the model but the batch's layout (app/models/batch.py): no import circle between the two."""
    root = Path(__file__).resolve().parents[2] / "app"

    def imports(package: str) -> set[str]:
        found = set()
        for path in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app."):
                    found.add(node.module)
        return found

    assert {m for m in imports("models") if m.startswith("app.kernels")} == {"app.kernels.interface"}
    assert {m for m in imports("kernels") if m.startswith("app.models")} == {"app.models.batch"}


def test_kernels_launch_dependently_on_cuda_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter (CPU tensors) never asks for programmatic dependent launch, nor does STRATA_PDL=0."""
    assert triton_launch.pdl(torch.device("cpu"), (1,)) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("STRATA_PDL", "0")
    triton_launch._dependent_programs.cache_clear()
    try:
        assert triton_launch.pdl(torch.device("cuda", 0), (1,)) == {"PDL": False, "launch_pdl": False}
    finally:
        triton_launch._dependent_programs.cache_clear()


def test_grids_beyond_a_few_waves_launch_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_launch, "_dependent_programs", lambda device: 100)
    assert triton_launch.pdl(torch.device("cuda", 0), (10, 10))["launch_pdl"]
    assert not triton_launch.pdl(torch.device("cuda", 0), (101,))["launch_pdl"]
