"""Keys and values in 8 bits on a CUDA device: the fused store writes the rows `kv_quant.quantize` gives at
the models' head shapes, attention over them matches the torch path over their values in bf16, and an
engine with 8-bit KV (replayed window graphs) gives a conversation the same tokens alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from engine_helpers import complete, make_core, random_prompt, request, run

from app.kernels import kv_quant
from app.kernels.cpu_sequence import paged_attention_reference
from app.kernels.triton_attention import paged_attention, write_kv
from app.kernels.triton_norm import qk_norm_rope, qk_norm_rope_store
from app.models.batch import PagedLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KINDS = [torch.int8, torch.float8_e4m3fn]
HEAD_SHAPES = [(16, 4, 128, 128), (16, 2, 256, 64)]  # heads, kv heads, head_dim, rotary: q30's, Qwen3-Next's


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary"), HEAD_SHAPES)
def test_the_fused_store_writes_the_rows_quantize_gives(
    kind: torch.dtype, heads: int, kv_heads: int, head_dim: int, rotary: int
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = 300
    q, k, v = (
        torch.randn(tokens, h, head_dim, generator=gen, device="cuda").bfloat16()
        for h in (heads, kv_heads, kv_heads)
    )
    cos = torch.randn(tokens, rotary, generator=gen, device="cuda").bfloat16()
    sin = torch.randn(tokens, rotary, generator=gen, device="cuda").bfloat16()
    weight = (torch.rand(head_dim, generator=gen, device="cuda") + 0.5).bfloat16()
    norms = (weight, weight, 1e-6, False)
    shape = (tokens // 16 + 1, 16, kv_heads, kv_quant.row_width(head_dim, kind))
    keys = torch.zeros(shape, dtype=kind, device="cuda")
    values = torch.zeros(shape, dtype=kind, device="cuda")
    slots = torch.randperm(shape[0] * 16, generator=gen, device="cuda")[:tokens]
    qk_norm_rope_store(q, k, v, *norms, cos, sin, keys, values, slots)
    _, expected_k = qk_norm_rope(q, k, *norms, cos, sin)
    flat = keys.view(-1, kv_heads, shape[-1]).view(torch.uint8)
    assert torch.equal(flat[slots], kv_quant.quantize(expected_k, kind).view(torch.uint8))
    flat = values.view(-1, kv_heads, shape[-1]).view(torch.uint8)
    assert torch.equal(flat[slots], kv_quant.quantize(v, kind).view(torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary"), HEAD_SHAPES)
def test_attention_over_8_bit_caches_matches_the_torch_path(
    kind: torch.dtype, heads: int, kv_heads: int, head_dim: int, rotary: int
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    spans = [(700, 1), (0, 300), (1500, 1), (64, 40)]  # (past, new rows): decode rows and prompt chunks
    blocks = sum(-(-(p + n) // 16) for p, n in spans)
    shape = (blocks, 16, kv_heads, kv_quant.row_width(head_dim, kind))
    keys = torch.zeros(shape, dtype=kind, device="cuda")
    values = torch.zeros(shape, dtype=kind, device="cuda")
    order = torch.randperm(blocks, device="cuda", generator=gen)
    width = max(-(-(p + n) // 16) for p, n in spans)
    table = torch.zeros(len(spans), width, dtype=torch.int32, device="cuda")
    used, starts, lens = 0, [0], []
    for i, (past, new) in enumerate(spans):
        need = -(-(past + new) // 16)
        table[i, :need] = order[used : used + need].int()
        used += need
        positions = torch.arange(past + new, device="cuda")
        flat = table[i, positions // 16].long() * 16 + positions % 16
        k, v = (
            torch.randn(past + new, kv_heads, head_dim, generator=gen, device="cuda").bfloat16() for _ in "kv"
        )
        write_kv(keys, values, k, v, flat)
        starts.append(starts[-1] + new)
        lens.append(past + new)
    layout = PagedLayout(
        query_start=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_table=table,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long, device="cuda"),
        state_slots=torch.arange(len(spans), device="cuda"),
        max_query_len=max(n for _, n in spans),
    )
    q = torch.randn(starts[-1], heads, head_dim, generator=gen, device="cuda").bfloat16()
    scale = head_dim**-0.5
    got = paged_attention(q, keys, values, layout, scale)
    expected = paged_attention_reference(q.float(), keys, values, layout, scale)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("moe"), "qwen3_moe", hidden_size=256, head_dim=64, num_hidden_layers=2
    )


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_engine_with_8_bit_kv_gives_a_conversation_its_tokens_alone_and_batched(
    moe_dir: Path, kv: str
) -> None:
    core = make_core(moe_dir, device="cuda", dtype="bfloat16", kv_dtype=kv, parallel=4)
    assert core.runner.graphs is not None and core.runner.state.keys.dtype == kv_quant.KV_DTYPES[kv]
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    arrivals = [(i, request(random_prompt(30 + 40 * i, i), **greedy)) for i in range(4)]
    together, _ = run(core, arrivals)
    for _, add in arrivals:
        assert together[add.request_id].token_ids == complete(core, add.prompt_token_ids, **greedy).token_ids
