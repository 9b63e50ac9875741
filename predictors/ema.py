"""Exponential moving average of the speed.

Smooths iteration-to-iteration jitter (non-deterministic stragglers: GC, OS noise) at the price of
lagging behind real changes: after a step it closes a fraction ``alpha`` of the gap per iteration.
"""

from __future__ import annotations

import math

import numpy as np

from predictors.base import Predictor, register_predictor


@register_predictor("ema")
class EMAPredictor(Predictor):
    """``s <- alpha * v + (1 - alpha) * s``, started at the first observation."""

    def __init__(self, alpha: float = 0.3) -> None:
        super().__init__()
        alpha = float(alpha)
        if not (0.0 < alpha <= 1.0) or not math.isfinite(alpha):
            raise ValueError(f"ema: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._s: float | None = None

    def _update(self, value: float, exog: np.ndarray | None) -> None:
        self._s = value if self._s is None else self.alpha * value + (1.0 - self.alpha) * self._s

    def _predict(self) -> float:
        assert self._s is not None
        return self._s

    def _reset(self) -> None:
        self._s = None
