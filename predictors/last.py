"""Memoryless predictor: the next speed is the last one.

The baseline every other predictor must beat, and the right answer when speed changes are
unpredictable steps (it recovers from a step after exactly one iteration).
"""

from __future__ import annotations

import numpy as np

from predictors.base import Predictor, register_predictor


@register_predictor("last")
class LastValuePredictor(Predictor):
    """Forecast = newest observation. No hyper-parameters."""

    def _update(self, value: float, exog: np.ndarray | None) -> None:
        pass

    def _predict(self) -> float:
        assert self._last is not None
        return self._last

    def _reset(self) -> None:
        pass
