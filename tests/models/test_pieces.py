"""A forward captured as several graphs with host steps between them: the bookkeeping of `Pieces`, with a
stand-in for CUDA graphs (the real ones are exercised by the GPU tests of tiered models)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from app.models import pieces as pieces_module
from app.models.pieces import Pieces

LOG: list[str] = []


class FakeGraph:
    """Records capture and replay in LOG."""

    made = 0

    def __init__(self) -> None:
        FakeGraph.made += 1
        self.name = f"graph{FakeGraph.made}"

    def capture_begin(self, pool: object = None) -> None:
        LOG.append(f"begin {self.name}")

    def capture_end(self) -> None:
        LOG.append(f"end {self.name}")

    def replay(self) -> None:
        LOG.append(f"replay {self.name}")


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    LOG.clear()
    FakeGraph.made = 0
    monkeypatch.setattr(pieces_module.torch.cuda, "CUDAGraph", FakeGraph)
    return LOG


def test_each_cut_ends_a_graph_and_its_step_runs_between_replays(fake_graphs: list[str]) -> None:
    pieces = Pieces(pool=(0, 0))
    pieces.begin()
    pieces.cut(lambda: fake_graphs.append("step 1"))
    pieces.cut(lambda: fake_graphs.append("step 2"))
    pieces.end()
    assert fake_graphs == [
        "begin graph1",
        "end graph1",
        "begin graph2",
        "end graph2",
        "begin graph3",
        "end graph3",
    ]
    fake_graphs.clear()
    pieces.replay()
    assert fake_graphs == ["replay graph1", "step 1", "replay graph2", "step 2", "replay graph3"]


def test_what_a_step_leaves_running_is_finished_once_the_next_graph_is_launched(
    fake_graphs: list[str],
) -> None:
    pieces = Pieces(pool=(0, 0))
    pieces.begin()

    def pooled() -> Callable[[], None]:
        fake_graphs.append("step 1 starts the pool")
        return lambda: fake_graphs.append("pool 1 joined")

    pieces.cut(pooled)
    pieces.cut(lambda: fake_graphs.append("step 2"))
    pieces.cut(pooled)
    pieces.end()
    fake_graphs.clear()
    pieces.replay()
    assert fake_graphs == [
        "replay graph1",
        "step 1 starts the pool",
        "replay graph2",
        "pool 1 joined",
        "step 2",
        "replay graph3",
        "step 1 starts the pool",
        "replay graph4",
        "pool 1 joined",
    ]


def test_a_steps_running_work_is_finished_when_the_next_replay_fails(
    fake_graphs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces = Pieces(pool=(0, 0))
    pieces.begin()
    pieces.cut(lambda: lambda: fake_graphs.append("joined"))
    pieces.end()

    def broken(self: FakeGraph) -> None:
        if self.name == "graph2":
            raise RuntimeError("replay failed")
        fake_graphs.append(f"replay {self.name}")

    monkeypatch.setattr(FakeGraph, "replay", broken)
    fake_graphs.clear()
    with pytest.raises(RuntimeError, match="replay failed"):
        pieces.replay()
    assert fake_graphs == ["replay graph1", "joined"]


def test_ending_without_a_graph_being_captured_is_an_error(fake_graphs: list[str]) -> None:
    pieces = Pieces(pool=(0, 0))
    with pytest.raises(AssertionError, match="no graph"):
        pieces.end()
    assert torch.cuda.CUDAGraph is FakeGraph
