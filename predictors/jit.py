"""What the compiled per-iteration steps of the refitting predictors share (numba).

Why compile: a decision paced like a real run finds the CPU's caches cold, and on a shared host
each distinct numpy call then costs tens of µs whatever the array sizes (``bench_decision_cold.py``:
one numpy call after a 50 ms sleep, 60-76 µs against 2.6 µs back to back). A model's update and
forecast written as numpy calls pay that dozens of times per decision; the same arithmetic
compiled is one call whose code and data are small (see :mod:`predictors.narx_kernel` and
:mod:`predictors.arima_kernel` for what each step does and what it saved).

numba is a declared dependency. Where it does not import, :data:`AVAILABLE` is False, the kernels
stay plain (slow) Python functions and the predictors keep their numpy code, which is the
reference the tests hold the kernels to either way. Kernels are compiled on first use and cached
on disk beside their module (``cache=True``: a later process loads them in ~0.1 s).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

try:
    import numba
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    AVAILABLE = False


_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)


def as_int64(a: np.ndarray) -> np.ndarray:
    """``a`` as the C-contiguous int64 array the kernels were compiled for (no copy when it is
    one already): any other dtype or layout would compile a new signature inside a decision
    (about 1 s)."""
    return a if a.dtype == _INT64 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=_INT64)


def as_float64(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous float64 array (see :func:`as_int64`; float32 speeds would also
    take float32 logs)."""
    return a if a.dtype == _FLOAT64 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=_FLOAT64)


def jit(fn: Any = None, **options: Any) -> Any:
    """``numba.njit`` with the disk cache, releasing the GIL (the refit helper may be a thread).
    Where no cache directory is writable (numba then refuses ``cache=True`` at decoration),
    each process compiles its own instead. ``options`` go to numba (``@jit(error_model="numpy")``:
    a division by zero gives inf or nan, as in the numpy code, instead of raising)."""
    if fn is None:
        return lambda f: jit(f, **options)
    if not AVAILABLE:
        return fn
    try:
        return numba.njit(cache=True, nogil=True, **options)(fn)
    except RuntimeError:  # pragma: no cover - "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, **options)(fn)


@jit
def check_slots(slots: np.ndarray, capacity: int) -> None:
    """Compiled code does not check indices: a slot out of range would write anywhere."""
    for i in range(slots.size):
        if slots[i] < 0 or slots[i] >= capacity:
            raise IndexError("slot out of range")


@jit
def record_and_score(s: int, v: float, last: np.ndarray, n: np.ndarray, fc: np.ndarray,
                     merr: np.ndarray, lerr: np.ndarray, decay: float) -> int:
    """One observation ``v`` of slot ``s``: ``BatchPredictor.update``'s bookkeeping (the last
    value, the count, returned) and the gate's scoring of the forecasts made for it, the
    model's against the last value's (``BaselineGate``: decayed mean squared log errors)."""
    prev = last[s]
    last[s] = v
    n[s] += 1
    f = fc[s]
    if math.isfinite(f) and math.isfinite(prev):
        lv = math.log(v)
        merr[s] = decay * merr[s] + (1 - decay) * (math.log(f) - lv) ** 2
        lerr[s] = decay * lerr[s] + (1 - decay) * (math.log(prev) - lv) ** 2
    return n[s]


@jit
def gated_predict(slots: np.ndarray, fc: np.ndarray, merr: np.ndarray, lerr: np.ndarray,
                  last: np.ndarray, gate: bool) -> np.ndarray:
    """The model's forecast where its recent errors beat the last value's (``_predict`` of NARX
    and ARIMA), then ``BatchPredictor.predict``'s guard: finite and > 0, else the last value."""
    check_slots(slots, last.shape[0])
    out = np.empty(slots.size)
    for i in range(slots.size):
        s = slots[i]
        f = fc[s]
        use = math.isfinite(f) and (not gate or merr[s] < lerr[s])
        r = f if use else last[s]
        out[i] = r if (math.isfinite(r) and r > 0.0) else last[s]
    return out
