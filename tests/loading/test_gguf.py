"""GGUF model files: llama.cpp's names and metadata, F32 and Q8_0 tensors, the tokenizer rebuilt from the
file, and the same greedy tokens as the HF directory holding the same values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from checkpoints import write_checkpoint, write_wide_checkpoint
from engine_helpers import complete, make_core
from gguf_files import MIXES, same_values_copy, write_gguf
from serving import start_server, stop_server
from websockets.sync.client import connect

from app.errors import StrataError
from app.kernels.gguf_quants import DEQUANTIZE, dequantize, dequantize_held, from_held, to_held
from app.kernels.interface import held_kind
from app.loading.checkpoint import open_checkpoint
from app.loading.gguf_file import GGUFCheckpoint
from app.loading.loader import experts_within
from app.models.expert_tier import TieredExperts
from app.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("hf"), "qwen3_moe")


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next checkpoint with an MTP layer."""
    return write_checkpoint(tmp_path_factory.mktemp("next"), "qwen3_next", mtp_layers=1)


# Where each type keeps its float16 scale(s): set to finite values (random bytes there could be inf or NaN)
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # the others: one scale, at byte 0


@pytest.mark.parametrize("kind", list(DEQUANTIZE))
def test_each_quant_type_dequantizes_as_the_gguf_package_does(kind: str) -> None:
    """Random blocks (random bytes, finite scales) give the values of the gguf package's own dequantizer, as
    the file lays them out and as kernels hold them (Q8_0's reordered, the same bytes)."""
    per_block, size, _ = DEQUANTIZE[kind]
    quant = getattr(gguf.GGMLQuantizationType, kind)
    assert gguf.GGML_QUANT_SIZES[quant] == (per_block, size)
    rng = np.random.default_rng(len(kind))
    raw = rng.integers(0, 256, (6, 3 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in SCALES.get(kind, (0,)):
        blocks[:, at : at + 2] = rng.standard_normal((len(blocks), 1)).astype(np.float16).view(np.uint8)
    expected = gguf.quants.dequantize(raw, quant)
    got = dequantize(kind, torch.from_numpy(raw.copy()), expected.shape)
    assert torch.equal(got, torch.from_numpy(expected))
    held = to_held(kind, torch.from_numpy(raw.copy()))
    assert held.shape == raw.shape and torch.equal(from_held(kind, held), torch.from_numpy(raw))
    assert torch.equal(dequantize_held(kind, held, expected.shape), got)
    if kind == "Q8_0":  # a row's codes, then its blocks' scales
        rows = torch.from_numpy(raw).reshape(6, 3, size)
        assert torch.equal(held[:, : 3 * 32], rows[:, :, 2:].flatten(1))
        assert torch.equal(held[:, 3 * 32 :], rows[:, :, :2].flatten(1))


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_gguf_file_gives_the_greedy_tokens_of_its_hf_directory(
    hf_dir: Path, tmp_path: Path, quant: str
) -> None:
    path = write_gguf(hf_dir, tmp_path / f"tiny-{quant}.gguf", quant)
    same_values = hf_dir if quant == "F32" else same_values_copy(hf_dir, tmp_path / "dequantized", quant)
    prompt = [5, 17, 99, 230, 31, 8, 400, 12]
    from_gguf = complete(make_core(path), prompt, max_tokens=12, temperature=0, ignore_eos=True)
    from_hf = complete(make_core(same_values), prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert from_gguf.token_ids == from_hf.token_ids


def test_a_q8_0_files_experts_stay_its_q8_0_blocks_on_the_cpu(next_dir: Path, tmp_path: Path) -> None:
    """On the CPU set the routed experts are held as the file's own Q8_0 bytes (read in place by the native
    kernels), not widened: a quarter of the fp32 bytes; everything else, and any HF directory, as before."""
    path = write_gguf(next_dir, tmp_path / "next-Q8_0.gguf", "Q8_0")
    model = make_core(path).loaded.model
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up.dtype == torch.uint8 and experts.gate_up.shape == (8, 64, 64 // 32 * 34)
    file = GGUFCheckpoint(path)
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(experts.down[5], file.held_blocks(name)[1])
    assert model.mtp.layers[0].mlp.experts.down.dtype == torch.uint8
    assert model.model.layers[0].linear_attn.in_proj_qkvz.weight.dtype == torch.float32
    assert make_core(next_dir).loaded.model.model.layers[0].mlp.experts.gate_up.dtype == torch.float32


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer qwen3_moe whose matrices' rows are whole Q4_K super-blocks (256 values)."""
    return write_wide_checkpoint(tmp_path_factory.mktemp("wide"))


def test_the_gpu_kernels_read_a_files_blocks_where_they_lie(wide_dir: Path, tmp_path: Path) -> None:
    """On the Triton set (its interpreter here) the routed experts and every projection through its linear
    kernel keep the file's blocks, dequantized inside the matmul's programs: the greedy tokens of the HF
    directory holding the values the file's blocks stand for (Q8_0's tiles: tests/kernels/test_triton_held.py,
    the engine on the GPU: tests/gpu/test_held_gpu.py). A Q4_K_M file: Q4_K blocks, the experts' down
    projections Q6_K, each read as its own type."""
    quant = "Q4_K_M"
    path = write_gguf(wide_dir, tmp_path / f"wide-{quant}.gguf", quant)
    core = make_core(path, backend="triton")
    model = core.loaded.model
    layer = model.model.layers[0]
    held = (layer.mlp.experts.gate_up, layer.mlp.experts.down, layer.mlp.gate.weight)
    held += (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, model.lm_head.weight)
    assert all(p.dtype == torch.uint8 for p in held)
    experts, config = layer.mlp.experts, model.config
    assert held_kind(experts.gate_up, config.hidden_size) == "Q4_K"
    assert held_kind(experts.down, config.moe_intermediate_size) == "Q6_K"
    assert model.model.embed_tokens.weight.dtype == torch.float32
    prompt = [5, 17, 99, 230, 31, 8, 400, 12, 77]
    # two tokens: the prompt's window (nine rows: 16-row tiles) and a decode window (a lone row summed on the
    # CUDA cores)
    got = complete(core, prompt, max_tokens=2, temperature=0, ignore_eos=True)
    same = make_core(same_values_copy(wide_dir, tmp_path / "same", quant))
    assert got.token_ids == complete(same, prompt, max_tokens=2, temperature=0, ignore_eos=True).token_ids


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "Q4_K_M"])
def test_a_quantized_files_experts_stay_its_blocks_on_the_cpu(
    wide_dir: Path, tmp_path: Path, quant: str
) -> None:
    """On the CPU set a quantized file's routed experts are read in place by the native kernels (the dense
    projections widened): the greedy tokens of the HF directory holding the file's values. A Q4_K_M file's
    experts keep both types: Q4_K gates and ups, Q6_K down projections."""
    path = write_gguf(wide_dir, tmp_path / f"wide-{quant}.gguf", quant)
    core = make_core(path)
    layer, config = core.loaded.model.model.layers[0], core.loaded.model.config
    gate_kind, down_kind = MIXES.get(quant, (quant, quant))
    assert layer.mlp.experts.gate_up.dtype == layer.mlp.experts.down.dtype == torch.uint8
    assert held_kind(layer.mlp.experts.gate_up, config.hidden_size) == gate_kind
    assert held_kind(layer.mlp.experts.down, config.moe_intermediate_size) == down_kind
    assert layer.self_attn.qkv_weight.dtype == torch.float32
    prompt = [5, 17, 99, 230, 31, 8]
    got = complete(core, prompt, max_tokens=8, temperature=0, ignore_eos=True)
    same = make_core(same_values_copy(wide_dir, tmp_path / "same", quant))
    assert got.token_ids == complete(same, prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids


def test_a_split_gguf_loads_from_any_of_its_files(hf_dir: Path, tmp_path: Path) -> None:
    first = write_gguf(hf_dir, tmp_path / "tiny.gguf", split=10)
    shards = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(shards) > 2 and first == shards[0]
    prompt = [5, 17, 99, 230, 31]
    whole = complete(make_core(hf_dir), prompt, max_tokens=8, temperature=0, ignore_eos=True)
    core = make_core(shards[1])
    assert core.loaded.name == "tiny"
    assert complete(core, prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids == whole.token_ids
    shards[-1].unlink()
    with pytest.raises(StrataError, match=f"is one of {len(shards)} files; {shards[-1].name} is missing"):
        GGUFCheckpoint(first)


def test_the_file_maps_onto_the_hf_names_and_config(hf_dir: Path, tmp_path: Path) -> None:
    checkpoint = open_checkpoint(write_gguf(hf_dir, tmp_path / "tiny.gguf"))
    assert isinstance(checkpoint, GGUFCheckpoint)
    hf = open_checkpoint(hf_dir)
    assert sorted(checkpoint.names()) == sorted(hf.names())
    config, expected = checkpoint.config, hf.config
    sizes = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "head_dim")
    for field in (*sizes, "vocab_size", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(expected, field)
    assert config.rope.theta == expected.rope.theta and config.dtype == "float32"
    assert GGUFCheckpoint(write_gguf(hf_dir, tmp_path / "q8.gguf", "Q8_0")).config.dtype == "bfloat16"
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert checkpoint.shape(name) == hf.shape(name)
    assert torch.equal(checkpoint.tensor(name), hf.tensor(name).float())


def test_the_tokenizer_and_chat_template_come_from_the_file(hf_dir: Path, tmp_path: Path) -> None:
    from_file = Tokenizer.load(write_gguf(hf_dir, tmp_path / "tiny.gguf"))
    expected = Tokenizer.load(hf_dir)
    text = "The cat and the dog,\n  and 42 birds: <|im_start|>user hi<|im_end|>"
    assert from_file.encode(text) == expected.encode(text)
    ids = expected.encode(text)
    assert from_file.decode(ids, skip_special_tokens=False) == expected.decode(ids, skip_special_tokens=False)
    assert from_file.eos_token == expected.eos_token and from_file.eos_token_id == expected.eos_token_id
    messages = [{"role": "user", "content": "hello there"}]
    assert from_file.encode_chat(messages) == expected.encode_chat(messages)


def _tiny_gguf(path: Path, arch: str, kind: gguf.GGMLQuantizationType) -> Path:
    """A GGUF of `arch` with one tensor of quant type `kind` (zero bytes) and no other metadata."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_or_quant_type_is_a_one_line_error(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(StrataError, match="unsupported GGUF architecture 'llama'") as error:
        GGUFCheckpoint(_tiny_gguf(tmp_path / "llama.gguf", "llama", gguf.GGMLQuantizationType.Q8_0))
    assert "\n" not in str(error.value)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf")
    assert GGUFCheckpoint(path).config.model_type == "qwen3_moe"
    q2 = _tiny_gguf(tmp_path / "q2.gguf", "qwen3moe", gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(StrataError, match="unsupported quant type Q2_K of token_embd.weight"):
        GGUFCheckpoint(q2)


def test_a_qwen3next_file_maps_onto_the_hf_names_config_and_values(next_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's layout undone: every HF tensor (the MTP head's too) comes back from the file with the
    values a GGUF of it holds, the config with the HF directory's fields."""
    checkpoint = GGUFCheckpoint(write_gguf(next_dir, tmp_path / "next.gguf"))
    hf = open_checkpoint(next_dir)
    same = open_checkpoint(same_values_copy(next_dir, tmp_path / "same"))
    assert sorted(checkpoint.names()) == sorted(hf.names())
    assert any(name.startswith("mtp.layers.0.") for name in checkpoint.names())
    for name in checkpoint.names():
        assert checkpoint.shape(name) == hf.shape(name), name
        assert torch.equal(checkpoint.tensor(name), same.tensor(name)), name
    config, expected = checkpoint.config, hf.config
    fields = (
        "num_hidden_layers",
        "layer_types",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "shared_expert_intermediate_size",
        "rotary_dim",
    )
    for field in fields:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.mtp_layers == 1 and config.model_type == "qwen3_next"


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_qwen3next_file_gives_the_greedy_tokens_of_the_same_values(
    next_dir: Path, tmp_path: Path, quant: str
) -> None:
    path = write_gguf(next_dir, tmp_path / f"next-{quant}.gguf", quant)
    prompt = [5, 17, 99, 230, 31, 8, 400, 12]
    from_gguf = complete(make_core(path), prompt, max_tokens=12, temperature=0, ignore_eos=True)
    same = same_values_copy(next_dir, tmp_path / "same", quant)
    from_hf = complete(make_core(same), prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert from_gguf.token_ids == from_hf.token_ids


def test_an_older_qwen3next_file_with_the_whole_qkvz_loads_the_same(next_dir: Path, tmp_path: Path) -> None:
    split = GGUFCheckpoint(write_gguf(next_dir, tmp_path / "split.gguf"))
    whole = GGUFCheckpoint(write_gguf(next_dir, tmp_path / "whole.gguf", whole_qkvz=True))
    assert "blk.0.ssm_in.weight" in whole._tensors and "blk.0.ssm_in.weight" not in split._tensors
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert torch.equal(whole.tensor(name), split.tensor(name))


def test_strata_serves_a_gguf_file_over_http(next_dir: Path, tmp_path: Path) -> None:
    """`strata serve --model tiny-Q8_0.gguf` (qwen3next): named by the file, chat rendered with the file's
    own template, greedy answers those of the HF directory holding the same values; `/metrics` and the
    Monitor's feed report it."""
    path = write_gguf(next_dir, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    body = {
        "messages": [{"role": "user", "content": "the cat and the dog"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    answers = []
    for model in (path, same_values_copy(next_dir, tmp_path / "same", "Q8_0")):
        server = start_server(model)
        try:
            models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            if model == path:
                scrape = httpx.get(f"{server.url}/metrics?format=prometheus", timeout=30).text
                counted = r'vllm:generation_tokens_total\{[^}]*model_name="tiny-Q8_0"[^}]*\} 8\.0'
                assert re.search(counted, scrape)
                assert httpx.get(f"{server.url}/monitor", timeout=30).status_code == 200
                socket_url = server.url.replace("http://", "ws://") + "/ws/monitor"
                with connect(socket_url, origin=server.url, open_timeout=30) as socket:
                    frame = json.loads(socket.recv(timeout=30))
                assert frame["type"] == "frame" and frame["engine"]["model"] == "tiny-Q8_0"
                assert frame["experts"]["layers"] == [0, 1, 2, 3]  # the residency grid of its MoE layers
        finally:
            stop_server(server)
        answers.append((models[0]["id"], reply["choices"][0]["message"]["content"], reply["usage"]))
    (gguf_id, gguf_text, gguf_usage), (_, hf_text, hf_usage) = answers
    assert gguf_id == "tiny-Q8_0"
    assert gguf_text == hf_text and gguf_usage == hf_usage


def test_an_expert_tier_over_a_q4_k_m_file_holds_both_types_of_blocks(wide_dir: Path, tmp_path: Path) -> None:
    """A tier over a Q4_K_M file's experts keeps each projection's blocks (Q4_K gates and ups, Q6_K downs) on
    the device and in host RAM: the greedy tokens of the whole model; and `--expert-vram` counts those blocks
    (a tier's misses of two types through staging and the CPU pool: tests/models/test_expert_tier.py)."""
    path = write_gguf(wide_dir, tmp_path / "wide-Q4_K_M.gguf", "Q4_K_M")
    prompt = [5, 17, 99, 230, 31, 8, 400, 12] * 2
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = complete(make_core(path), prompt, **params).token_ids
    core = make_core(path, expert_cache=2, adapt_every=0)
    tier, config = core.loaded.model.model.layers[0].mlp.experts, core.loaded.model.config
    assert isinstance(tier, TieredExperts) and tier.gate_up is not None and tier.down is not None
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    assert held_kind(tier.gate_up, hidden) == held_kind(tier.host_gate_up, hidden) == "Q4_K"
    assert held_kind(tier.down, inter) == held_kind(tier.host_down, inter) == "Q6_K"
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(tier.host_down[tier.host_of[5]], GGUFCheckpoint(path).held_blocks(name)[1])
    assert complete(core, prompt, **params).token_ids == whole
    expert = 2 * inter * hidden // 256 * 144 + hidden * inter // 256 * 210
    assert experts_within(path, "auto", 3 * expert, "cpu", backends=core.backends) == 3


@pytest.mark.parametrize("adapt_every", [0, 2])
def test_an_expert_tier_over_a_files_blocks_holds_them_on_the_device_and_in_host_ram(
    next_dir: Path, tmp_path: Path, adapt_every: int
) -> None:
    """A tier over a Q8_0 file's experts keeps the file's blocks where each expert lives (the CPU pool reads
    the host's in place), frozen or following the routing: the greedy tokens of the whole model; and
    `--expert-vram` counts an expert's blocks, not its widened bytes."""
    path = write_gguf(next_dir, tmp_path / "next-Q8_0.gguf", "Q8_0")
    prompt = [5, 17, 99, 230, 31, 8, 400, 12] * 3
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = complete(make_core(path), prompt, **params).token_ids
    core = make_core(path, expert_cache=2, adapt_every=adapt_every)
    tier = core.loaded.model.model.layers[0].mlp.experts
    assert isinstance(tier, TieredExperts)
    assert tier.gate_up is not None and tier.gate_up.dtype == tier.host_down.dtype == torch.uint8
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(tier.host_down[tier.host_of[5]], GGUFCheckpoint(path).held_blocks(name)[1])
    assert complete(core, prompt, **params).token_ids == whole
    if adapt_every:
        # a host expert moved onto the device (in a layer whose routing beats the counts' noise)
        assert any(t.slots[e] >= 0 for t in core.tiers for e in range(2, 8))
    config = core.loaded.model.config
    blocks = 3 * config.hidden_size * config.moe_intermediate_size // 32 * 34
    layers = sum(config.moe_layers) + 1  # the MTP layer's too
    assert experts_within(path, "auto", 3 * layers * blocks, "cpu", backends=core.backends) == 3
