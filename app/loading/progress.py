"""Loading progress: a one-line bar on the terminal (stderr, silent off a terminal), and the listeners told
of it (the engine process forwards it to the server, whose loading page shows it)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

Listener = Callable[[int, int, str], None]  # (done, total, label)
_listeners: list[Listener] = []


def listen(listener: Listener) -> None:
    """Call `listener(done, total, label)` whenever a bar of this process redraws (at most 10 times a
    second), and once as it ends."""
    _listeners.append(listener)


def stage(label: str) -> None:
    """Tell the listeners of a step with no count (what the engine does after loading: `label`)."""
    for listener in _listeners:
        listener(0, 0, label)


class Progress:
    """Counts steps (or bytes) towards a total and redraws `label  42% [#####     ] 21/50` at most 10 times
    a second (with `unit="bytes"`: `... 12.6/30.0 GB, 6.1 GB/s`)."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30, unit: str = "") -> None:
        self.total = max(total, 1)
        self.label = label
        self.width = width
        self.unit = unit
        self.done = 0
        self.enabled = enabled
        self.drawn = enabled and sys.stderr.isatty()
        self._started = time.monotonic()
        self._last = 0.0

    def advance(self, steps: int = 1) -> None:
        """Count steps; redraw when enough time has passed."""
        self.done += steps
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            for listener in _listeners:
                listener(self.done, self.total, self.label)
            if self.drawn:
                sys.stderr.write(f"\r{self.line(now)}")
                sys.stderr.flush()

    def line(self, now: float) -> str:
        """The bar as drawn at `now`."""
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + " " * (self.width - filled)
        percent = 100 * min(self.done, self.total) // self.total
        if self.unit == "bytes":
            rate = self.done / max(now - self._started, 1e-6) / 1e9
            count = f"{self.done / 1e9:.1f}/{self.total / 1e9:.1f} GB, {rate:.1f} GB/s"
        else:
            count = f"{self.done}/{self.total}"
        return f"{self.label} {percent:3d}% [{bar}] {count}"

    def close(self) -> None:
        """End the bar's line."""
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
