"""How long a window takes as a function of its tokens, learned from the windows that ran."""

from __future__ import annotations


class WindowCost:
    """Fits seconds = fixed + per_token * tokens by exponentially weighted least squares.

    Recent windows weigh more (`decay` per window), so the fit follows the machine and the context length.
    Until two windows of clearly different sizes have run, `per_token` is unknown and `calibrated` is False.
    """

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """Add one window's size and duration."""
        d = self.decay
        self._n = d * self._n + 1
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds

    def _fit(self) -> tuple[float, float] | None:
        if self._n == 0:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var_x = self._sxx / self._n - mean_x * mean_x
        if var_x < 1.0:
            return None
        slope = (self._sxy / self._n - mean_x * mean_y) / var_x
        if slope <= 0:
            return None
        return mean_y - slope * mean_x, slope

    @property
    def calibrated(self) -> bool:
        """True once both the fixed cost and the per-token cost are known."""
        return self._fit() is not None

    def predict(self, tokens: int) -> float:
        """Expected seconds of a window of `tokens` tokens (requires `calibrated`)."""
        fit = self._fit()
        if fit is None:
            raise ValueError("window cost is not calibrated yet")
        fixed, slope = fit
        return max(fixed, 0.0) + slope * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a window can hold and still finish within `seconds` (requires `calibrated`)."""
        fit = self._fit()
        if fit is None:
            raise ValueError("window cost is not calibrated yet")
        fixed, slope = fit
        return max(int((seconds - max(fixed, 0.0)) / slope), 0)
