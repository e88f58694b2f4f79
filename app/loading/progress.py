"""A one-line progress bar on the terminal (stderr), silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """Counts steps towards a total and redraws `label  42% [#####     ] 21/50` at most 10 times a second."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.width = width
        self.done = 0
        self.enabled = enabled and sys.stderr.isatty()
        self._drawn = 0.0

    def advance(self, steps: int = 1) -> None:
        """Count steps; redraw when enough time has passed."""
        self.done += steps
        now = time.monotonic()
        if self.enabled and (now - self._drawn > 0.1 or self.done >= self.total):
            self._drawn = now
            filled = self.width * self.done // self.total
            bar = "#" * filled + " " * (self.width - filled)
            percent = 100 * self.done // self.total
            sys.stderr.write(f"\r{self.label} {percent:3d}% [{bar}] {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
