"""How long a window takes as a function of its rows and sequences, learned from the windows that ran."""

from __future__ import annotations


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve the 3x3 system m x = v by Gaussian elimination; None when it is (nearly) singular."""
    a = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][3] / a[i][i] for i in range(3)]


class WindowCost:
    """Fits seconds = fixed + per_row * rows + per_sequence * sequences by weighted least squares.

    Recent windows weigh more (`decay` per window), so the fit follows the machine and the context lengths. A
    window pays per row (projections, experts) and per sequence in it (attention and recurrent-state work run
    once per sequence). Until windows of two different sizes have run, `calibrated` is False; while rows and
    sequences cannot be told apart, the per-sequence cost is taken as 0.
    """

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._fit: tuple[float, float, float] | None = None

    def observe(self, rows: int, sequences: int, seconds: float) -> None:
        """Add one window's size and duration."""
        x = (1.0, float(rows), float(sequences))
        for i in range(3):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        solution = _solve3(self._xtx, self._xty)
        if solution is not None and solution[1] > 0 and solution[2] >= 0:
            self._fit = (max(solution[0], 0.0), solution[1], solution[2])
            return
        # Windows of only two shapes (say a prompt alone, then the same chunk beside the same decode rows)
        # cannot separate rows from sequences: fit fixed + per_row alone until they can.
        (a, b), (c, d) = self._xtx[0][:2], self._xtx[1][:2]
        det = a * d - b * c
        if abs(det) < 1e-12:
            self._fit = None
            return
        fixed = (d * self._xty[0] - b * self._xty[1]) / det
        per_row = (a * self._xty[1] - c * self._xty[0]) / det
        self._fit = (max(fixed, 0.0), per_row, 0.0) if per_row > 0 else None

    @property
    def calibrated(self) -> bool:
        """True once the fixed, per-row and per-sequence costs are known."""
        return self._fit is not None

    def predict(self, rows: int, sequences: int) -> float:
        """Expected seconds of a window (requires `calibrated`)."""
        fixed, per_row, per_sequence = self._require()
        return fixed + per_row * rows + per_sequence * sequences

    def rows_within(self, seconds: float) -> int:
        """The most rows one more sequence may add to a window within `seconds` (requires `calibrated`)."""
        _, per_row, per_sequence = self._require()
        return max(int((seconds - per_sequence) / per_row), 0)

    def _require(self) -> tuple[float, float, float]:
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
