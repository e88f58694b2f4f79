"""The expert tier's captured-window kernels against the torch ops they replace, in Triton's interpreter on
CPU tensors: the same bits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.kernels.reference import add_parts_reference, pack_routing_reference, staged_slots_reference
from app.kernels.triton_tier import add_parts, pack_routing, staged_slots

EXPERTS, WIDTH, HIDDEN = 16, 4, 40


def _window(rows: int, padded: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:WIDTH] for _ in range(rows)])
    weights = torch.rand(rows, WIDTH, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    live = (torch.arange(rows) % 3 != 2).to(torch.int32) if padded else None
    return ids, weights, x, live


@pytest.mark.parametrize(("rows", "padded"), [(1, False), (5, True)])
def test_a_packed_window_and_its_slots_are_the_torch_ops(rows: int, padded: bool) -> None:
    ids, weights, x, live = _window(rows, padded)
    slot_of = torch.full((EXPERTS,), -1, dtype=torch.int64)
    slot_of[::3] = torch.arange(len(slot_of[::3]))
    size = rows * WIDTH * 2 + rows * HIDDEN
    got_down, want_down = torch.full((size + 3,), 7.0), torch.full((size + 3,), 7.0)
    got = pack_routing(ids, weights, x, live, slot_of, got_down)
    want = pack_routing_reference(ids, weights, x, live, slot_of, want_down)
    assert torch.equal(got, want) and torch.equal(got_down, want_down)
    if padded:
        assert (got[2] == -1).all() and (got_down[2 * WIDTH : 3 * WIDTH] == EXPERTS).all()


@pytest.mark.parametrize(("padded", "dtype"), [(False, torch.bfloat16), (True, torch.float32)])
def test_staged_slots_and_the_added_parts_are_the_torch_ops(padded: bool, dtype: torch.dtype) -> None:
    ids, _, _, live = _window(5, padded)
    stage_of = torch.full((EXPERTS,), -1.0)
    stage_of[[1, 4, 9]] = torch.tensor([0.0, 2.0, 1.0])
    assert torch.equal(staged_slots(ids, live, stage_of), staged_slots_reference(ids, live, stage_of))
    g = torch.Generator().manual_seed(9)
    resident, staged = (torch.randn(5, HIDDEN, generator=g).to(dtype) for _ in range(2))
    sums = torch.randn(5, HIDDEN, generator=g)
    for part in (staged, None):
        assert torch.equal(add_parts(resident, part, sums), add_parts_reference(resident, part, sums))


def test_the_added_parts_wait_for_the_pools_done_word() -> None:
    """With a done word the sums are read only once it is set: a thread standing in for the CPU pool writes
    them after the kernel started, then the word; the kernel adds what it wrote. The torch hand-over cannot
    wait and refuses a word not yet set."""
    g = torch.Generator().manual_seed(11)
    resident = torch.randn(2, HIDDEN, generator=g).to(torch.bfloat16)
    final = torch.randn(2, HIDDEN, generator=g)
    sums, done = torch.zeros(2, HIDDEN), torch.zeros(1, dtype=torch.int32)

    def pool() -> None:
        time.sleep(0.05)
        sums.copy_(final)
        done[0] = 1

    worker = threading.Thread(target=pool)
    worker.start()
    got = add_parts(resident, None, sums, done)
    worker.join()
    assert torch.equal(got, add_parts_reference(resident, None, final))
    assert torch.equal(add_parts_reference(resident, None, final, done), got)
    done[0] = 0
    with pytest.raises(ValueError, match="cannot wait"):
        add_parts_reference(resident, None, final, done)
