"""The expert tier's hand-over kernels (app/kernels/triton_tier.py) on the GPU, reading and writing pinned
host buffers in place, inside a CUDA graph too: the bits of their torch references; and the experts kernel's
skipped entries at Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import pytest
import torch

from app.kernels.reference import TIER_LINK_REFERENCE
from app.kernels.triton_moe import fused_experts
from app.kernels.triton_tier import TIER_LINK

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _window(rows: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, EXPERTS, device="cuda", generator=g)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    live = (torch.arange(rows, device="cuda") % 3 != 2).int()
    slot_of = torch.full((EXPERTS,), -1, dtype=torch.int64, device="cuda")
    slot_of[::4] = torch.arange(EXPERTS // 4, device="cuda")
    return ids, weights.bfloat16(), x, live, slot_of


@pytest.mark.parametrize("rows", [1, 5])
def test_the_hand_over_kernels_give_their_references_bits_in_pinned_memory_and_in_a_graph(rows: int) -> None:
    ids, weights, x, live, slot_of = _window(rows)
    size = rows * (2 * TOP_K + HIDDEN)
    down = {name: torch.zeros(size, pin_memory=True) for name in ("kernel", "reference")}
    stage_of = torch.full((EXPERTS,), -1.0, pin_memory=True)
    stage_of[[3, 17, 90]] = torch.tensor([0.0, 1.0, 2.0])
    sums = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1)).pin_memory()
    resident, staged = torch.randn(2, rows, HIDDEN, device="cuda").bfloat16()

    def run(fns, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        slots = fns.pack(ids, weights, x, live, slot_of, out)
        return slots, fns.staged_slots(ids, live, stage_of), fns.add_parts(resident, staged, sums)

    want = run(TIER_LINK_REFERENCE, down["reference"])
    got = run(TIER_LINK, down["kernel"])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(down["kernel"], down["reference"])
    expected = down["reference"].clone()
    for fns, out in ((TIER_LINK, down["kernel"]), (TIER_LINK_REFERENCE, down["reference"])):
        # both sets are captured (`STRATA_TIER_LINK=0` puts the references in the tier's graphs)
        stage_of[3] = 0.0
        graph = torch.cuda.CUDAGraph()
        out.zero_()
        with torch.cuda.graph(graph):
            captured = run(fns, out)
        out.zero_()
        stage_of[3] = 5.0  # what a host step writes between the pieces is what the replay reads
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert torch.equal(captured[1], TIER_LINK_REFERENCE.staged_slots(ids, live, stage_of))


@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_skipped_entries_add_nothing_at_full_shape(tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    weights, ids = torch.randn(tokens, EXPERTS, device="cuda", generator=g).softmax(-1).topk(TOP_K, dim=-1)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * 0.02).bfloat16()
    skipped = torch.rand(ids.shape, device="cuda", generator=g) < 0.5
    weights = weights.bfloat16()
    got = fused_experts(x, ids.masked_fill(skipped, -1), weights, gate_up, down)
    assert torch.equal(got, fused_experts(x, ids, weights * ~skipped, gate_up, down))


def test_driver_queued_staging_copies_match_torchs() -> None:
    """The staging copies queued through the driver (PinnedCopies) on a side stream: whole Q4_K-sized
    experts in runs and a split expert's later channels, the bits torch's copies of the same slices give."""
    from app.models.expert_tier import ExpertStaging
    from app.models.host_copies import PinnedCopies

    assert PinnedCopies(torch.device("cuda"))._copy is not None  # the driver's entry point was found
    gate_up = torch.randint(0, 255, (16, 2 * INTER, 1152), dtype=torch.uint8).pin_memory()
    down = torch.randint(0, 255, (16, HIDDEN, 432), dtype=torch.uint8).pin_memory()
    staging = ExpertStaging(6)
    staging.allocate(gate_up, down, torch.device("cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        slots = staging.load([3, 11, 12, 5], [3, 11, 12, 5], gate_up, down)
        rest = staging.load_rest(9, 256, gate_up, down)
    side.synchronize()
    for expert, slot in slots.items():
        assert torch.equal(staging.gate_up[slot].cpu(), gate_up[expert])
        assert torch.equal(staging.down[slot].cpu(), down[expert])
    kept = staging.gate_up[rest].cpu()
    assert torch.equal(kept[:256], torch.zeros_like(kept[:256]))
    assert torch.equal(kept[256:INTER], gate_up[9, 256:INTER])
    assert torch.equal(kept[INTER + 256 :], gate_up[9, INTER + 256 :])
    assert torch.equal(staging.down[rest].cpu(), down[9])
    copies = staging.copies
    with pytest.raises(ValueError, match="leaves its tensors"):  # checked before the driver is called
        copies.queue((staging.down, down, [(staging.down.numel() - 8, 0, 16)]))
    with pytest.raises(ValueError, match="from host memory"):
        copies.queue((staging.down, staging.down.clone(), [(0, 0, 16)]))


def test_the_native_step_queues_the_references_copies_through_the_driver_on_a_side_stream() -> None:
    """The native small-window step (app/models/tier_step.py) at q30's shapes with pinned bf16 host experts:
    on a side stream, its copies through the driver leave the staging slots (whole experts and a split one)
    as `_serve_small`'s do, and its pool's sums are the reference's bits."""
    from app.kernels.cpu_experts import experts_swiglu_sum, finish_background, native_available, small_step
    from app.kernels.reference import experts_reference
    from app.models.expert_costs import MissCosts
    from app.models.expert_tier import SPLIT_ALIGN, ExpertStaging, TieredExperts
    from app.models.tier_step import native_small_step

    if not native_available():
        pytest.skip("the native kernels are not built")
    experts, resident, rows = 16, 5, 2
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=g).bfloat16() * 0.02
    down = torch.randn(experts, HIDDEN, INTER, generator=g).bfloat16() * 0.02
    tiers = []
    for _ in range(2):
        kernels = (experts_reference, resident, experts_swiglu_sum, 0, finish_background, small_step)
        tier = TieredExperts(experts, HIDDEN, INTER, *kernels)
        tier.fill(gate_up, down, torch.device("cuda"))
        tier.staging = ExpertStaging(experts - resident + 1)
        tier.staging.allocate(tier.host_gate_up, tier.host_down, torch.device("cuda"))
        # as fast on both sides, at the experts' own size: a lone miss of a few is split
        tier.costs = MissCosts(tier.expert_bytes(), pcie_bytes_s=20e9, cpu_bytes_s=20e9, cpu_row_s=0.0)
        tier.costs.observe_cpu = lambda *observed: None  # type: ignore[method-assign]
        tiers.append(tier)
    step = native_small_step(tiers[1], small_step, 64, SPLIT_ALIGN)
    assert step is not None and step.device is not None
    ids = torch.tensor([[5, 6, 7, 0, 1, 2, 3, 8], [9, 10, 11, 0, 1, 2, 3, 4]])  # 7 misses: one split
    weights = torch.rand(rows, TOP_K, generator=g)
    x = torch.randn(rows, HIDDEN, generator=g)
    picks = torch.cat([ids.flatten().float(), weights.flatten()]).pin_memory()
    listed = picks.tolist()
    expected_sums, sums = torch.zeros(rows, HIDDEN), torch.zeros(rows, HIDDEN)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        entries = rows * TOP_K
        expected = tiers[0]._serve_small(listed[:entries], TOP_K, x, listed[entries:], expected_sums)
        got = step.serve(picks.data_ptr(), rows, TOP_K, x.data_ptr(), sums.data_ptr(), 0, None)
    side.synchronize()
    assert got[0] == expected[0] and len(got[0]) > 1 and got[1] and expected[1]
    assert tiers[1].staging.zeroed and tiers[1].pcie_bytes == tiers[0].pcie_bytes
    assert torch.equal(tiers[1].staging.gate_up, tiers[0].staging.gate_up)
    assert torch.equal(tiers[1].staging.down, tiers[0].staging.down)
    assert torch.equal(sums, expected_sums)
