"""The demo model's training tool, for a few seconds on the CPU: it writes a directory the loader opens."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.kernels.reference import REFERENCE, experts_reference
from app.loading.loader import load_model
from app.models.batch import ForwardBatch
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
    record = tool.train(
        tmp_path,
        minutes=0.1,
        device="cpu",
        size_name="smoke",
        limit_bytes=200_000,
        curve_every=2,
        finish_seconds=2,
        min_steps=2,  # a busy machine may not fit two steps in the time
    )
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["steps"] == record["steps"] >= 2
    assert len(saved["curve"]) == saved["steps"] // 2
    assert saved["data"]["sources"][0]["source"] == "Python standard library"
    assert "Python Software Foundation" in saved["data"]["sources"][0]["license"]
    assert saved["data"]["conversations"]["train"] > 0
    assert all(math.isfinite(point["loss"]) and math.isfinite(point["mtp_loss"]) for point in saved["curve"])
    assert all(math.isfinite(point["balance"]) and point["balance"] > 0 for point in saved["curve"])
    held = saved["held_out"]
    assert 0 <= held["mtp_first_draft_acceptance"] <= 1 and math.isfinite(held["loss"])
    skew = held["routing_skew"]
    assert [s["layer"] for s in skew] == list(range(tool.SIZES["smoke"]["layers"]))
    assert all(0.1 <= s["top_10pct"] <= s["top_25pct"] <= 1 for s in skew)
    model, _ = load_model(tmp_path, dtype="float32", progress=False)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert model.mtp is not None and model.config.num_experts == tool.SIZES["smoke"]["experts"]
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert sum(p.numel() for p in model.parameters()) == saved["parameters"]
    assert torch.isfinite(next(model.parameters())).all()
    # The saved (bf16) weights measured again from the directory give what the run recorded for them.
    again = tool.measure_saved(tmp_path, "cpu", 200_000)
    recorded = saved["held_out_saved_weights"]
    assert again["mtp_first_draft_acceptance"] == recorded["mtp_first_draft_acceptance"]
    assert again["loss"] == pytest.approx(recorded["loss"], abs=1e-5)
    assert again["routing_skew"] == recorded["routing_skew"]
    assert json.loads((tmp_path / "training.json").read_text())["held_out_saved_weights"] == again | {
        "sequences": recorded["sequences"]
    }


def test_the_demo_size_fits_the_gpu_kernels_and_40_mb() -> None:
    tool = _tool()
    config = tool.model_config(tool.SIZES["demo"])
    for key in ("head_dim", "linear_key_head_dim", "linear_value_head_dim"):
        assert config[key] & (config[key] - 1) == 0  # the Triton kernels take powers of two
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(config), mtp_layers=1, backends=REFERENCE)
    assert 16 <= config["num_experts"] <= 64 and config["shared_expert_intermediate_size"] > 0
    assert 2 * sum(p.numel() for p in model.parameters()) < 40e6  # bytes in bf16


@pytest.mark.parametrize("grad", [False, True])
def test_the_batched_training_path_equals_the_reference_read_sequence_by_sequence(grad: bool) -> None:
    tool = _tool()
    config = ModelConfig.from_dict(tool.model_config(tool.SIZES["smoke"]))
    reference = CausalLM(config, mtp_layers=1, backends=REFERENCE).double()
    tool.randomize(reference, 3)
    training = CausalLM(config, mtp_layers=1, backends=tool.TRAINING).double()
    training.load_state_dict(reference.state_dict())
    sequences = torch.randint(0, config.vocab_size, (3, 150), generator=torch.Generator().manual_seed(1))
    inputs, following = sequences[:, :-1], sequences[:, 1:].flatten()

    class Contiguous:  # the per-sequence state of the reference path
        def __init__(self) -> None:
            self.kv: dict = {}
            self.linear: dict = {}

        def extend_kv(self, layer, span, k, v):
            self.kv[(layer, span.seq)] = (k, v)
            return k, v

        def linear_state(self, layer, seq):
            return self.linear.get((layer, seq), (None, None))

        def set_linear_state(self, layer, seq, conv, recurrent):
            self.linear[(layer, seq)] = (conv, recurrent)

    batch = ForwardBatch.build([(i, row.tolist(), 0) for i, row in enumerate(inputs)], Contiguous())
    hidden = reference(batch)
    expected = (reference.logits(hidden), reference.logits(reference.mtp_forward(hidden, following, batch)))
    with torch.set_grad_enabled(grad):
        training_batch = tool.training_batch(inputs)
        hidden = training(training_batch)
        got = (
            training.logits(hidden),
            training.logits(training.mtp_forward(hidden, following, training_batch)),
        )
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4)  # the delta rule runs in fp32
    if grad:  # the gradients of the next-token and MTP losses agree too
        for logits, mtp_logits in (expected, got):
            mtp_logits = mtp_logits.view(3, 149, -1)[:, :-1].flatten(0, 1)
            loss = F.cross_entropy(logits, following) + F.cross_entropy(
                mtp_logits, sequences[:, 2:].flatten()
            )
            loss.backward()
        for (name, a), b in zip(training.named_parameters(), reference.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None, name
            assert (a.grad - b.grad).abs().max() <= 1e-3 * b.grad.abs().max() + 1e-6, name  # fp32 delta rule
        next_loss, mtp_loss, balance = tool.losses(training, sequences)
        (next_loss + mtp_loss + balance).backward()
        assert all(torch.isfinite(p.grad).all() for p in training.parameters())


def test_the_balance_loss_is_one_when_routing_is_uniform_and_experts_when_one_takes_all() -> None:
    tool = _tool()
    uniform = torch.zeros(64, 8)
    uniform[torch.arange(64), torch.arange(64) % 8] = 1e-3  # each expert first for 8 of the tokens
    collapsed = torch.zeros(64, 8)
    collapsed[:, 0] = 50.0
    assert tool.router_balance([uniform], top_k=1).item() == pytest.approx(1.0, abs=1e-3)
    assert tool.router_balance([collapsed], top_k=1).item() == pytest.approx(8.0, abs=1e-3)


def test_dense_experts_equal_the_reference_loop_over_experts() -> None:
    tool = _tool()
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, dtype=torch.float64, generator=generator)
    gate_up = torch.randn(6, 2 * 8, 16, dtype=torch.float64, generator=generator)
    down = torch.randn(6, 16, 8, dtype=torch.float64, generator=generator)
    weights, ids = torch.randn(40, 6, dtype=torch.float64, generator=generator).softmax(-1).topk(2, dim=-1)
    expected = experts_reference(x, ids, weights, gate_up, down)
    torch.testing.assert_close(tool.all_experts(x, ids, weights, gate_up, down), expected)


def test_the_corpus_reads_the_standard_library_then_installed_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool = _tool()
    stdlib = Path(tool.sysconfig.get_paths()["stdlib"])
    # the standard library's asyncio package for the whole of it (parsing every module takes 15 s)
    monkeypatch.setattr(tool.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib / "asyncio")})
    texts = tool.corpus(1 << 40, packages=("msgspec", "no-such-package-here"))
    sources = {s["source"]: s for s in texts.sources}
    assert list(sources) == ["Python standard library", "msgspec"]
    assert sources["msgspec"]["license"] == "BSD-3-Clause" and sources["msgspec"]["version"]
    assert sum(s["files"] for s in texts.sources) == len(texts.train) + len(texts.held_out)
    assert len(texts.held_out) == -(-len(texts.train + texts.held_out) // tool.HELD_OUT_EVERY)
    assert any("class Struct" in text for text in texts.train + texts.held_out)
    assert len(texts.train_chats) > 200 and all(c.startswith("<|im_start|>user\n") for c in texts.train_chats)


def test_documented_functions_become_conversations_in_the_chat_layout() -> None:
    tool = _tool()
    source = '''
class Box:
    def area(self, scale: int = 1) -> int:
        """Return the area of the box, scaled."""
        return self.w * self.h * scale


def plain(x):
    return x


def short(x):
    """Too short."""
    return x
'''
    chats = tool.conversations(source, every=1)
    assert chats == [
        "<|im_start|>user\nReturn the area of the box, scaled.<|im_end|>\n<|im_start|>assistant\n"
        "Here is `area`:\n\n```python\n"
        'def area(self, scale: int = 1) -> int:\n    """Return the area of the box, scaled."""\n'
        "    return self.w * self.h * scale\n```"
    ]
    assert tool.conversations("def broken(:\n") == []
