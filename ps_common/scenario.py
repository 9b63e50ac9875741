"""Heterogeneity scenarios as config: the ``scenario:`` section, how each worker is slowed.

A scenario says, per worker, which slowdowns apply. Two kinds exist and reports keep them apart:

* **Emulated** (``slowdown``, ``steps``, ``bursts``, ``random``, ``trace``, ``comm_delay_ms``,
  ``comm_bandwidth_mb_s``): the worker sleeps. A compute slowdown factor f means "sleep
  (f - 1) x the measured compute time", so the iteration takes f times as long.
* **Real** (``cpu_load``): CPU-burning processes run beside the worker and steal its cycles.

Combination rule: the emulated factor in force is the **product** of the static factor, the
factor of the step schedule, every active burst, every active random on/off entry and the trace
value. Every factor is >= 1, so the product is >= 1. Real load adds up: the number of burner
processes is the **sum** of the ``processes`` of every active ``cpu_load`` entry.

The section is part of the job config, which every role loads and checks (a worker's join is
refused when its config differs), so the schema lives here; what it means at run time is
computed by :mod:`ps_worker.scenario_runtime` (the worker's emulated slowdowns and burners) and
:mod:`ps_launcher.lab.schedule` (the lab's CPU quotas and shaped links).

This module must not import :mod:`ps_common.config` (that module imports this one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
    gpu_sm_percent: Optional[int] = Field(
        None, ge=1, le=100,
        description="real: this worker's share of the GPU's SMs in percent (CUDA MPS; a control daemon "
                    "must serve the GPU, see ps_worker/gpu_share.py)")

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

    @property
    def emulates_compute(self) -> bool:
        """This worker sleeps to stretch its compute phase."""
        return (self.static_slowdown != 1.0 or any(s.slowdown != 1.0 for s in self.steps)
                or bool(self.bursts) or bool(self.random) or self.trace is not None)

    @property
    def emulates_comm(self) -> bool:
        """This worker sleeps before each message it sends."""
        return self.comm_delay_ms > 0 or self.comm_bandwidth_mb_s is not None


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
            "emulated": any(w.emulates_compute or w.emulates_comm for w in ws),
            "emulated_comm": any(w.emulates_comm for w in ws),
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
    if w.gpu_sm_percent is not None:
        parts.append(f"GPU SMs {w.gpu_sm_percent}% [real, MPS]")
    if w.emulates_comm:
        comm = f"+{_fmt(w.comm_delay_ms)}ms/msg"
        if w.comm_bandwidth_mb_s is not None:
            comm += f" at {_fmt(w.comm_bandwidth_mb_s)} MB/s"
        parts.append(f"comm {comm}")
    tag = " [emulated]" if (w.emulates_compute or w.emulates_comm) else ""
    return f"worker {index}: " + ("; ".join(parts) if parts else "no slowdown") + tag


__all__: Sequence[str] = (
    "Burst", "CpuLoad", "CpuQuota", "Link", "LinkStep", "OnOff", "QuotaBurst", "QuotaRandom",
    "QuotaStep", "QuotaTrace", "RandomSlowdown", "Rotation", "ScenarioConfig", "StepChange",
    "Trace", "WorkerScenario", "describe_worker",
)
