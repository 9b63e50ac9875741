"""A worker's heterogeneity scenario at run time: pure answers to "how slow am I now?".

The runtime turns the ``scenario:`` config (:mod:`ps_common.scenario`) into the emulated
slowdown factor, the number of CPU burners and the added communication delay in force at
(iteration, seconds since the worker's time origin). It owns no clock, sleeps never and starts
no process: :mod:`ps_worker.contention` carries its answers out. Random on/off schedules depend
only on (seed, mean_on_s, mean_off_s, start_on), so every mode in a comparison meets the same
schedule; identical parameters give identical switch times (use that to hit two workers with
one co-tenant; use different seeds for independent schedules). The same on/off schedules and
CSV traces drive the lab's real mechanisms (:mod:`ps_launcher.lab.schedule`).
"""

from __future__ import annotations

import bisect
import csv
import math
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ps_common.errors import PsError
from ps_common.scenario import ScenarioConfig, Trace, WorkerScenario, describe_worker


class ScenarioError(PsError, ValueError):
    """A scenario problem found at runtime (e.g. an unreadable trace), naming the key."""


class OnOffSchedule:
    """Deterministic alternating on/off intervals with exponential durations.

    Switch times are generated lazily in fixed-size chunks from a generator seeded only by
    ``seed``, so the answer for any t does not depend on which times were asked before.
    Thread-safe (the worker loop and the contention thread may both ask).
    """

    _CHUNK = 256
    _MAX_SWITCHES = 10_000_000  # a guard against absurd means (e.g. 1 us) over long runs

    def __init__(self, seed: int, mean_on_s: float, mean_off_s: float, start_on: bool = False) -> None:
        self.start_on = start_on
        self._means = (mean_on_s, mean_off_s) if start_on else (mean_off_s, mean_on_s)
        self._rng = np.random.default_rng(seed)
        self._switches: list[float] = []  # _switches[k]: end of interval k (interval 0 from t=0)
        self._lock = threading.Lock()

    def _extend_to(self, t: float) -> None:
        while not self._switches or self._switches[-1] <= t:
            if len(self._switches) >= self._MAX_SWITCHES:
                raise ScenarioError(f"random on/off schedule: more than {self._MAX_SWITCHES} "
                                    f"switches before t={t:g}s; are mean_on_s/mean_off_s too small?")
            draws = self._rng.standard_exponential(self._CHUNK)
            end = self._switches[-1] if self._switches else 0.0
            k0 = len(self._switches)
            for j, d in enumerate(draws):
                end += float(d) * self._means[(k0 + j) % 2]
                self._switches.append(end)

    def is_on(self, t: float) -> bool:
        if t < 0:
            return False
        with self._lock:
            self._extend_to(t)
            k = bisect.bisect_right(self._switches, t)  # index of the interval holding t
        return (k % 2 == 0) == self.start_on

    def switch_times(self, until: float) -> list[float]:
        """Switch times in (0, until]: for tests and reports."""
        with self._lock:
            self._extend_to(until)
            return [s for s in self._switches if s <= until]


class TraceTable:
    """A step function read from a CSV trace: the value of the last key <= x (``before`` until
    the first key); with ``loop`` the trace repeats, one more step long than its last key."""

    def __init__(self, keys: list[float], values: list[Any], loop: bool, before: Any) -> None:
        self.keys, self.values, self.loop, self.before = keys, values, loop, before
        if len(keys) >= 2:
            self.period = float(keys[-1] + (keys[-1] - keys[-2]))
        else:
            self.period = float(keys[-1]) + 1.0

    def at(self, x: float) -> Any:
        if self.loop and x >= self.period:
            x = math.fmod(x, self.period)
        k = bisect.bisect_right(self.keys, x) - 1
        return self.before if k < 0 else self.values[k]


def read_trace(path: Path, key_col: str, col: str, key: str,
               blank: bool = False) -> tuple[list[float], list[float | None]]:
    """Keys and values of a CSV trace, checked: keys finite, >= 0 and strictly increasing,
    values finite (or, with ``blank``, an empty cell read as None). Errors name ``key``."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise ScenarioError(f"{key}.path: cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    if not rows:
        raise ScenarioError(f"{key}.path: trace {str(path)!r} has no data rows")
    for c, name in ((key_col, "key_column"), (col, "column")):
        if c not in rows[0]:
            raise ScenarioError(f"{key}.{name}: trace {str(path)!r} has no column {c!r} "
                                f"(columns: {', '.join(rows[0])})")
    keys: list[float] = []
    vals: list[float | None] = []
    for n, row in enumerate(rows, start=2):
        raw = (row[col] or "").strip()
        try:
            k = float(row[key_col])
            v = None if (blank and raw == "") else float(raw)
        except (TypeError, ValueError):
            raise ScenarioError(f"{key}: {str(path)!r} line {n}: not a number") from None
        if not math.isfinite(k) or (v is not None and not math.isfinite(v)) or k < 0 or (keys and k <= keys[-1]):
            raise ScenarioError(f"{key}: {str(path)!r} line {n}: keys must be finite, >= 0 and "
                                "strictly increasing")
        keys.append(k)
        vals.append(v)
    return keys, vals


def _load_trace(t: Trace, base_dir: str | Path | None, key: str) -> TraceTable:
    path = Path(t.path)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    keys, vals = read_trace(path, t.key_column or t.by, t.column, key)
    values = np.asarray(vals, dtype=float)
    if t.values == "speed":
        if np.any(values <= 0):
            raise ScenarioError(f"{key}.column: speeds in {str(path)!r} must be > 0")
        values = values.max() / values
    elif np.any(values < 1.0):
        bad = int(np.argmax(values < 1.0))
        raise ScenarioError(f"{key}.column: {str(path)!r} line {bad + 2}: slowdown {values[bad]} < 1 "
                            "(use values: speed for a speed trace)")
    return TraceTable(keys, [float(v) for v in values], t.loop, before=1.0)


class ScenarioRuntime:
    """Pure, per-worker answers: slowdown factor, burner count, communication delay.

    Times are seconds since the worker's time origin (the caller owns the clock; use the moment
    the worker got its first assignment, so start-up time does not shift the schedule).
    """

    def __init__(self, spec: WorkerScenario, worker_index: int = 0,
                 base_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.worker_index = worker_index
        self._static = spec.static_slowdown
        self._randoms = [(OnOffSchedule(r.seed, r.mean_on_s, r.mean_off_s, r.start_on), r.slowdown)
                         for r in spec.random]
        self._trace = (None if spec.trace is None else
                       _load_trace(spec.trace, base_dir, f"scenario.workers.{worker_index}.trace"))
        self._loads = [(c, None if c.random is None else
                        OnOffSchedule(c.random.seed, c.random.mean_on_s, c.random.mean_off_s,
                                      c.random.start_on))
                       for c in spec.cpu_load]
        self.comm_delay_s: float = spec.comm_delay_ms / 1000.0
        self._bytes_per_s = (None if spec.comm_bandwidth_mb_s is None
                             else spec.comm_bandwidth_mb_s * 1e6)

    # -- flags -------------------------------------------------------------------------------
    @property
    def is_emulated(self) -> bool:
        """True when this worker sleeps on purpose (compute or communication)."""
        return self.spec.emulates_compute or self.spec.emulates_comm

    @property
    def emulates_compute(self) -> bool:
        return self.spec.emulates_compute

    @property
    def has_real_load(self) -> bool:
        return bool(self.spec.cpu_load)

    # -- compute slowdown --------------------------------------------------------------------
    def step_factor(self, iteration: int, elapsed_s: float) -> float:
        """Steps apply in listed order: a step is in force once its trigger and every earlier
        step's trigger have been reached (the longest reached prefix wins); before that, 1."""
        f = 1.0
        for s in self.spec.steps:
            if s.at_iteration is not None:
                reached = iteration >= s.at_iteration
            else:
                reached = elapsed_s >= (s.at_seconds or 0.0)
            if not reached:
                break
            f = s.slowdown
        return f

    def burst_factor(self, elapsed_s: float) -> float:
        f = 1.0
        for b in self.spec.bursts:
            t = elapsed_s - b.phase_s
            if t >= 0 and math.fmod(t, b.period_s) < b.duration_s:
                f *= b.slowdown
        return f

    def random_factor(self, elapsed_s: float) -> float:
        f = 1.0
        for sched, slow in self._randoms:
            if sched.is_on(elapsed_s):
                f *= slow
        return f

    def trace_factor(self, iteration: int, elapsed_s: float) -> float:
        if self._trace is None:
            return 1.0
        assert self.spec.trace is not None
        return self._trace.at(float(iteration) if self.spec.trace.by == "iteration" else elapsed_s)

    def slowdown(self, iteration: int, elapsed_s: float) -> float:
        """The emulated factor in force: static x steps x bursts x random x trace (>= 1)."""
        return (self._static * self.step_factor(iteration, elapsed_s) * self.burst_factor(elapsed_s)
                * self.random_factor(elapsed_s) * self.trace_factor(iteration, elapsed_s))

    # -- real load ---------------------------------------------------------------------------
    def cpu_processes(self, elapsed_s: float) -> int:
        """Burner processes that should run now: the sum over active ``cpu_load`` entries."""
        n = 0
        for c, sched in self._loads:
            if elapsed_s < c.start_s or (c.stop_s is not None and elapsed_s >= c.stop_s):
                continue
            if sched is not None and not sched.is_on(elapsed_s):
                continue
            n += c.processes
        return n

    # -- communication -----------------------------------------------------------------------
    def message_delay_s(self, nbytes: int = 0) -> float:
        """Delay to add before sending a message of ``nbytes``: comm_delay + nbytes/bandwidth."""
        d = self.comm_delay_s
        if self._bytes_per_s is not None and nbytes > 0:
            d += nbytes / self._bytes_per_s
        return d

    def describe(self) -> str:
        return describe_worker(self.spec, self.worker_index)

    def __repr__(self) -> str:
        return f"ScenarioRuntime({self.describe()})"


def runtime_for(scenario: ScenarioConfig, worker_index: int,
                base_dir: str | Path | None = None) -> ScenarioRuntime:
    """The runtime of worker ``worker_index``: its entry of the scenario (empty when unlisted)."""
    return ScenarioRuntime(scenario.for_worker(worker_index), worker_index, base_dir)


__all__: Sequence[str] = (
    "OnOffSchedule", "ScenarioError", "ScenarioRuntime", "TraceTable", "read_trace", "runtime_for",
)
