"""The settings autoconfig picks for described machines (docs/AUTOCONFIG.md's table), the model facts it
reads, and `strata autoconfig` on this machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint, write_wide_checkpoint
from gguf_files import write_gguf

from app.autoconfig import (
    GIB,
    KV_HOST_SHARE,
    MIN_SLOTS,
    Card,
    Machine,
    ModelFacts,
    card_kv_bytes,
    choose,
    facts_of,
    facts_of_model,
    kv_bytes,
    nvlink_joined,
    pcie_links,
    usable,
)
from app.cli import build_parser, main
from app.errors import StrataError
from app.kernels.backends import cpu_backends, triton_backends
from app.kernels.interface import held_row_bytes
from app.kernels.reference import REFERENCE
from app.models.config import ModelConfig
from app.models.qwen3 import CausalLM
from benchmarks.shapes import shape

# (cards' GiB, RAM GiB) -> the flags chosen for Qwen3-30B-A3B and Qwen3-Next-80B-A3B in bf16 (None: refused)
MACHINES: dict[tuple[tuple[int, ...], int], tuple[str | None, str | None]] = {
    ((11,), 64): (None, None),
    ((11, 11), 128): ("--parallel 4 --layer-split 2 --batch-groups 2 --expert-cache 10 --adapt-async", None),
    ((16,) * 4, 256): (
        "--parallel 4 --layer-split 4 --batch-groups 4 --expert-cache 68 --adapt-async --kv-resident 32768",
        "--parallel 4 --layer-split 4 --batch-groups 4 --expert-cache 103 --adapt-async",
    ),
    ((24,), 128): ("--parallel 4 --expert-cache 26 --adapt-async --kv-resident 32768", None),
    ((24, 24), 256): (
        "--parallel 4 --layer-split 2 --batch-groups 2 --expert-cache 63 --adapt-async",
        "--parallel 4 --layer-split 2 --batch-groups 2 --expert-cache 93 --adapt-async --kv-resident 32768",
    ),
    ((141,), 128): ("--parallel 32", "--parallel 4 --expert-cache 426 --adapt-async --kv-resident 32768"),
    ((80,) * 8, 1024): ("--parallel 20", "--parallel 32 --layer-split 3 --batch-groups 3"),
}


@pytest.fixture(scope="module")
def models() -> tuple[ModelFacts, ModelFacts]:
    facts = []
    for name in ("q30", "qnext"):
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_dict(shape(name)), backends=REFERENCE)
        facts.append(facts_of_model(model, torch.bfloat16))
    return facts[0], facts[1]


def _without_kv(flags: list[str]) -> str:
    """The flags but --kv-memory (checked apart: it follows the memory arithmetic to the byte)."""
    at = flags.index("--kv-memory")
    return " ".join(flags[:at] + flags[at + 2 :])


@pytest.mark.parametrize(("cards", "ram"), list(MACHINES))
def test_each_described_machine_gets_the_documented_settings(
    models: tuple[ModelFacts, ModelFacts], cards: tuple[int, ...], ram: int
) -> None:
    machine = Machine(tuple(Card(size * GIB) for size in cards), ram * GIB, 16)
    for facts, expected in zip(models, MACHINES[(cards, ram)], strict=True):
        if expected is None:
            with pytest.raises(StrataError, match="do not fit this machine"):
                choose(machine, facts)
            continue
        settings = choose(machine, facts)
        assert _without_kv(settings.flags()) == expected
        assert settings.parallel >= MIN_SLOTS and settings.reasons
        # what every stage then holds fits the memory the engine plans with on its card
        stages = int(settings.layer_split or 1)
        resident = facts.experts if settings.expert_cache is None else settings.expert_cache
        share = (facts.dense_bytes + resident * facts.moe_layers * facts.expert_bytes) / stages
        assert share + card_kv_bytes(facts, settings) <= usable(machine.cards[0])
        assert settings.kv_memory >= kv_bytes(facts, settings.parallel, 8192)
        build_parser().parse_args(["serve", *settings.flags()])  # flags `strata serve` takes


def test_a_kv_pool_beyond_the_card_keeps_every_slots_minimum_there_and_fits_the_rams_share(
    models: tuple[ModelFacts, ModelFacts],
) -> None:
    """Rule 6: where the card's KV memory cannot take one conversation to the model's context, the pool grows
    into host RAM; the card keeps every slot's 8192 tokens, the resident tokens and the staging areas fit what
    it had for KV, and the host part fits KV_HOST_SHARE of the RAM."""
    q30 = models[0]
    machine = Machine((Card(24 * GIB),), 128 * GIB, 16)
    settings = choose(machine, q30)
    assert settings.kv_resident is not None and settings.kv_resident >= settings.parallel * 8192
    pool = (settings.kv_memory - settings.parallel * q30.slot_state_bytes) // q30.kv_token_bytes
    assert pool > 2 * settings.kv_resident and "(--kv-resident)" in settings.reasons[-1]
    assert (pool - settings.kv_resident) * q30.kv_token_bytes <= 128 * GIB * KV_HOST_SHARE
    without = replace(q30, attention_layers=0)  # unknown: the pool stays on the card
    alone = choose(machine, without)
    assert alone.kv_resident is None and card_kv_bytes(q30, settings) <= alone.kv_memory
    build_parser().parse_args(["serve", *settings.flags()])


def test_a_cpu_machine_runs_the_model_in_host_ram_with_slots_by_its_cores(
    models: tuple[ModelFacts, ModelFacts],
) -> None:
    q30 = models[0]
    settings = choose(Machine((), 256 * GIB, 16), q30)
    assert settings.parallel == 32 and settings.layer_split is None and settings.expert_cache is None
    assert "CPU" in settings.reasons[0]
    assert choose(Machine((), 256 * GIB, 2), q30).parallel == MIN_SLOTS
    with pytest.raises(StrataError, match="no room"):
        choose(Machine((), 32 * GIB, 16), q30)


def test_the_facts_are_the_models_own_parameter_counts(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", "qwen3_next")
    facts = facts_of(path, "float32")
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = CausalLM(config, backends=REFERENCE)
    total = sum(p.numel() for p in model.parameters()) * 4
    assert facts.weight_bytes == total
    assert facts.expert_bytes == 3 * config.hidden_size * config.moe_intermediate_size * 4
    assert facts.moe_layers == sum(config.moe_layers) and facts.slot_state_bytes > 0
    attention = sum(t == "full_attention" for t in config.layer_types)
    assert facts.kv_token_bytes == 2 * attention * config.num_key_value_heads * config.head_dim * 4


def test_a_gguf_files_facts_count_the_blocks_its_backends_hold(tmp_path: Path) -> None:
    """A quantized file's weights count at the file's bytes where the set that runs it holds them (the
    Triton set: experts and projections; the CPU set: experts), not widened to the dtype; a Q4_K_M file's
    experts (Q6_K downs) count as both types' blocks, under a tier too."""
    hf = write_wide_checkpoint(tmp_path / "wide")
    config = ModelConfig.from_dict(json.loads((hf / "config.json").read_text()))
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    widened = facts_of(hf, "bfloat16")
    q4_k = write_gguf(hf, tmp_path / "q4_k.gguf", "Q4_K")
    on_card = facts_of(q4_k, "bfloat16", triton_backends())
    assert on_card.expert_bytes == on_card.tier_expert_bytes == 3 * held_row_bytes("Q4_K", hidden) * inter
    assert on_card.dense_bytes < widened.dense_bytes / 2 and on_card.ends_bytes < widened.ends_bytes
    on_cpu = facts_of(q4_k, "float32", cpu_backends())
    assert on_cpu.expert_bytes == on_card.expert_bytes
    assert on_cpu.dense_bytes == facts_of(hf, "float32").dense_bytes
    mix = facts_of(write_gguf(hf, tmp_path / "m.gguf", "Q4_K_M"), "bfloat16", triton_backends())
    mixed = 2 * inter * held_row_bytes("Q4_K", hidden) + hidden * held_row_bytes("Q6_K", inter)
    assert mix.expert_bytes == mix.tier_expert_bytes == mixed < widened.expert_bytes / 3


def test_a_tier_counts_its_experts_bytes_as_the_tier_holds_them(
    models: tuple[ModelFacts, ModelFacts],
) -> None:
    q30 = models[0]
    machine = Machine((Card(24 * GIB),), 128 * GIB, 16)
    widened_in_tier = replace(q30, tier_expert_bytes=2 * q30.expert_bytes)
    resident = choose(machine, widened_in_tier).expert_cache
    assert resident is not None and resident < choose(machine, q30).expert_cache  # type: ignore[operator]
    assert resident == choose(machine, replace(q30, expert_bytes=2 * q30.expert_bytes)).expert_cache


def test_strata_autoconfig_prints_the_reasons_and_a_serve_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_checkpoint(tmp_path / "m", "qwen3_moe")
    assert main(["autoconfig", "--model", str(path), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("machine: ") and all(line.startswith("- ") for line in out[1:-1])
    command = out[-1].split()
    assert command[:4] == ["strata", "serve", "--model", str(path)]
    build_parser().parse_args(command[1:])


SMI_LINKS = "pcie.link.gen.max, pcie.link.width.max\n5, 16\n4, 8\n[N/A], [N/A]\n"
TOPOLOGY = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \t{link}\t0-15\t0\n"
    "GPU1\t{link}\t X \t0-15\t0\n\nLegend:\n  X    = Self\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def test_the_cards_links_are_read_from_nvidia_smi() -> None:
    assert pcie_links(SMI_LINKS) == [(5, 16), (4, 8), (None, None)]
    assert pcie_links("") == []
    assert nvlink_joined(TOPOLOGY.format(link="NV18")) is True
    assert nvlink_joined(TOPOLOGY.format(link="PHB")) is False
    assert nvlink_joined("GPU0\t X \t0-15\t0\n") is None  # one card: nothing to join


def test_the_links_are_described_and_give_their_reasons(models: tuple[ModelFacts, ModelFacts]) -> None:
    """A tier names its cards' link (a slow one sends misses to the CPU pool); a split says how its stages
    hand activations on."""
    h200 = Card(141 * GIB, "NVIDIA H200", 5, 16)
    assert h200.describe() == "NVIDIA H200 141 GiB (PCIe 5.0 x16)" and round(h200.link_gb_s) == 54
    q30, qnext = models
    fast = choose(Machine((Card(24 * GIB, "GPU", 4, 16),), 256 * GIB, 16), qnext)
    assert "misses are copied over PCIe 4.0 x16, about 27 GB/s" in " ".join(fast.reasons)
    slow = choose(Machine((Card(24 * GIB, "GPU", 3, 4),), 256 * GIB, 16), qnext)
    assert "the cards' link is slow (PCIe 3.0 x4, about 3 GB/s)" in " ".join(slow.reasons)
    unknown = choose(Machine((Card(24 * GIB),), 256 * GIB, 16), qnext)
    assert "as the link and the CPU measure at start" in " ".join(unknown.reasons)
    pair = (Card(24 * GIB), Card(24 * GIB))
    joined = choose(Machine(pair, 128 * GIB, 16, nvlink=True), q30)
    apart = choose(Machine(pair, 128 * GIB, 16, nvlink=False), q30)
    assert joined.layer_split == apart.layer_split == "2"
    assert "over NVLink" in " ".join(joined.reasons) and "(no NVLink)" in " ".join(apart.reasons)
    assert (
        Machine(pair, 128 * GIB, 16, nvlink=False).describe().startswith("GPU 24 GiB, GPU 24 GiB; no NVLink")
    )
