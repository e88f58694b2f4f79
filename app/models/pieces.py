"""A forward captured as several CUDA graphs with host steps between them.

A layer whose work needs the host midway (an expert tier reads which routed experts miss the device) cannot
sit inside one graph. Under a piecewise capture it calls `cut(step)`: the graph being captured ends, the next
begins, and `step` (host work that reads the first graph's outputs and writes buffers the next one reads)
runs between the two at every replay. A step may leave work still running that the next graph waits for on
the device (the tier's CPU pool, whose sums the next graph reads once the pool says so): it returns what
finishes that work, called once the next graph has been launched. All graphs share one memory pool and replay
in capture order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Finish = Callable[[], None]
Step = Callable[[], Finish | None]


class Pieces:
    """The graphs of one piecewise-captured forward and the host steps between them."""

    def __init__(self, pool: tuple[int, int]) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.steps: list[Step] = []
        self._open: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        """Start capturing the next graph (on the current stream, which must not be the default one)."""
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool)

    def cut(self, step: Step) -> None:
        """End the graph being captured; `step` runs after it at every replay, then the next graph (then what
        `step` returned, if anything)."""
        self.end()
        self.steps.append(step)
        self.begin()

    def end(self) -> None:
        """End the graph being captured (the last one)."""
        assert self._open is not None, "no graph is being captured"
        self._open.capture_end()
        self.graphs.append(self._open)
        self._open = None

    def replay(self) -> None:
        """Replay every graph in order, each host step after the graph it follows and what a step left to
        finish after the next graph's launch."""
        finish: Finish | None = None
        for i, graph in enumerate(self.graphs):
            try:
                graph.replay()
            finally:  # a step's work is finished whatever happens after it
                if finish is not None:
                    finish()
            finish = self.steps[i]() if i < len(self.steps) else None
