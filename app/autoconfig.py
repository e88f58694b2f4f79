"""Settings chosen from the machine and the model: slots, layer split and groups, expert budget, KV memory.

`choose` is pure: a described `Machine` (its cards' memory, host RAM, cores) and the model's `ModelFacts`
(weight bytes apart from the routed experts, one expert's bytes, the KV bytes a token adds, a slot's
recurrent state) give `Settings`, each with the reason it was chosen. The rules, in order:

1. A card's usable memory is CARD_USE of it less RESERVE (CUDA's context, the window graphs, activations).
2. The model runs whole on the first card when its weights leave room there for MIN_SLOTS conversations of
   MIN_CONTEXT tokens; else on the fewest cards whose usable memory together holds the weights and that much
   KV on each (a layer split, one stage a card, one slot group a stage so that every card stays busy).
3. When even every card together does not hold the weights, the routed experts that do not fit stay in host
   RAM (the expert tier): every card is a stage, and each MoE layer keeps as many experts on its card as the
   room left after the other weights, a staging area for one layer's misses and the minimum KV allows
   (spread over the layers alike: trained routers favour some experts in each, which the tier follows).
   Host RAM must hold the rest with HOST_SHARE of it; else the model does not fit the machine.
4. The KV memory of a stage is what its card has left (the smallest such among the stages); slots are as
   many conversations of MIN_CONTEXT tokens as that holds, 1 to MAX_SLOTS (the pool is shared, so one
   conversation reaches much further while the others are short).
   On a machine without a GPU the model runs in host RAM, with CPU_SLOTS_PER_CORE slots a core.
5. Cards a model does not need stay free: a split's windows run eagerly today, slower than one card's
   captured graphs, so a split is chosen only where the weights need it.
6. Where the card's KV memory cannot take one conversation to the model's full context, the pool grows into
   host RAM (`--kv-resident`): every slot at the full context, within KV_HOST_SHARE of the RAM the experts
   leave; the card keeps as many of its tokens as fit beside two staging areas of one attention layer, the
   rest is streamed in for attention (the card's blocks are handed out first, so short conversations never
   stream).

`detect_machine` reads the machine this runs on; `facts_of` reads a model directory or GGUF file's sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import StrataError
from app.models.placement import spare_slots

if TYPE_CHECKING:
    import torch

    from app.kernels.interface import Backends
    from app.models.qwen3 import CausalLM

GIB = 1 << 30
CARD_USE = 0.92  # the share of a card's memory the engine plans with
RESERVE = 3 * GIB // 2  # of that, bytes left to CUDA's context, the window graphs and activations
MIN_SLOTS = 4  # conversations the KV memory must hold at least ...
MIN_CONTEXT = 8192  # ... of so many tokens each
MAX_SLOTS = 32  # slots at most (the engine's windows are tuned up to 32 decoding rows)
HOST_SHARE = 0.8  # the share of host RAM the experts beyond the cards may take
CPU_SLOTS_PER_CORE = 2  # on a CPU the windows are compute-bound: so many slots a core (MIN_SLOTS at least)
KV_HOST_SHARE = 0.25  # the share of host RAM (beyond the experts') a KV pool larger than the card may take


PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # one lane's rate, each way
PCIE_EFFICIENCY = 0.85  # of that, what pinned copies reach (an H200's 5.0 x16: 55 GB/s measured of 63)
SLOW_LINK_GB_S = 12.0  # below this a card's link makes misses copied over it slower than the CPU pool


@dataclass(frozen=True)
class Card:
    """One GPU: its memory in bytes and name, and its PCIe link's generation and lanes (the most the card and
    its slot agree on; None where unknown)."""

    memory: int
    name: str = "GPU"
    pcie_gen: int | None = None
    pcie_width: int | None = None

    @property
    def link_gb_s(self) -> float | None:
        """What a pinned host-to-card copy reaches over the link, estimated; None where it is unknown."""
        if self.pcie_gen is None or self.pcie_width is None or self.pcie_gen not in PCIE_LANE_GB_S:
            return None
        return PCIE_LANE_GB_S[self.pcie_gen] * self.pcie_width * PCIE_EFFICIENCY

    def describe(self) -> str:
        """`NVIDIA H200 139 GiB (PCIe 5.0 x16)`."""
        link = f" (PCIe {self.pcie_gen}.0 x{self.pcie_width})" if self.link_gb_s is not None else ""
        return f"{self.name} {self.memory / GIB:.0f} GiB{link}"


@dataclass(frozen=True)
class Machine:
    """The cards (in order; none: a CPU machine), host RAM in bytes, the cores, and whether NVLink joins
    the cards (None where unknown or only one)."""

    cards: tuple[Card, ...]
    ram: int
    cores: int
    nvlink: bool | None = None

    def describe(self) -> str:
        """One line: the cards, their links, RAM and cores."""
        cards = ", ".join(c.describe() for c in self.cards) or "no GPU"
        joined = {True: "; NVLink between the cards", False: "; no NVLink between the cards", None: ""}
        return f"{cards}{joined[self.nvlink]}; {self.ram / GIB:.0f} GiB RAM; {self.cores} cores"


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need of a model, in the dtype it will run in: `dense_bytes` every weight but the
    routed experts', `expert_bytes` one routed expert's, `moe_layers` × `experts` of them (MTP layers
    included), `layers` decoder layers, `kv_token_bytes` the KV a token adds on every attention layer,
    `slot_state_bytes` one slot's recurrent state, `max_len` the model's context, `ends_bytes` the part of
    `dense_bytes` outside the decoder layers (the embedding and LM head, on a split's first stage),
    `attention_layers` the layers with a KV cache, `tier_expert_bytes` one routed expert's under an expert
    tier where that differs (a GGUF file's experts
    whose projections are of two types stay its blocks on a card alone, and are widened in a tier)."""

    dense_bytes: int
    expert_bytes: int
    experts: int
    moe_layers: int
    layers: int
    kv_token_bytes: int
    slot_state_bytes: int
    max_len: int
    ends_bytes: int = 0  # of `dense_bytes`, the embedding and LM head's (outside the decoder layers)
    tier_expert_bytes: int | None = None
    attention_layers: int = 0  # of `layers`, those with a KV cache (0: unknown, the pool stays on the card)

    @property
    def weight_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes * self.experts * self.moe_layers


@dataclass
class Settings:
    """What `choose` picked (names as `strata serve`'s flags) and why, a line each."""

    parallel: int
    kv_memory: int
    layer_split: str | None = None
    batch_groups: int | None = None
    expert_cache: int | None = None
    adapt_async: bool = False
    expert_placement: str = "spread"
    kv_resident: int | None = None
    reasons: list[str] = field(default_factory=list)

    def options(self) -> dict[str, str | bool]:
        """These settings as `strata serve` options: flag name (without the dashes) -> its value, True for a
        flag that takes none."""
        options: dict[str, str | bool] = {
            "parallel": str(self.parallel),
            "kv-memory": f"{max(1, self.kv_memory >> 20)}MiB",  # a tiny model's pool: 1 MiB at least
        }
        if self.layer_split is not None:
            options["layer-split"] = self.layer_split
        if self.batch_groups is not None:
            options["batch-groups"] = str(self.batch_groups)
        if self.expert_cache is not None:
            options["expert-cache"] = str(self.expert_cache)
        if self.adapt_async:
            options["adapt-async"] = True
        if self.expert_placement != "spread":
            options["expert-placement"] = self.expert_placement
        if self.kv_resident is not None:
            options["kv-resident"] = str(self.kv_resident)
        return options

    def flags(self) -> list[str]:
        """These settings as `strata serve` flags."""
        flags = []
        for name, value in self.options().items():
            flags += [f"--{name}"] if value is True else [f"--{name}", str(value)]
        return flags


def usable(card: Card) -> int:
    """Bytes of a card the engine plans with (rule 1)."""
    return max(int(card.memory * CARD_USE) - RESERVE, 0)


def kv_bytes(facts: ModelFacts, slots: int, context: int) -> int:
    """KV memory for `slots` conversations of `context` tokens (their recurrent state included)."""
    return slots * (context * facts.kv_token_bytes + facts.slot_state_bytes)


def choose(machine: Machine, facts: ModelFacts) -> Settings:
    """The settings for `facts` on `machine` (module docstring); a StrataError where it cannot hold them."""
    minimum = kv_bytes(facts, MIN_SLOTS, min(MIN_CONTEXT, facts.max_len))
    if not machine.cards:
        room = int(machine.ram * HOST_SHARE) - facts.weight_bytes
        if room < minimum:
            raise StrataError(
                f"the model's {facts.weight_bytes / GIB:.1f} GiB of weights leave no room for "
                f"{MIN_SLOTS} conversations in {machine.ram / GIB:.0f} GiB of RAM"
            )
        reasons = ["no GPU: the model runs on the CPU, in host RAM"]
        slots = min(MAX_SLOTS, max(MIN_SLOTS, CPU_SLOTS_PER_CORE * machine.cores))
        return _sized(facts, room, reasons, slots, "host RAM")
    rooms = [usable(c) for c in machine.cards]
    for stages in range(1, len(rooms) + 1):
        per_stage = _stage_shares(facts, facts.weight_bytes, stages)
        if all(w + minimum <= r for w, r in zip(per_stage, rooms[:stages], strict=True)):
            return _split(facts, stages, rooms, per_stage, machine)
    return _tiered(facts, rooms, minimum, machine)


def _stage_shares(facts: ModelFacts, weights: int, stages: int) -> list[int]:
    """The bytes of `weights` (the model's, or its dense part) each of `stages` stages holds: the layers as
    even as they go (the later stages the odd ones, as `--layer-split N` cuts them), the embedding and LM
    head on the first."""
    ends = facts.ends_bytes
    per_layer = (weights - ends) / facts.layers
    base, odd = divmod(facts.layers, stages)
    counts = [base + (i >= stages - odd) for i in range(stages)]
    return [int(n * per_layer) + (ends if i == 0 else 0) for i, n in enumerate(counts)]


def _split(
    facts: ModelFacts, stages: int, rooms: list[int], per_stage: list[int], machine: Machine
) -> Settings:
    weights = facts.weight_bytes / GIB
    if stages == 1:
        reasons = [f"the weights ({weights:.1f} GiB) fit the first card with room for the KV memory"]
        if len(machine.cards) > 1:
            reasons.append(_idle(len(machine.cards) - 1))
        return _sized(facts, rooms[0] - per_stage[0], reasons, ram=int(machine.ram * KV_HOST_SHARE))
    reasons = [
        f"the weights ({weights:.1f} GiB) need {stages} of the {len(machine.cards)} cards: a layer split, "
        f"one stage a card, and {stages} slot groups taking turns down the stages so that every card stays "
        "busy"
    ]
    reasons += _handoff_reasons(machine)
    if stages < len(machine.cards):
        reasons.append(_idle(len(machine.cards) - stages))
    free = min(r - w for r, w in zip(rooms[:stages], per_stage, strict=True))
    settings = _sized(facts, free, reasons, ram=int(machine.ram * KV_HOST_SHARE) // stages)
    settings.layer_split, settings.batch_groups = str(stages), min(stages, settings.parallel)
    return settings


def _handoff_reasons(machine: Machine) -> list[str]:
    """How a split's stages hand windows on, where the machine says whether NVLink joins its cards."""
    if machine.nvlink is None:
        return []
    if machine.nvlink:
        return ["the stages hand each window's activations on over NVLink"]
    return ["the stages hand each window's activations on over PCIe (no NVLink): a few MB a window"]


def _link_reason(cards: tuple[Card, ...]) -> str:
    """What the cards' PCIe links mean for the tier's misses (the engine measures them again at start)."""
    rates = [c.link_gb_s for c in cards]
    if any(rate is None for rate in rates):
        return "misses go to the CPU pool or over PCIe as the link and the CPU measure at start"
    slowest = min(r for r in rates if r is not None)
    card = cards[rates.index(slowest)]
    link = f"PCIe {card.pcie_gen}.0 x{card.pcie_width}, about {slowest:.0f} GB/s"
    if slowest < SLOW_LINK_GB_S:
        return (
            f"the cards' link is slow ({link}): most misses run on the CPU pool, and long prompts copy "
            "experts at that rate"
        )
    return f"misses are copied over {link}, or computed on the CPU pool where that is quicker"


def _idle(cards: int) -> str:
    """Why `cards` cards are left free (rule 5)."""
    return (
        f"{cards} card{'s' if cards > 1 else ''} left free: a layer split's windows run eagerly today, "
        "slower than one card's captured graphs, so the model takes only the cards its weights need"
    )


def _tiered(facts: ModelFacts, rooms: list[int], minimum: int, machine: Machine) -> Settings:
    stages = len(rooms)
    moe_layers = facts.moe_layers / stages  # each stage holds its share of the MoE layers
    dense = _stage_shares(facts, facts.dense_bytes, stages)
    expert_bytes = facts.tier_expert_bytes or facts.expert_bytes

    def used(resident: int) -> list[int]:
        """Each stage's bytes with `resident` experts a layer: its other weights, those experts and the
        asynchronous swaps' spare slots, and the staging area for one layer's host slots."""
        spare = spare_slots(resident)
        experts = (resident + spare) * moe_layers + (facts.experts - resident + 1)
        return [d + int(experts * expert_bytes) for d in dense]

    resident = min(facts.experts - 1, max(0, (min(rooms) - max(dense)) // int(moe_layers * expert_bytes)))
    while resident and any(u + minimum > r for u, r in zip(used(resident), rooms, strict=True)):
        resident -= 1
    free = min(r - u for r, u in zip(rooms, used(resident), strict=True))
    host = (facts.experts - resident) * facts.moe_layers * expert_bytes
    weights = facts.weight_bytes / GIB
    if free < minimum or host > machine.ram * HOST_SHARE:
        raise StrataError(
            f"the model's {weights:.1f} GiB of weights do not fit this machine: {host / GIB:.1f} GiB of "
            f"experts would stay in host RAM ({machine.ram / GIB:.0f} GiB) beside what the cards hold"
        )
    if resident:
        reasons = [
            f"the weights ({weights:.1f} GiB) exceed the cards: the expert tier keeps {resident} of each MoE "
            f"layer's {facts.experts} experts on the card ({resident / facts.experts:.0%}) and "
            f"{host / GIB:.1f} GiB of experts in host RAM, following the routing (asynchronous swaps into "
            f"{spare_slots(resident)} spare slots a layer)"
        ]
    else:
        reasons = [
            f"the weights ({weights:.1f} GiB) exceed the cards: every routed expert stays in host RAM "
            f"({host / GIB:.1f} GiB), each window's misses computed on the CPU or copied over PCIe"
        ]
    reasons.append(_link_reason(machine.cards))
    if stages > 1:
        reasons.append(f"the other weights are split over the {stages} cards, one stage and slot group each")
        reasons += _handoff_reasons(machine)
    left = min(machine.ram * HOST_SHARE - host, machine.ram * KV_HOST_SHARE)  # RAM the experts leave
    settings = _sized(facts, free, reasons, ram=max(int(left), 0) // stages)
    settings.expert_cache, settings.adapt_async = resident, resident > 0
    if stages > 1:
        settings.layer_split, settings.batch_groups = str(stages), min(stages, settings.parallel)
    return settings


def _sized(
    facts: ModelFacts,
    room: int,
    reasons: list[str],
    most: int = MAX_SLOTS,
    where: str = "the card",
    ram: int = 0,
) -> Settings:
    """Slots and KV memory from `room` bytes (rule 4): as many slots as conversations of MIN_CONTEXT tokens
    the room holds, 1 to `most` (the KV pool is shared: a slot reaches further while others are short), and
    no more KV memory than every slot at the model's full context takes; where one conversation alone cannot
    reach the full context, the pool grows into up to `ram` bytes of host RAM (rule 6)."""
    context = min(MIN_CONTEXT, facts.max_len)
    per_slot = kv_bytes(facts, 1, context)
    parallel = max(1, min(most, room // per_slot if per_slot else most))
    kv_memory = min(room, kv_bytes(facts, parallel, facts.max_len))
    reach = (kv_memory - parallel * facts.slot_state_bytes) // max(facts.kv_token_bytes, 1)
    reasons.append(
        f"{parallel} slots: the KV memory holds {parallel} conversations of {context} tokens"
        + (" (the most slots here)" if parallel == most else "")
        + f", {min(reach, facts.max_len)} tokens for one alone"
    )
    full = " (every slot at the model's full context)" if kv_memory < room else ""
    reasons.append(f"KV memory {_size(kv_memory)}: what {where} has left after the weights{full}")
    settings = Settings(parallel=parallel, kv_memory=kv_memory, reasons=reasons)
    beyond = _beyond_the_card(facts, room, parallel, ram) if reach < facts.max_len else None
    if beyond is not None:
        pool, resident = beyond
        settings.kv_memory, settings.kv_resident = (
            pool * facts.kv_token_bytes + parallel * facts.slot_state_bytes,
            resident,
        )
        each = min(pool // parallel, facts.max_len)
        reasons[-1] = (
            f"KV memory {_size(settings.kv_memory)}: {pool} tokens, {each} a slot (one conversation "
            f"alone up to {min(pool, facts.max_len)}), {resident} of them on {where} beside two staging "
            "areas of one attention layer and the rest in host RAM, streamed in for attention a layer ahead "
            "(--kv-resident); conversations within the card's tokens never stream"
        )
    return settings


def _beyond_the_card(facts: ModelFacts, room: int, parallel: int, ram: int) -> tuple[int, int] | None:
    """Rule 6: (pool tokens, tokens of it on the card) for a pool that grows into `ram` bytes of host RAM,
    each slot reaching the model's full context where that fits; None where it would not reach further than
    the card alone (no attention layers known, too few to stage, or no RAM to spare)."""
    token, layers = facts.kv_token_bytes, facts.attention_layers
    if token == 0 or layers <= 2 or ram <= 0:
        return None
    device = room - parallel * facts.slot_state_bytes
    alone = device // token  # the tokens the card holds without streaming
    # resident * token + 2 * (pool - resident) * token / layers <= device, the card keeping every slot's
    # MIN_CONTEXT tokens (so that the slots' usual conversations never stream)
    floor = min(parallel * MIN_CONTEXT, alone)
    by_staging = floor + (device - floor * token) * layers // (2 * token)

    def on_card(pool: int) -> int:
        return min(pool, int((device - 2 * pool * token / layers) / (token * (1 - 2 / layers))))

    pool = min(parallel * facts.max_len, by_staging)
    pool = min(
        pool, on_card(pool) + ram // token
    )  # the host part within `ram` (less staging: more on the card)
    resident = on_card(pool)
    if pool <= alone + alone // 2 or resident < floor:  # not worth streaming for
        return None
    return pool, resident


def card_kv_bytes(facts: ModelFacts, settings: Settings) -> int:
    """Bytes of a stage's card the KV memory of `settings` takes: all of it, or with `kv_resident` the
    resident tokens, two staging areas of one attention layer as large as the part in host RAM, and the
    slots' recurrent state."""
    if settings.kv_resident is None:
        return settings.kv_memory
    state = settings.parallel * facts.slot_state_bytes
    token = facts.kv_token_bytes
    pool = (settings.kv_memory - state) // token
    beyond = pool - settings.kv_resident
    return settings.kv_resident * token + 2 * beyond * token // facts.attention_layers + state


def _size(count: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count >> 20} MiB"


def facts_of(path: Path | str, dtype: str = "bfloat16", backends: Backends | None = None) -> ModelFacts:
    """A model's `ModelFacts` from its checkpoint's config, its weights in `dtype`: the model is built on the
    meta device and its parameters counted, the routed experts apart. On `backends` (the set it will run
    on), a GGUF file's tensors that the set reads as they lie count at the file's bytes, as `load_model`
    holds them (`hold_file_blocks`), and a tier's experts as the loader holds them there."""
    import torch

    from app.kernels.reference import REFERENCE
    from app.loading.checkpoint import open_checkpoint
    from app.loading.loader import hold_file_blocks, mtp_layer_count, tier_expert_bytes
    from app.models.qwen3 import CausalLM

    checkpoint = open_checkpoint(path)
    with torch.device("meta"):
        model = CausalLM(
            checkpoint.config, mtp_layers=mtp_layer_count(checkpoint), backends=backends or REFERENCE
        )
    if backends is None or not hold_file_blocks(model, checkpoint, backends):
        return facts_of_model(model, getattr(torch, dtype))
    target = getattr(torch, dtype)
    tier = tier_expert_bytes(checkpoint, backends, torch.empty((), dtype=target).element_size())
    return replace(facts_of_model(model, target), tier_expert_bytes=tier)


def facts_of_model(model: CausalLM, dtype: torch.dtype) -> ModelFacts:
    """`ModelFacts` of a CausalLM (built on the meta device, or loaded) whose weights are in `dtype`."""
    import torch

    from app.engine.paged_state import kv_block_bytes, slot_state_bytes
    from app.models.config import ATTENTION
    from app.models.moe import RoutedExperts

    config = model.config
    item = torch.empty((), dtype=dtype).element_size()

    def size(weight: torch.Tensor) -> int:
        """A weight's bytes in `dtype`, or as its blocks where it is held (uint8)."""
        return weight.numel() * (1 if weight.dtype == torch.uint8 else item)

    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    expert_total = sum(size(m.gate_up) + size(m.down) for m in routed)
    total = sum(size(p) for p in model.parameters())
    ends = size(model.model.embed_tokens.weight)
    if model.lm_head is not None:
        ends += size(model.lm_head.weight)
    return ModelFacts(
        dense_bytes=total - expert_total,
        expert_bytes=expert_total // (len(routed) * config.num_experts) if routed else 0,
        experts=config.num_experts if routed else 0,
        moe_layers=len(routed),
        layers=config.num_hidden_layers,
        kv_token_bytes=kv_block_bytes(config, 1, dtype),
        slot_state_bytes=slot_state_bytes(config, dtype),
        max_len=config.max_position_embeddings,
        ends_bytes=ends,
        attention_layers=config.layer_types.count(ATTENTION),
    )


def for_model(model: Path | str, dtype: str = "bfloat16") -> tuple[Machine, Settings]:
    """This machine and the settings `choose` picks on it for the model at `model` in `dtype`."""
    from app.kernels.backends import select_backends

    machine = detect_machine()
    backends = select_backends("auto", "cuda" if machine.cards else "cpu")
    return machine, choose(machine, facts_of(model, dtype, backends))


def detect_machine() -> Machine:
    """The machine this runs on: each visible GPU's memory, name and PCIe link, whether NVLink joins them
    (from nvidia-smi, where it answers), host RAM, the cores this process may use."""
    import os

    import psutil
    import torch

    cards = []
    if torch.cuda.is_available():
        links = pcie_links(_nvidia_smi("--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv"))
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gen, width = links[i] if i < len(links) else (None, None)
            cards.append(Card(props.total_memory, props.name, gen, width))
    nvlink = nvlink_joined(_nvidia_smi("topo", "-m")) if len(cards) > 1 else None
    return Machine(tuple(cards), psutil.virtual_memory().total, len(os.sched_getaffinity(0)), nvlink)


def _nvidia_smi(*args: str) -> str:
    """nvidia-smi's output for `args`; empty where it is missing or fails."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def pcie_links(csv: str) -> list[tuple[int | None, int | None]]:
    """(generation, lanes) of each card from nvidia-smi's `pcie.link.gen.max,pcie.link.width.max` CSV."""
    links: list[tuple[int | None, int | None]] = []
    for line in csv.strip().splitlines()[1:]:
        fields = [f.strip() for f in line.split(",")]
        gen, width = ([int(f) if f.isdigit() else None for f in fields[:2]] + [None, None])[:2]
        links.append((gen, width))
    return links


def nvlink_joined(topology: str) -> bool | None:
    """Whether `nvidia-smi topo -m` shows every pair of GPUs joined by NVLink (`NV#`); None without a
    matrix."""
    rows = [line.split() for line in topology.splitlines() if re.match(r"GPU\d+\s", line)]
    if len(rows) < 2:
        return None
    gpus = len(rows)
    pairs = [row[1 + j] for i, row in enumerate(rows) for j in range(gpus) if j != i and len(row) > gpus]
    return bool(pairs) and all(re.fullmatch(r"NV\d+", pair) for pair in pairs)
