"""Weights held as GGUF blocks of every held type on the GPU: the grouped matmul's programs dequantize
them at Qwen3-30B-A3B's shapes in bf16 as the reference does on their values, a row's bits do not depend on
its batch, and a GGUF file's model (a Q4_K_M one's down projections Q6_K) gives the tokens of the HF
directory holding the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_wide_checkpoint
from engine_helpers import complete, make_core
from gguf_files import same_values_copy, write_gguf

from app.kernels.gguf_quants import dequantize, random_blocks, to_held
from app.kernels.interface import HELD_BLOCKS
from app.kernels.reference import experts_reference
from app.kernels.triton_linear import few_rows_linear
from app.kernels.triton_moe import exact_fused_experts, exact_linear, fused_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def _held(kind: str, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = random_blocks(kind, shape, seed, device="cuda")
    return to_held(kind, blocks), dequantize(kind, blocks, shape)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    torch.testing.assert_close(got.float() / scale, expected / scale, atol=1e-2, rtol=0)


@pytest.mark.parametrize("kind", list(HELD_BLOCKS))
@pytest.mark.parametrize("tokens", [1, 8, 32, 200])  # one of each range of tiles (`moe_tiles`)
def test_held_experts_at_full_shape_match_the_reference(kind: str, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, device="cuda", generator=g).bfloat16()
    gate_up, gate_up_values = _held(kind, (EXPERTS, 2 * INTER, HIDDEN), 1)
    down, down_values = _held(kind, (EXPERTS, HIDDEN, INTER), 2)
    expected = experts_reference(x.float(), ids, weights.float(), gate_up_values, down_values)
    _close(fused_experts(x, ids, weights, gate_up, down), expected)
    exact = exact_fused_experts(x, ids, weights, gate_up, down)
    assert torch.equal(exact[-1:], exact_fused_experts(x[-1:], ids[-1:], weights[-1:], gate_up, down))


@pytest.mark.parametrize("kind", list(HELD_BLOCKS))
@pytest.mark.parametrize("shape", [(4096, HIDDEN), (HIDDEN, 4096), (151936, HIDDEN)])
def test_held_projections_at_full_shape_match_the_reference(kind: str, shape: tuple[int, int]) -> None:
    weight, values = _held(kind, shape, 3)
    for rows in (1, 300):
        x = torch.randn(rows, shape[1], device="cuda").bfloat16()
        expected = x.float() @ values.T
        _close(few_rows_linear(x, weight), expected)
        _close(exact_linear(x, weight), expected)
    assert torch.equal(exact_linear(x, weight)[-1:], exact_linear(x[-1:], weight))


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_wide_checkpoint(tmp_path_factory.mktemp("wide"))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "Q4_K_M", "Q5_K", "IQ4_XS", "IQ3_XXS", "IQ3_S"])
def test_a_quantized_file_on_the_gpu_gives_the_tokens_of_its_values(
    wide_dir: Path, tmp_path: Path, quant: str
) -> None:
    path = write_gguf(wide_dir, tmp_path / f"wide-{quant}.gguf", quant)
    prompt = [5, 17, 99, 230, 31, 8, 400, 12]
    core = make_core(path, device="cuda", dtype="float32")
    assert core.loaded.model.model.layers[0].mlp.experts.gate_up.dtype == torch.uint8
    assert core.runner.graphs is not None
    got = complete(core, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    same = make_core(same_values_copy(wide_dir, tmp_path / "same", quant), device="cuda", dtype="float32")
    assert got.token_ids == complete(same, prompt, max_tokens=12, temperature=0, ignore_eos=True).token_ids


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "IQ3_S", "Q4_K_M"])
@pytest.mark.parametrize("pcie_frac", [None, 1.0])
def test_an_expert_tier_over_a_quantized_file_on_the_gpu_gives_the_tokens_of_the_whole_model(
    wide_dir: Path, tmp_path: Path, quant: str, pcie_frac: float | None
) -> None:
    """Two experts a layer on the card as the file's blocks, the others' blocks in pinned host RAM: misses
    computed by the CPU pool from them (as measured) or all copied over PCIe into staging slots, decode
    windows replayed piecewise, the tier adapting every window: the greedy tokens of the whole model. A Q4_K_M
    file's tier holds its Q6_K downs beside Q4_K gates and ups, each as its blocks."""
    path = write_gguf(wide_dir, tmp_path / f"wide-{quant}.gguf", quant)
    prompt = [5, 17, 99, 230, 31, 8, 400, 12]
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    settings = {"device": "cuda", "dtype": "float32"}
    whole = complete(make_core(path, **settings), prompt, **params).token_ids
    core = make_core(path, expert_cache=2, adapt_every=1, pcie_frac=pcie_frac, **settings)
    tier = core.tiers[0]
    assert tier.gate_up is not None and tier.gate_up.dtype == tier.host_gate_up.dtype == torch.uint8
    assert tier.down is not None and tier.down.dtype == tier.host_down.dtype == torch.uint8
    assert tier.host_gate_up.is_pinned() and core.runner.graphs is not None
    assert complete(core, prompt, **params).token_ids == whole
