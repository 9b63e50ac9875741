"""ARIMA(p, d, q) speed predictor: statsmodels fit every ``refit_every`` updates on a sliding window.

Fitting costs tens of milliseconds, so it happens only every ``refit_every`` updates; the
iterations in between reuse the fitted parameters. Two ways to forecast between refits:

* ``between="recursion"`` (default): the one-step ARMA recursion on the differenced series with the
  fitted coefficients and our own innovations (e_t = observed - forecast). It is what the Kalman
  filter settles to for an invertible model, and costs microseconds instead of milliseconds, which
  matters with ~10 workers per iteration.
* ``between="statsmodels"``: ``results.append(new, refit=False).forecast(1)`` (exact state-space
  filtering, a few milliseconds per update).

Until the window holds ``2 * (p + d + q) + 5`` points, when the window is constant, and whenever
statsmodels fails or warns that the fit did not converge, the forecast is the last value (a model
we cannot trust is worse than the memoryless baseline). Forecasts are clipped to
``[clip_low, clip_high] * last``, and with ``gate=True`` (default) the model's forecast is used only
while its recent one-step errors beat the last value's (:class:`predictors.base.BaselineGate`).

``refit_offset`` shifts the refit schedule (0..refit_every-1): give each worker's predictor a
different one so that ~10 workers' refits (tens of ms each) do not all land in one iteration.

Default order (2, 0, 0): on the recorded contention traces the orders we tried were all within a
few % of each other and of the last value; (2, 0, 1) often put the MA root at -1 (convergence
warnings, 2-3x slower fits) without doing better, while AR(2) also captures periodic speed
patterns (it halves last-value RMSE on a noisy 12-iteration sine).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from predictors.base import (BaselineGate, GatedModelPredictor, check_band, clip_to_band,
                             register_predictor)

log = logging.getLogger(__name__)


@register_predictor("arima")
class ARIMAPredictor(GatedModelPredictor):
    """Sliding-window ARIMA with periodic refits (see module docstring)."""

    def __init__(self, order: Sequence[int] = (2, 0, 0), window: int = 100, refit_every: int = 10,
                 log_transform: bool = False, between: str = "recursion",
                 clip_low: float = 0.25, clip_high: float = 4.0, maxiter: int = 50,
                 gate: bool = True, gate_decay: float = 0.9, refit_offset: int = 0) -> None:
        super().__init__()
        try:
            p, d, q = (int(v) for v in order)
        except (TypeError, ValueError):
            raise ValueError(f"arima: order must be three integers (p, d, q), got {order!r}") from None
        if min(p, d, q) < 0 or p + q == 0 or d > 2:
            raise ValueError(f"arima: need p, q >= 0 with p + q >= 1 and 0 <= d <= 2, got {order!r}")
        self.order = (p, d, q)
        self.min_points = 2 * (p + d + q) + 5
        if int(window) < self.min_points:
            raise ValueError(f"arima: window must be >= {self.min_points} for order {self.order}")
        if int(refit_every) < 1:
            raise ValueError(f"arima: refit_every must be >= 1, got {refit_every}")
        if between not in ("recursion", "statsmodels"):
            raise ValueError(f"arima: between must be 'recursion' or 'statsmodels', got {between!r}")
        if int(maxiter) < 1:
            raise ValueError(f"arima: maxiter must be >= 1, got {maxiter}")
        check_band("arima", clip_low, clip_high)
        self.window = int(window)
        self.refit_every = int(refit_every)
        self.refit_offset = int(refit_offset) % self.refit_every
        self.log_transform = bool(log_transform)
        self.between = between
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.maxiter = int(maxiter)
        self.gate = bool(gate)
        self._gate = BaselineGate(gate_decay)
        self.n_fits = 0
        self.n_failed_fits = 0
        self._reset()

    # ------------------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._y: deque[float] = deque(maxlen=self.window)  # transformed observations
        self._since_fit = 0
        self._tried = False  # a fit was attempted (failed fits are retried only every refit_every)
        self._res: Any = None  # statsmodels results (between="statsmodels")
        self._fitted = False
        self._mu = 0.0
        self._ar = np.zeros(0)
        self._ma = np.zeros(0)
        # recursion state on the differenced series w_t = (1 - B)^d y_t - mu
        self._w: deque[float] = deque(maxlen=max(self.order[0], 1))
        self._e: deque[float] = deque(maxlen=max(self.order[2], 1))
        self._w_hat: float | None = None  # forecast of the next w
        self._forecast: float | None = None  # model forecast of the next speed (None: no model)
        self._gate.reset()

    def _tf(self, v: float) -> float:
        return math.log(v) if self.log_transform else v

    def _inv(self, v: float) -> float:
        return math.exp(min(v, 700.0)) if self.log_transform else v

    # ---------------------------------------------------------------------------- updates
    def _update(self, value: float, exog: np.ndarray | None) -> None:
        self._gate.observe(value, self._forecast, self._last)
        y = self._tf(value)
        self._y.append(y)
        self._since_fit += 1
        if self._fitted:
            self._advance(y)
        if len(self._y) >= self.min_points and (not self._tried or self._since_fit >= self.refit_every):
            self._refit()
        self._forecast = self._model_forecast(value) if self._fitted else None

    def _advance(self, y: float) -> None:
        """Feed one new observation to the fitted model without refitting."""
        if self.between == "statsmodels":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._res = self._res.append([y], refit=False)
            except Exception as e:  # noqa: BLE001 - any statsmodels failure means "no model"
                log.debug("arima: append failed (%s); last value until the next refit", e)
                self._fitted = False
            return
        w = self._diff_last(self._y) - self._mu
        if self._w_hat is not None and self.order[2]:
            self._e.append(w - self._w_hat)
        self._w.append(w)
        self._w_hat = self._one_step()

    def _diff_last(self, ys: Sequence[float]) -> float:
        """(1 - B)^d applied at the newest point."""
        d = self.order[1]
        n = len(ys)
        return float(sum((-1) ** k * math.comb(d, k) * ys[n - 1 - k] for k in range(d + 1)))

    def _one_step(self) -> float:
        p, _, q = self.order
        w, e = list(self._w), list(self._e)
        out = 0.0
        for i in range(1, p + 1):
            if len(w) >= i:
                out += self._ar[i - 1] * w[-i]
        for j in range(1, q + 1):
            if len(e) >= j:
                out += self._ma[j - 1] * e[-j]
        return out

    def _refit(self) -> None:
        from statsmodels.tools.sm_exceptions import ConvergenceWarning
        from statsmodels.tsa.arima.model import ARIMA

        self._since_fit = 0 if self._tried else self.refit_offset
        self._tried = True
        data = np.asarray(self._y, dtype=np.float64)
        self._fitted = False
        self._res = None
        if np.ptp(data) <= 1e-12 * max(1.0, abs(float(data[-1]))):
            return  # constant window: nothing to model, the last value is exact
        p, d, q = self.order
        trend = "c" if d == 0 else "n"
        self.n_fits += 1
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # cov_type="none": parameter standard errors (a numerical Hessian) are never used.
                res = ARIMA(data, order=self.order, trend=trend).fit(
                    method_kwargs={"maxiter": self.maxiter}, cov_type="none",
                    low_memory=self.between == "recursion")
            if any(issubclass(w.category, ConvergenceWarning) for w in caught):
                raise RuntimeError("did not converge")
            params = dict(zip(res.model.param_names, np.asarray(res.params, dtype=np.float64)))
            if not all(math.isfinite(v) for v in params.values()):
                raise RuntimeError("non-finite parameters")
        except Exception as e:  # noqa: BLE001 - LinAlgError, ValueError, non-convergence, ...
            self.n_failed_fits += 1
            log.debug("arima: fit failed (%s); last value until the next refit", e)
            return
        self._mu = params.get("const", 0.0)
        self._ar = np.array([params.get(f"ar.L{i}", 0.0) for i in range(1, p + 1)])
        self._ma = np.array([params.get(f"ma.L{j}", 0.0) for j in range(1, q + 1)])
        if self.between == "statsmodels":
            self._res = res
        else:
            self._warm_recursion(data)
        self._fitted = True

    def _warm_recursion(self, data: np.ndarray) -> None:
        """Run the ARMA recursion over the window so the innovations match the new coefficients."""
        d = self.order[1]
        w_all = np.diff(data, n=d) - self._mu if d else data - self._mu
        self._w.clear()
        self._e.clear()
        self._w_hat = None
        for w in w_all:
            if self._w_hat is not None and self.order[2]:
                self._e.append(float(w) - self._w_hat)
            self._w.append(float(w))
            self._w_hat = self._one_step()

    # ---------------------------------------------------------------------------- forecast
    def _model_forecast(self, last: float) -> float | None:
        """The fitted model's forecast of the next speed, clipped to the band around ``last``."""
        if self.between == "statsmodels":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y_next = float(np.asarray(self._res.forecast(1))[0])
            except Exception as e:  # noqa: BLE001
                log.debug("arima: forecast failed (%s)", e)
                return None
        else:
            assert self._w_hat is not None
            d = self.order[1]
            ys = self._y
            n = len(ys)
            # y_{t+1} = w_{t+1} + mu - sum_{k=1..d} (-1)^k C(d,k) y_{t+1-k}
            y_next = self._w_hat + self._mu - sum((-1) ** k * math.comb(d, k) * ys[n - k]
                                                  for k in range(1, d + 1))
        f = self._inv(y_next)
        return clip_to_band(f, last, self.clip_low, self.clip_high) if math.isfinite(f) else None
