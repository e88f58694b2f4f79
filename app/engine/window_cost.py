"""How long a window takes as a function of its rows, sequences and attention pairs, learned from the windows
that ran."""

from __future__ import annotations

import math

PAIRS_UNIT = 1e6  # attention pairs are fitted in millions, near the rows' scale
# the features each fit tries, most first: fixed, per row, per sequence, per attention pair
_SUBSETS = ((0, 1, 2, 3), (0, 1, 3), (0, 1, 2), (0, 1))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve the square system m x = v by Gaussian elimination; None when it is (nearly) singular."""
    n = len(v)
    a = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def chunk_pairs(rows: int, past: int) -> int:
    """The attention pairs of a prompt chunk of `rows` rows after `past` positions: each row attends to the
    past and to the chunk's rows up to itself."""
    return rows * past + rows * (rows + 1) // 2


class WindowCost:
    """Fits seconds = fixed + per_row * rows + per_sequence * sequences + per_pair * pairs by weighted least
    squares.

    Recent windows weigh more (`decay` per window), so the fit follows the machine. A window pays per row
    (projections, experts), per sequence in it (attention and recurrent-state work run once per sequence) and
    per attention pair of its prompt chunks (`chunk_pairs`: a chunk late in a long prompt attends to all of
    it, and costs many times an early one of the same rows). Until windows of two different sizes have run,
    `calibrated` is False; a cost the windows cannot tell apart from the others (say sequences, while every
    window held two) is taken as 0, and a fixed cost that comes out below 0 (windows whose cost grows faster
    than their rows) is fitted again without it rather than clipped.
    """

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._fit: tuple[float, float, float, float] | None = None

    def observe(self, rows: int, sequences: int, seconds: float, pairs: int = 0) -> None:
        """Add one window's size (its prompt chunks' attention `pairs` among it) and duration."""
        x = (1.0, float(rows), float(sequences), pairs / PAIRS_UNIT)
        for i in range(4):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(4):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self._fit = None
        for subset in _SUBSETS:  # the first whose costs are all positive (per row) or not negative
            costs = self._solve_for(subset)
            if costs is not None and costs[0] < 0:
                # refit without the fixed cost: taking it as 0 in this fit would raise every prediction by
                # what it was below 0 (most, relatively, those of small windows)
                costs = self._solve_for(subset[1:])
            if costs is not None and costs[1] > 0 and costs.get(2, 0.0) >= 0 and costs.get(3, 0.0) >= 0:
                self._fit = (costs.get(0, 0.0), costs[1], costs.get(2, 0.0), costs.get(3, 0.0))
                return

    def _solve_for(self, subset: tuple[int, ...]) -> dict[int, float] | None:
        """Weighted least-squares costs of the features in `subset`; None where they cannot be told apart."""
        m = [[self._xtx[i][j] for j in subset] for i in subset]
        solution = _solve(m, [self._xty[i] for i in subset])
        return None if solution is None else dict(zip(subset, solution, strict=True))

    @property
    def calibrated(self) -> bool:
        """True once the fixed and per-row costs are known."""
        return self._fit is not None

    def predict(self, rows: int, sequences: int, pairs: int = 0) -> float:
        """Expected seconds of a window (requires `calibrated`)."""
        fixed, per_row, per_sequence, per_pair = self._require()
        return fixed + per_row * rows + per_sequence * sequences + per_pair * pairs / PAIRS_UNIT

    def rows_within(self, seconds: float, past: int = 0) -> int:
        """The most rows one more sequence may add to a window within `seconds`, read after `past` positions
        (requires `calibrated`)."""
        _, per_row, per_sequence, per_pair = self._require()
        budget = seconds - per_sequence
        if budget <= 0:
            return 0
        # per_row * r + per_pair * (r * past + r * (r + 1) / 2) <= budget, for the largest r
        a = per_pair / PAIRS_UNIT / 2
        b = per_row + per_pair / PAIRS_UNIT * (past + 0.5)
        if a <= 0:
            return int(budget / b)
        return int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))

    def _require(self) -> tuple[float, float, float, float]:
        if self._fit is None:
            raise ValueError("window cost is not calibrated yet")
        return self._fit


class DecodeWindowCost:
    """Seconds of windows that hold only decode rows, per row count (a recency-weighted mean).

    Kept apart from `WindowCost`: on a GPU such windows replay a CUDA graph and cost a fraction of an eager
    window of the same rows, so one linear fit cannot describe both.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """Add one decode-only window's duration."""
        last = self._seconds.get(rows)
        self._seconds[rows] = seconds if last is None else self.decay * last + (1 - self.decay) * seconds

    def predict(self, rows: int) -> float | None:
        """Expected seconds of a decode-only window of `rows` rows (the nearest row count seen), or None."""
        if not self._seconds:
            return None
        nearest = min(self._seconds, key=lambda seen: (abs(seen - rows), seen))
        return self._seconds[nearest]
