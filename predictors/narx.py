"""NARX speed predictor: a one-hidden-layer tanh network over lagged speeds and exogenous inputs.

LB-BSP's CPU-cluster predictor (DESIGN.md section 5): the next speed of a worker depends on its
recent speeds and on what else runs on its host (co-tenant CPU, memory pressure), which the worker
measures each iteration. Inputs at iteration t, to forecast the speed of t+1:

* ``speed_lags`` log-speeds ``log v_t, ..., log v_{t-speed_lags+1}``;
* ``exog_lags`` exogenous vectors ``x_t, ..., x_{t-exog_lags+1}`` (``x_t`` is the "current" one:
  measured during iteration t, known before t+1 starts).

Everything is z-scored with the statistics of the training window. The target is, by default, the
log-ratio ``log v_{t+1} - log v_t`` (``target="ratio"``): most of a speed series is its level,
which the last value already gets right, so the network only has to learn the change; this beat
the raw level (``target="level"``) on the recorded traces (see tests/test_predictors.py and the
``ps-predict eval`` table in the report).

Online training: every ``refit_every`` updates, ``epochs`` full-batch Adam steps (warm-started
from the previous weights, ``weight_decay`` as the only regulariser) on the last ``window``
input/target pairs; the training time is bounded by ``epochs``, and forecasts are a numpy forward
pass computed once per update (``refit_offset`` shifts the refit schedule, so that several
workers' predictors need not all train in the same iteration). Until ``min_train`` pairs exist the forecast is the last value
(memoryless cold start); forecasts are clipped to ``[clip_low, clip_high] * last``, and with
``gate=True`` (default) the network's forecast is used only while its recent one-step errors beat
the last value's (:class:`predictors.base.BaselineGate`). On the recorded contention traces an
ungated network with 60 epochs and weight decay 1e-3 was 35% worse than the last value (it fits
the noise); 30 epochs, weight decay 1e-2 and the gate make it a few % better, while it still cuts
last-value RMSE by 2.5-5x on synthetic periodic and exogenous-driven series.

Everything is deterministic for a given ``seed``. The torch thread count is left alone (the caller
owns it); the network is tiny on purpose. Note for callers on contended hosts: with 2 torch
threads, a 200x8 by 8x10 matrix product measured 40x slower than with 1 thread while other
processes competed for the cores, so a coordinator that runs this should use 1 torch thread.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from itertools import islice
from typing import Any

import numpy as np

from predictors.base import (
    EXOG_KEYS,
    BaselineGate,
    GatedModelPredictor,
    check_band,
    clip_to_band,
    register_predictor,
)

log = logging.getLogger(__name__)


@register_predictor("narx")
class NARXPredictor(GatedModelPredictor):
    """Sliding-window online NARX network (see module docstring)."""

    def __init__(self, speed_lags: int = 2, exog_lags: int = 2, hidden: int = 10,
                 window: int = 200, refit_every: int = 10, epochs: int = 30, lr: float = 0.02,
                 weight_decay: float = 1e-2, min_train: int = 10, target: str = "ratio",
                 n_exog: int = len(EXOG_KEYS), clip_low: float = 0.25, clip_high: float = 4.0,
                 loss: str = "mse", gate: bool = True, gate_decay: float = 0.9, seed: int = 0,
                 refit_offset: int = 0) -> None:
        super().__init__()
        ints = {"speed_lags": speed_lags, "exog_lags": exog_lags, "hidden": hidden, "window": window,
                "refit_every": refit_every, "epochs": epochs, "min_train": min_train,
                "n_exog": n_exog, "seed": seed, "refit_offset": refit_offset}
        for k, v in ints.items():
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"narx: {k} must be an integer, got {v!r}")
        if speed_lags < 1 or exog_lags < 0 or hidden < 1 or refit_every < 1 or epochs < 1 or n_exog < 0:
            raise ValueError("narx: need speed_lags >= 1, exog_lags >= 0, hidden >= 1, "
                             "refit_every >= 1, epochs >= 1, n_exog >= 0")
        if min_train < 2 or window < min_train:
            raise ValueError(f"narx: need 2 <= min_train <= window, got {min_train}, {window}")
        if target not in ("ratio", "level"):
            raise ValueError(f"narx: target must be 'ratio' or 'level', got {target!r}")
        if not (lr > 0 and math.isfinite(lr)) or not (weight_decay >= 0 and math.isfinite(weight_decay)):
            raise ValueError(f"narx: need lr > 0 and weight_decay >= 0, got {lr}, {weight_decay}")
        if loss not in ("mse", "huber"):
            raise ValueError(f"narx: loss must be 'mse' or 'huber', got {loss!r}")
        check_band("narx", clip_low, clip_high)
        self.loss, self.gate = loss, bool(gate)
        self._gate = BaselineGate(gate_decay)
        self.speed_lags, self.exog_lags, self.hidden = int(speed_lags), int(exog_lags), int(hidden)
        self.window, self.refit_every, self.epochs = int(window), int(refit_every), int(epochs)
        self.refit_offset = int(refit_offset) % self.refit_every
        self.min_train, self.n_exog, self.seed = int(min_train), int(n_exog), int(seed)
        self.lr, self.weight_decay, self.target = float(lr), float(weight_decay), target
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.n_inputs = self.speed_lags + self.exog_lags * self.n_exog
        self._lag = max(self.speed_lags, self.exog_lags, 1)  # observations needed for one input row
        self.n_fits = 0
        self._reset()

    # ------------------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._n_exog = self.n_exog if self.n_exog > 0 else None
        keep = self.window + self._lag + 1
        self._logv: deque[float] = deque(maxlen=keep)
        self._x: deque[np.ndarray] = deque(maxlen=keep)
        self._since_fit = 0
        self._tried = False  # a fit was attempted (a diverged one is retried only every refit_every)
        self._net: Any = None  # torch module, built lazily (torch imports only when needed)
        self._np_weights: tuple[np.ndarray, ...] | None = None
        self._stats: tuple[np.ndarray, np.ndarray, float, float] | None = None
        self._forecast: float | None = None  # network forecast of the next speed
        self._gate.reset()

    def _update(self, value: float, exog: np.ndarray | None) -> None:
        self._gate.observe(value, self._forecast, self._last)
        if self.n_exog == 0:
            x = np.zeros(0)
        elif exog is None:
            x = np.zeros(self.n_exog)  # "not measured"
        else:
            x = exog
        self._logv.append(math.log(value))
        self._x.append(x)
        self._since_fit += 1
        n_pairs = len(self._logv) - self._lag
        if n_pairs >= self.min_train and (not self._tried or self._since_fit >= self.refit_every):
            self._fit()
        self._forecast = self._net_forecast(value)

    # ---------------------------------------------------------------------------- features
    def _row(self, logv: np.ndarray, x: np.ndarray, t: int) -> np.ndarray:
        """Raw input row at index t (uses t and earlier)."""
        parts = [logv[t - self.speed_lags + 1:t + 1][::-1]]
        if self.exog_lags and self.n_exog:
            parts.append(x[t - self.exog_lags + 1:t + 1][::-1].reshape(-1))
        return np.concatenate(parts)

    def _dataset(self) -> tuple[np.ndarray, np.ndarray]:
        logv = np.fromiter(self._logv, dtype=np.float64, count=len(self._logv))
        x = np.stack(list(self._x)) if self.n_exog else np.zeros((logv.size, 0))
        ts = range(self._lag - 1, logv.size - 1)
        ts = list(ts)[-self.window:]
        X = np.stack([self._row(logv, x, t) for t in ts])
        nxt = logv[np.array(ts) + 1]
        y = nxt - logv[np.array(ts)] if self.target == "ratio" else nxt
        return X, y

    # ---------------------------------------------------------------------------- training
    def _build(self) -> None:
        import torch

        rng = np.random.default_rng(self.seed)
        net = torch.nn.Sequential(torch.nn.Linear(self.n_inputs, self.hidden, dtype=torch.float64),
                                  torch.nn.Tanh(),
                                  torch.nn.Linear(self.hidden, 1, dtype=torch.float64))
        with torch.no_grad():  # seeded init from our own generator: the global torch RNG is not touched
            for lin in (net[0], net[2]):
                bound = 1.0 / math.sqrt(lin.in_features)
                lin.weight.copy_(torch.from_numpy(rng.uniform(-bound, bound, lin.weight.shape)))
                lin.bias.copy_(torch.from_numpy(rng.uniform(-bound, bound, lin.bias.shape)))
        self._net = net

    def _fit(self) -> None:
        import torch

        self._since_fit = 0 if self._tried else self.refit_offset
        self._tried = True
        X, y = self._dataset()
        mx, sx = X.mean(axis=0), X.std(axis=0)
        sx = np.where(sx > 1e-9, sx, 1.0)  # constant inputs carry no information: leave them at 0
        my, sy = float(y.mean()), float(y.std())
        if sy <= 1e-9:
            sy = 1.0
        if self.target == "ratio":
            my = 0.0  # keep "no change" at exactly 0 so a flat series is predicted exactly
        Xn = torch.from_numpy((X - mx) / sx)
        yn = torch.from_numpy((y - my) / sy).unsqueeze(1)
        if self._net is None:
            self._build()
        net = self._net
        # foreach=False: the per-tensor loop is faster than the fused kernels for four tiny tensors
        opt = torch.optim.Adam(net.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                               foreach=False)
        lossf = torch.nn.functional.mse_loss if self.loss == "mse" else torch.nn.functional.huber_loss
        with torch.enable_grad():
            for _ in range(self.epochs):
                opt.zero_grad(set_to_none=True)
                loss = lossf(net(Xn), yn)
                loss.backward()
                opt.step()
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            log.debug("narx: training diverged; re-initialising, last value until the next refit")
            self._net = None
            self._np_weights = None
            return
        self.n_fits += 1
        self._np_weights = tuple(p.detach().numpy().copy() for p in net.parameters())
        self._stats = (mx, sx, my, sy)

    # ---------------------------------------------------------------------------- forecast
    def _net_forecast(self, last: float) -> float | None:
        """Network forecast of the next speed (numpy forward pass), clipped around ``last``."""
        if self._np_weights is None or self._stats is None:
            return None
        w1, b1, w2, b2 = self._np_weights
        mx, sx, my, sy = self._stats
        k = self._lag
        logv = np.fromiter(islice(self._logv, len(self._logv) - k, None), dtype=np.float64, count=k)
        x = np.stack(list(islice(self._x, len(self._x) - k, None))) if self.n_exog else np.zeros((k, 0))
        row = self._row(logv, x, k - 1)
        h = np.tanh(w1 @ ((row - mx) / sx) + b1)
        out = float((w2 @ h + b2)[0]) * sy + my
        log_next = logv[-1] + out if self.target == "ratio" else out
        f = math.exp(min(log_next, 700.0))
        return clip_to_band(f, last, self.clip_low, self.clip_high) if math.isfinite(f) else None
