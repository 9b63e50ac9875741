"""Speed-predictor interface, registry and input rules.

A predictor is fed one worker's speed (samples/s) once per iteration, together with the
exogenous inputs measured in that iteration (``Telemetry.exog``, in
``ps_common.report.EXOG_KEYS`` order), and forecasts the speed of the next iteration. The
BatchSizeManager turns those forecasts into batch sizes, so a forecast must always be usable:
once a predictor has seen one speed, :meth:`Predictor.predict` returns a finite, positive number
whatever the model inside does (it falls back to the last observed speed).

Input rules (the same for every predictor, enforced here so subclasses cannot forget them):

* ``value`` must be finite and > 0, otherwise :meth:`Predictor.update` raises ``ValueError``
  and the state is left unchanged. A zero or negative speed is a measurement bug upstream; silently
  feeding it to a model would poison its window for many iterations.
* ``exog`` is ``None`` or a fixed-length vector of finite numbers; ``None`` means "not measured"
  and is treated as zeros by predictors that use it. The length is fixed by the first vector seen
  (or by a predictor's ``n_exog``); another length raises ``ValueError``.
* Before the first update, :meth:`Predictor.predict` returns ``nan`` ("no estimate yet"), so a
  caller can use its own prior for a worker that has just joined.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ps_common.registry import Registry

log = logging.getLogger(__name__)


class Predictor(ABC):
    """One worker's next-iteration speed forecaster.

    Subclasses implement :meth:`_update`, :meth:`_predict` and :meth:`_reset`; the public methods
    here validate inputs and guarantee a finite, positive forecast (falling back to the last
    observed speed), so a faulty model can cost accuracy but never a bad batch size.
    """

    name: str = "?"

    def __init__(self) -> None:
        self._last: float | None = None
        self._n: int = 0
        self._n_exog: int | None = None

    # ----------------------------------------------------------------------------- public API
    @property
    def last_value(self) -> float | None:
        """The newest observed speed (None before the first update)."""
        return self._last

    @property
    def n_updates(self) -> int:
        """Number of accepted observations since construction or :meth:`reset`."""
        return self._n

    def update(self, value: float, exog: Sequence[float] | None = None) -> None:
        """Record the speed of iteration t and the exogenous inputs measured with it."""
        v = float(value)
        if not math.isfinite(v) or v <= 0.0:
            raise ValueError(f"{self.name}: speed must be finite and > 0, got {value!r}")
        x = self._check_exog(exog)
        self._update(v, x)
        self._last = v
        self._n += 1

    def predict(self) -> float:
        """Forecast the speed of iteration t+1; ``nan`` before the first update."""
        if self._last is None:
            return math.nan
        try:
            p = float(self._predict())
        except Exception:  # a model bug must not stop training; the last value is a safe answer
            log.exception("%s: prediction failed; using the last value", self.name)
            return self._last
        if not math.isfinite(p) or p <= 0.0:
            log.debug("%s: non-usable forecast %r; using the last value", self.name, p)
            return self._last
        return p

    def reset(self) -> None:
        """Forget all observations and fitted state (hyper-parameters are kept)."""
        self._last = None
        self._n = 0
        self._n_exog = None
        self._reset()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, n_updates={self._n})"

    # ------------------------------------------------------------------------- for subclasses
    @abstractmethod
    def _update(self, value: float, exog: np.ndarray | None) -> None:
        """Consume a validated observation (``exog`` is None or a float64 vector)."""

    @abstractmethod
    def _predict(self) -> float:
        """Raw forecast; only called after at least one update. May return anything."""

    @abstractmethod
    def _reset(self) -> None:
        """Drop subclass state."""

    def _check_exog(self, exog: Sequence[float] | None) -> np.ndarray | None:
        if exog is None:
            return None
        x = np.asarray(exog, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{self.name}: exogenous inputs must be finite, got {list(x)}")
        if self._n_exog is None:
            self._n_exog = int(x.size)
        elif x.size != self._n_exog:
            raise ValueError(f"{self.name}: expected {self._n_exog} exogenous inputs, got {x.size}")
        return x


def clip_to_band(forecast: float, last: float, low: float, high: float) -> float:
    """Clamp a model forecast to ``[low * last, high * last]``.

    Speeds change by bounded factors between iterations; a forecast far outside that band is a
    model artefact (extrapolation, a bad fit) and would move a large share of the global batch.
    """
    if not math.isfinite(forecast):
        return last
    return min(max(forecast, low * last), high * last)


class BaselineGate:
    """Use a model's forecast only while it has recently beaten the last value.

    On real contention traces (random co-tenants starting and stopping) the last value is hard to
    beat and a fitted model can be much worse for a while after a regime change (ARIMA pulls
    towards the window mean; a network extrapolates). The gate keeps exponentially weighted means
    (weight ``decay`` on the past) of both forecasts' squared log errors and answers "use the model"
    only while the model's is smaller, so the model costs little where it does not help (ties,
    including the start, go to the last value: a model has to earn its use).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not (0.0 <= decay < 1.0):
            raise ValueError(f"gate decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.reset()

    def reset(self) -> None:
        self.model_err = 0.0
        self.last_err = 0.0

    def observe(self, value: float, model_forecast: float | None, last_forecast: float | None) -> None:
        """Score the forecasts both made for ``value`` (positive numbers; None: no forecast made)."""
        if model_forecast is None or last_forecast is None:
            return
        lv = math.log(value)
        a = self.decay
        self.model_err = a * self.model_err + (1 - a) * (math.log(model_forecast) - lv) ** 2
        self.last_err = a * self.last_err + (1 - a) * (math.log(last_forecast) - lv) ** 2

    def use_model(self) -> bool:
        return self.model_err < self.last_err


def check_band(name: str, low: float, high: float) -> None:
    """Validate a clip band ``0 < low <= 1 <= high``."""
    if not (0.0 < low <= 1.0 <= high) or not math.isfinite(high):
        raise ValueError(f"{name}: clip band must satisfy 0 < clip_low <= 1 <= clip_high, "
                         f"got ({low}, {high})")


class GatedModelPredictor(Predictor):
    """A model-based predictor whose forecast is used only while the gate trusts it.

    Subclasses keep ``_last`` (newest value), ``_forecast`` (the model's next value or None),
    ``gate`` (on/off) and ``_gate`` (a :class:`BaselineGate`).
    """

    _last: float | None
    _forecast: float | None
    gate: bool
    _gate: BaselineGate

    def _predict(self) -> float:
        last = self._last
        assert last is not None
        if self._forecast is None or (self.gate and not self._gate.use_model()):
            return last
        return self._forecast


# ---------------------------------------------------------------------------------- registry
#: Predictor classes by name; add one with ``@register_predictor(name)``.
PREDICTOR_REGISTRY: Registry[type[Predictor]] = Registry("predictor", base=Predictor)
register_predictor = PREDICTOR_REGISTRY.register
predictor_names = PREDICTOR_REGISTRY.names


def get_predictor(name: str, **kwargs: Any) -> Predictor:
    """Build a registered predictor; ``kwargs`` are its hyper-parameters.

    Unknown names and bad hyper-parameters raise ``ValueError`` naming the predictor, so a config
    typo fails at start-up with a message that says what to fix.
    """
    return PREDICTOR_REGISTRY.create(name, **kwargs)
