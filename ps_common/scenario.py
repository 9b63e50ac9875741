"""Heterogeneity scenarios: how each worker is slowed, as config plus a pure runtime.

A scenario says, per worker, which slowdowns apply. Two kinds exist and reports keep them apart:

* **Emulated** (``slowdown``, ``steps``, ``bursts``, ``random``, ``trace``, ``comm_delay_ms``,
  ``comm_bandwidth_mb_s``): the worker sleeps. A compute slowdown factor f means "sleep
  (f - 1) x the measured compute time", so the iteration takes f times as long.
* **Real** (``cpu_load``): CPU-burning processes run beside the worker and steal its cycles.

Combination rule: the emulated factor in force is the **product** of the static factor, the
factor of the step schedule, every active burst, every active random on/off entry and the trace
value. Every factor is >= 1, so the product is >= 1. Real load adds up: the number of burner
processes is the **sum** of the ``processes`` of every active ``cpu_load`` entry.

Everything here is pure: the runtime is a function of (iteration, seconds since the worker's
time origin) and of the config; it owns no clock, sleeps never and starts no process. Random
on/off schedules depend only on (seed, mean_on_s, mean_off_s, start_on), so every mode in a
comparison meets the same schedule; identical parameters give identical switch times (use that
to hit two workers with one co-tenant; use different seeds for independent schedules).

This module must not import :mod:`ps_common.config` (that module imports this one).
"""

from __future__ import annotations

import bisect
import csv
import math
import threading
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ScenarioError(ValueError):
    """A scenario problem found at runtime (e.g. an unreadable trace), naming the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _factor() -> Any:
    return Field(ge=1.0, allow_inf_nan=False, description="slowdown factor, >= 1")


def _seconds() -> Any:
    return Field(gt=0.0, allow_inf_nan=False)


PositiveFactor = Annotated[float, Field(ge=1.0, allow_inf_nan=False)]


def _one_or_many(v: Any) -> Any:
    """Accept one mapping where a list of them is expected."""
    if v is None:
        return ()
    if isinstance(v, dict):
        return (v,)
    return v


# ---------------------------------------------------------------------------------------------
# Config models


class StepChange(_Strict):
    """From this point on, the step schedule's factor is ``slowdown``.

    Exactly one trigger: ``at_iteration`` (the worker's iteration number) or ``at_seconds``
    (seconds since the worker's time origin).
    """

    at_iteration: Optional[int] = Field(None, ge=0)
    at_seconds: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    slowdown: float = _factor()

    @model_validator(mode="after")
    def _one_trigger(self) -> "StepChange":
        if (self.at_iteration is None) == (self.at_seconds is None):
            raise ValueError("give exactly one of at_iteration or at_seconds")
        return self


class _Periodic(_Strict):
    """On during [phase_s + k*period_s, phase_s + k*period_s + duration_s)."""

    period_s: float = _seconds()
    duration_s: float = _seconds()
    phase_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fits(self) -> Any:
        if self.duration_s > self.period_s:
            raise ValueError(f"duration_s ({self.duration_s}) must not exceed period_s ({self.period_s})")
        return self


class Burst(_Periodic):
    """Periodic contention: ``slowdown`` while on."""

    slowdown: float = _factor()


class OnOff(_Strict):
    """Random on/off contention: alternating exponential durations, seeded.

    The first interval is "off" unless ``start_on``; time 0 is the worker's time origin.
    """

    seed: int = Field(ge=0)
    mean_on_s: float = _seconds()
    mean_off_s: float = _seconds()
    start_on: bool = False


class RandomSlowdown(OnOff):
    slowdown: float = _factor()


class Trace(_Strict):
    """A slowdown factor read from a CSV file with a header row.

    The value in force at x (an iteration or seconds, per ``by``) is that of the last row whose
    key is <= x; before the first key it is 1. With ``loop`` the trace repeats with period
    last_key + (last_key - previous_key); without it the last value holds. ``values: speed``
    reads a recorded speed trace (e.g. samples/s) and uses max(speed) / speed as the factor.
    Relative paths resolve against the base directory given at runtime.
    """

    path: str = Field(min_length=1)
    by: Literal["iteration", "seconds"] = "iteration"
    column: str = "slowdown"
    key_column: Optional[str] = Field(None, description="default: the value of `by`")
    values: Literal["slowdown", "speed"] = "slowdown"
    loop: bool = False


class CpuLoad(_Strict):
    """Real co-located load: ``processes`` CPU burners while active.

    Active inside the window [start_s, stop_s) (default: always) and, when ``random`` is given,
    only while its on/off schedule is on.
    """

    processes: int = Field(1, ge=1, le=256)
    start_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    stop_s: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    random: Optional[OnOff] = None

    @model_validator(mode="after")
    def _window(self) -> "CpuLoad":
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise ValueError(f"stop_s ({self.stop_s}) must be after start_s ({self.start_s})")
        return self


# ----- real mechanisms: kernel CPU quotas and shaped links (applied by ps-launch) ----------------


def _fraction() -> Any:
    return Field(None, gt=0.0, le=1024.0, allow_inf_nan=False,
                 description="a fraction of one core (0.5 = half a core); null = unlimited")


class QuotaStep(_Strict):
    """From ``at_seconds`` on, the quota is ``fraction`` (null: unlimited)."""

    at_seconds: float = Field(ge=0.0, allow_inf_nan=False)
    fraction: Optional[float] = _fraction()


class QuotaBurst(_Periodic):
    """Periodic throttling: ``fraction`` of a core while on."""

    fraction: float = Field(gt=0.0, le=1024.0, allow_inf_nan=False)


class QuotaRandom(OnOff):
    """Seeded random throttling: ``fraction`` while the on/off schedule is on."""

    fraction: float = Field(gt=0.0, le=1024.0, allow_inf_nan=False)


class QuotaTrace(_Strict):
    """A quota read from a CSV file (``key_column`` seconds, ``column`` fractions of a core;
    <= 0 or empty = unlimited). The last row's value holds, or the trace repeats with ``loop``."""

    path: str = Field(min_length=1)
    column: str = "fraction"
    key_column: str = "seconds"
    loop: bool = False


class CpuQuota(_Strict):
    """A kernel-enforced share of a core for the worker's process (cgroup cpu controller), like a
    smaller VM. The share in force is the smallest of: the static ``fraction`` (or the last step
    reached), every active burst or random entry, the trace, the scenario's rotation."""

    fraction: Optional[float] = _fraction()
    steps: tuple[QuotaStep, ...] = ()
    bursts: tuple[QuotaBurst, ...] = ()
    random: tuple[QuotaRandom, ...] = ()
    trace: Optional[QuotaTrace] = None

    @model_validator(mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"fraction": v}
        if isinstance(v, dict):
            v = dict(v)
            for k in ("steps", "bursts", "random"):
                if k in v:
                    v[k] = _one_or_many(v[k])
        return v

    @model_validator(mode="after")
    def _ordered(self) -> "CpuQuota":
        times = [s.at_seconds for s in self.steps]
        if times != sorted(times):
            raise ValueError("steps must be listed in the order they happen (at_seconds increasing)")
        return self


class Rotation(_Strict):
    """The slow role moves between workers: in period k (``period_s`` long), worker i gets
    ``fractions[(i + k) % len(fractions)]`` of a core (null = unlimited)."""

    period_s: float = _seconds()
    fractions: tuple[Optional[float], ...] = Field(min_length=1)

    @field_validator("fractions")
    @classmethod
    def _positive(cls, v: tuple[Optional[float], ...]) -> tuple[Optional[float], ...]:
        for f in v:
            if f is not None and not (0 < f <= 1024 and math.isfinite(f)):
                raise ValueError(f"fractions must be > 0 (or null for unlimited), got {f}")
        return v


class LinkStep(_Strict):
    """From ``at_seconds`` on, the worker's link has this rate and delay (each optional: the
    previous value holds)."""

    at_seconds: float = Field(ge=0.0, allow_inf_nan=False)
    rate_mbit: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    delay_ms: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    unlimited: bool = Field(False, description="lift the rate limit from here on")


class Link(_Strict):
    """A real link: the worker runs in a network namespace of its own behind a veth with a tc
    rate limit (``rate_mbit``, both directions) and a delay stage (``delay_ms`` each way)."""

    rate_mbit: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    delay_ms: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    steps: tuple[LinkStep, ...] = ()

    @field_validator("steps", mode="before")
    @classmethod
    def _wrap(cls, v: Any) -> Any:
        return _one_or_many(v)


class WorkerScenario(_Strict):
    """How one worker is slowed. Every part is optional; the empty scenario slows nothing."""

    slowdown: Optional[float] = Field(None, ge=1.0, allow_inf_nan=False,
                                      description="static factor (emulated); default 1")
    steps: tuple[StepChange, ...] = ()
    bursts: tuple[Burst, ...] = ()
    random: tuple[RandomSlowdown, ...] = ()
    trace: Optional[Trace] = None
    cpu_load: tuple[CpuLoad, ...] = ()
    comm_delay_ms: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                                 description="added delay per message sent (emulated)")
    comm_bandwidth_mb_s: Optional[float] = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="emulated link bandwidth: adds nbytes / bandwidth per message sent")
    cpu_quota: Optional[CpuQuota] = Field(None, description="real: a kernel CPU quota (ps-launch, root)")
    link: Optional[Link] = Field(None, description="real: a shaped link in a network namespace (ps-launch, root)")
    memory_limit_mb: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description="real: this worker's memory limit for training (overrides worker.memory_limit_mb)")

    @field_validator("steps", "bursts", "random", "cpu_load", mode="before")
    @classmethod
    def _wrap(cls, v: Any) -> Any:
        return _one_or_many(v)

    @model_validator(mode="after")
    def _ordered_steps(self) -> "WorkerScenario":
        for kind in ("at_iteration", "at_seconds"):
            last: tuple[int, float] | None = None
            for k, s in enumerate(self.steps):
                v = getattr(s, kind)
                if v is None:
                    continue
                if last is not None and v < last[1]:
                    raise ValueError(f"steps.{k}.{kind} ({v}) comes before steps.{last[0]}.{kind} "
                                     f"({last[1]}); list steps in the order they happen")
                last = (k, v)
        return self

    @property
    def static_slowdown(self) -> float:
        return 1.0 if self.slowdown is None else float(self.slowdown)

    def runtime(self, worker_index: int = 0, base_dir: str | Path | None = None) -> "ScenarioRuntime":
        """The pure runtime; reads the trace file now (errors name the key)."""
        return ScenarioRuntime(self, worker_index, base_dir)


class ScenarioConfig(_Strict):
    """``scenario:`` section. ``workers`` is indexed by worker index (a list, or a mapping
    {index: spec}); missing workers are not slowed. ``slowdowns: [1, 1, 2, 4]`` is shorthand for
    per-worker static factors and may be combined with ``workers`` when they do not both set
    the same worker's ``slowdown``."""

    name: str = "none"
    slowdowns: Optional[tuple[PositiveFactor, ...]] = None
    workers: tuple[WorkerScenario, ...] = ()
    rotation: Optional[Rotation] = Field(None, description="real: CPU quotas whose slow role moves between workers")
    hosts: bool = Field(False, description="real: every process on a host (network namespace) of its "
                                           "own, even without shaped links")

    @field_validator("workers", mode="before")
    @classmethod
    def _mapping_to_list(cls, v: Any) -> Any:
        if v is None:
            return ()
        if not isinstance(v, dict):
            return v
        out: dict[int, Any] = {}
        for key, spec in v.items():
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"worker index {key!r} is not an integer") from None
            if idx < 0 or idx > 100_000:
                raise ValueError(f"worker index {key!r} out of range")
            if idx in out:
                raise ValueError(f"worker index {idx} given twice")
            out[idx] = {} if spec is None else spec
        n = max(out) + 1 if out else 0
        return [out.get(i, {}) for i in range(n)]

    @model_validator(mode="after")
    def _no_conflict(self) -> "ScenarioConfig":
        if self.slowdowns:
            for k, w in enumerate(self.workers[:len(self.slowdowns)]):
                if w.slowdown is not None:
                    raise ValueError(f"workers.{k}.slowdown and slowdowns.{k} are both set; keep one")
        return self

    def for_worker(self, index: int) -> WorkerScenario:
        """The scenario of worker ``index`` (the shorthand merged in); empty when not listed."""
        if index < 0:
            raise ValueError(f"worker index must be >= 0, got {index}")
        w = self.workers[index] if index < len(self.workers) else WorkerScenario()
        if self.slowdowns and index < len(self.slowdowns) and w.slowdown is None:
            w = w.model_copy(update={"slowdown": float(self.slowdowns[index])})
        return w

    def num_listed(self) -> int:
        """How many worker indices the scenario mentions (0 for the empty scenario)."""
        return max(len(self.workers), len(self.slowdowns or ()))

    def labels(self, num_workers: int | None = None) -> dict[str, Any]:
        """Labels for reports, derived from content (a config cannot hide an emulation).

        ``emulated``: some worker sleeps (compute or communication); ``real_load``: some worker
        gets CPU burners; ``emulated_comm``: some worker has an added communication delay.
        """
        n = self.num_listed() if num_workers is None else num_workers
        ws = [self.for_worker(i) for i in range(n)]
        return {
            "scenario": self.name,
            "emulated": any(_emulated_compute(w) or _emulated_comm(w) for w in ws),
            "emulated_comm": any(_emulated_comm(w) for w in ws),
            "real_load": any(bool(w.cpu_load) for w in ws),
            "real_quota": self.rotation is not None or any(w.cpu_quota is not None for w in ws),
            "real_link": any(w.link is not None for w in ws),
        }

    def needs_quotas(self, num_workers: int) -> bool:
        return self.rotation is not None or any(
            self.for_worker(i).cpu_quota is not None for i in range(num_workers))

    def needs_hosts(self, num_workers: int) -> bool:
        return self.hosts or any(self.for_worker(i).link is not None for i in range(num_workers))

    def describe(self, num_workers: int | None = None) -> str:
        n = self.num_listed() if num_workers is None else num_workers
        lines = [f"scenario {self.name!r}"]
        lines += [f"  {describe_worker(self.for_worker(i), i)}" for i in range(n)]
        return "\n".join(lines)

    def resolved(self, base_dir: str | Path) -> "ScenarioConfig":
        """A copy whose relative trace paths are made absolute against ``base_dir`` (call it
        where the config file's directory is known, before handing the config to workers)."""
        workers = []
        for w in self.workers:
            if w.trace is not None and not Path(w.trace.path).is_absolute():
                p = str((Path(base_dir) / w.trace.path).resolve())
                w = w.model_copy(update={"trace": w.trace.model_copy(update={"path": p})})
            q = w.cpu_quota
            if q is not None and q.trace is not None and not Path(q.trace.path).is_absolute():
                p = str((Path(base_dir) / q.trace.path).resolve())
                w = w.model_copy(update={"cpu_quota": q.model_copy(
                    update={"trace": q.trace.model_copy(update={"path": p})})})
            workers.append(w)
        return self.model_copy(update={"workers": tuple(workers)})


def _emulated_compute(w: WorkerScenario) -> bool:
    return (w.static_slowdown != 1.0 or any(s.slowdown != 1.0 for s in w.steps)
            or bool(w.bursts) or bool(w.random) or w.trace is not None)


def _emulated_comm(w: WorkerScenario) -> bool:
    return w.comm_delay_ms > 0 or w.comm_bandwidth_mb_s is not None


def _fmt(x: float) -> str:
    return f"{x:g}"


def describe_worker(w: WorkerScenario, index: int) -> str:
    parts: list[str] = []
    if w.static_slowdown != 1.0:
        parts.append(f"static x{_fmt(w.static_slowdown)}")
    if w.steps:
        steps = ", ".join(
            (f"it>={s.at_iteration}" if s.at_iteration is not None else f"t>={_fmt(s.at_seconds or 0)}s")
            + f": x{_fmt(s.slowdown)}" for s in w.steps)
        parts.append(f"steps [{steps}]")
    for b in w.bursts:
        parts.append(f"bursts x{_fmt(b.slowdown)} for {_fmt(b.duration_s)}s every "
                     f"{_fmt(b.period_s)}s (phase {_fmt(b.phase_s)}s)")
    for r in w.random:
        parts.append(f"random x{_fmt(r.slowdown)} (seed {r.seed}, on {_fmt(r.mean_on_s)}s / off "
                     f"{_fmt(r.mean_off_s)}s mean)")
    if w.trace is not None:
        t = w.trace
        parts.append(f"trace {t.path} by {t.by} ({t.values} column {t.column!r}"
                     f"{', loop' if t.loop else ''})")
    for c in w.cpu_load:
        window = (f"{_fmt(c.start_s)}-{_fmt(c.stop_s)}s" if c.stop_s is not None
                  else f"from {_fmt(c.start_s)}s")
        rnd = (f", random seed {c.random.seed} on {_fmt(c.random.mean_on_s)}s / off "
               f"{_fmt(c.random.mean_off_s)}s" if c.random else "")
        parts.append(f"cpu load {c.processes} proc {window}{rnd} [real]")
    if w.cpu_quota is not None:
        q = w.cpu_quota
        bits = [f"{_fmt(q.fraction)} core" if q.fraction is not None else "unlimited"]
        bits += [f"t>={_fmt(st.at_seconds)}s: {_fmt(st.fraction) if st.fraction else 'unlimited'}" for st in q.steps]
        bits += [f"{_fmt(b.fraction)} for {_fmt(b.duration_s)}s every {_fmt(b.period_s)}s" for b in q.bursts]
        bits += [f"random {_fmt(r.fraction)} (seed {r.seed})" for r in q.random]
        if q.trace is not None:
            bits.append(f"trace {q.trace.path}")
        parts.append("cpu quota " + ", ".join(bits) + " [real]")
    if w.link is not None:
        ln = w.link
        text = f"link {_fmt(ln.rate_mbit) + ' Mbit/s' if ln.rate_mbit else 'unshaped'}"
        if ln.delay_ms:
            text += f" +{_fmt(ln.delay_ms)} ms"
        text += "".join(f"; t>={_fmt(st.at_seconds)}s: "
                        + ("unlimited" if st.unlimited else f"{_fmt(st.rate_mbit)} Mbit/s" if st.rate_mbit else "")
                        + (f" +{_fmt(st.delay_ms)} ms" if st.delay_ms is not None else "") for st in ln.steps)
        parts.append(text + " [real]")
    if w.memory_limit_mb is not None:
        parts.append(f"memory {_fmt(w.memory_limit_mb)} MB [real]")
    if _emulated_comm(w):
        comm = f"+{_fmt(w.comm_delay_ms)}ms/msg"
        if w.comm_bandwidth_mb_s is not None:
            comm += f" at {_fmt(w.comm_bandwidth_mb_s)} MB/s"
        parts.append(f"comm {comm}")
    tag = " [emulated]" if (_emulated_compute(w) or _emulated_comm(w)) else ""
    return f"worker {index}: " + ("; ".join(parts) if parts else "no slowdown") + tag


# ---------------------------------------------------------------------------------------------
# Pure runtime


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
        return _emulated_compute(self.spec) or _emulated_comm(self.spec)

    @property
    def emulates_compute(self) -> bool:
        return _emulated_compute(self.spec)

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
    """Shortcut: ``scenario.for_worker(i).runtime(i, base_dir)``."""
    return scenario.for_worker(worker_index).runtime(worker_index, base_dir)


__all__: Sequence[str] = (
    "Burst", "CpuLoad", "OnOff", "OnOffSchedule", "RandomSlowdown", "ScenarioConfig",
    "ScenarioError", "ScenarioRuntime", "StepChange", "Trace", "WorkerScenario",
    "describe_worker", "runtime_for",
)
