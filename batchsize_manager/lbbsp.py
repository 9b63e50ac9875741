"""LB-BSP batch policies: static load balancing, the analytical CPU rule and the GPU search.

All three are pure decision logic driven by :class:`WorkerReport` s: no clocks, no I/O, no
randomness, so the same reports always give the same splits (tests and replays rely on it).

* ``static``: profile each worker's speed once, then split proportionally for the rest of the run
  (the baseline that isolates the value of being dynamic).
* ``lbbsp-cpu``: predict every worker's speed with a :mod:`predictors` model and solve for equal
  finish times, t_i(x) = x / v_i + c_i (DESIGN.md §5, "CPU clusters").
* ``lbbsp-gpu``: leader/straggler numerical search, for workers whose time is flat below a
  saturation batch and whose memory caps the batch (DESIGN.md §5, "GPU clusters").
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any, Callable, Mapping, Sequence

from batchsize_manager.allocation import (
    CapsArg,
    bounded_split,
    check_feasible,
    finish_time_split,
    resolve_caps,
)
from batchsize_manager.policies import BatchPolicy, WorkerReport, register_policy

log = logging.getLogger(__name__)

#: Telemetry keys whose sum is a worker's fixed (batch-size independent) time per iteration:
#: data loading and the previous iteration's push and pull. ``prev_wait_s`` is left out on
#: purpose: it is time spent idle at the barrier, i.e. the imbalance we are removing.
OVERHEAD_KEYS: tuple[str, ...] = ("data_s", "prev_push_s", "prev_pull_s")


def _num(tel: Mapping[str, Any], key: str) -> float:
    """A non-negative finite telemetry number; missing or malformed entries count as 0."""
    raw = tel.get(key)
    if raw is None:
        return 0.0
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return 0.0
    return v if 0.0 < v < math.inf else 0.0


def is_oom(report: WorkerReport) -> bool:
    """True for a report that says the worker ran out of memory at ``report.batch_size``."""
    return report.telemetry.get("oom") is not None and _num(report.telemetry, "oom") >= 0.5


def fixed_overhead(report: WorkerReport) -> float:
    """data + push + pull seconds of a report (never the barrier wait)."""
    tel = report.telemetry
    return _num(tel, "data_s") + _num(tel, "prev_push_s") + _num(tel, "prev_pull_s")


def measured_speed(report: WorkerReport) -> float | None:
    """Samples per second of compute, or None when the report carries no usable timing."""
    c = report.compute_s
    if report.batch_size <= 0 or not math.isfinite(c) or c <= 0:
        return None
    v = report.batch_size / c
    return v if math.isfinite(v) else None      # a denormal compute time would give inf


def cap_after_oom(batch_size: int, margin: float) -> int:
    """The cap recorded when ``batch_size`` failed: ``margin`` below it, and at least one below.

    A small margin avoids probing the limit one sample at a time (each probe costs an
    iteration); memory use also fluctuates a little between iterations.
    """
    return max(0, min(batch_size - 1, math.floor(batch_size * (1.0 - margin))))


def _str_keys(d: Mapping[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in d.items()}


class CapAwarePolicy(BatchPolicy):
    """Shared handling of memory caps: from config, and learned from out-of-memory reports."""

    def __init__(self, memory_caps: Mapping[Any, int] | None = None, oom_margin: float = 0.05) -> None:
        if not (0.0 <= oom_margin < 1.0):
            raise ValueError(f"oom_margin must be in [0, 1), got {oom_margin}")
        self.oom_margin = float(oom_margin)
        self._config_caps: dict[int, int] = {int(k): int(v) for k, v in (memory_caps or {}).items()}
        if any(v < 0 for v in self._config_caps.values()):
            raise ValueError(f"memory_caps must be >= 0: {self._config_caps}")
        self._oom_caps: dict[int, int] = {}

    def memory_caps(self) -> dict[int, int]:
        caps = dict(self._config_caps)
        for w, c in self._oom_caps.items():
            caps[w] = min(c, caps.get(w, c))
        return caps

    def _note_oom(self, report: WorkerReport) -> bool:
        """Record a cap if ``report`` is an OOM; True if it was (it then has no timing to use)."""
        if not is_oom(report):
            return False
        w = report.worker_id
        cap = cap_after_oom(report.batch_size, self.oom_margin)
        self._oom_caps[w] = min(cap, self._oom_caps.get(w, cap))
        log.warning("worker %d ran out of memory at batch %d; capping it at %d", w, report.batch_size,
                    self._oom_caps[w])
        return True

    def _caps_for(self, workers: Sequence[int], max_batch: CapsArg) -> dict[int, int | None]:
        caps = resolve_caps(workers, max_batch)
        for w, c in self.memory_caps().items():
            if w in caps:
                cur = caps[w]
                caps[w] = c if cur is None else min(c, cur)
        return caps

    def _caps_state(self) -> dict[str, Any]:
        return {"oom_caps": _str_keys(self._oom_caps)}

    def _load_caps_state(self, state: Mapping[str, Any]) -> None:
        self._oom_caps = {int(k): int(v) for k, v in state.get("oom_caps", {}).items()}


def _within(split: Mapping[int, int] | None, workers: Sequence[int], total: int, min_batch: int,
            caps: Mapping[int, int | None]) -> bool:
    """Is ``split`` still a valid answer for these workers, total and bounds?"""
    if split is None or sorted(split) != sorted(workers) or sum(split.values()) != total:
        return False
    for w, x in split.items():
        cap = caps.get(w)
        if x < min_batch or (cap is not None and x > cap):
            return False
    return True


# ---------------------------------------------------------------------------------------------
@register_policy("static")
class StaticPolicy(CapAwarePolicy):
    """Profile each worker for ``profile_iterations`` reports, then x_i ∝ speed, frozen.

    The speed is the median samples/s of the profiling reports (robust to a slow first,
    warm-up iteration). Until a worker is profiled it gets the mean speed of the profiled ones,
    so the initial cohort is split uniformly and a late joiner gets an average share while it is
    being profiled. Later changes in speed are ignored on purpose: that is what "static" means.
    """

    def __init__(self, profile_iterations: int = 5, memory_caps: Mapping[Any, int] | None = None,
                 oom_margin: float = 0.05) -> None:
        super().__init__(memory_caps, oom_margin)
        if profile_iterations < 1:
            raise ValueError(f"profile_iterations must be >= 1, got {profile_iterations}")
        self.profile_iterations = int(profile_iterations)
        self._samples: dict[int, list[float]] = {}
        self._speed: dict[int, float] = {}

    @property
    def speeds(self) -> dict[int, float]:
        """The frozen speeds of the workers profiled so far."""
        return dict(self._speed)

    def join(self, worker_id: int) -> None:
        self._speed.pop(worker_id, None)       # a (re)joining worker is profiled afresh
        self._samples[worker_id] = []

    def leave(self, worker_id: int) -> None:
        self._speed.pop(worker_id, None)
        self._samples.pop(worker_id, None)

    def observe(self, report: WorkerReport) -> None:
        if self._note_oom(report):
            return
        w = report.worker_id
        v = measured_speed(report)
        if w in self._speed or v is None:
            return
        samples = self._samples.setdefault(w, [])
        samples.append(v)
        if len(samples) >= self.profile_iterations:
            self._speed[w] = statistics.median(samples)
            del self._samples[w]

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        ws = sorted(workers)
        caps = self._caps_for(ws, max_batch)
        known = [self._speed[w] for w in ws if w in self._speed]
        prior = sum(known) / len(known) if known else 1.0
        weights = {w: self._speed.get(w, prior) for w in ws}
        return bounded_split(weights, global_batch, min_batch, caps)

    def state_dict(self) -> dict[str, Any]:
        return {"speed": _str_keys(self._speed), "samples": _str_keys(self._samples),
                **self._caps_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._speed = {int(k): float(v) for k, v in state.get("speed", {}).items()}
        self._samples = {int(k): [float(x) for x in v] for k, v in state.get("samples", {}).items()}
        self._load_caps_state(state)


# ---------------------------------------------------------------------------------------------
def _default_predictor_factory(name: str, args: Mapping[str, Any]) -> Callable[[], Any]:
    """A zero-argument builder of ``predictors.get_predictor(name, **args)``, validated once now."""
    try:
        from predictors import get_predictor
    except ImportError as exc:  # pragma: no cover - the package ships with the project
        raise ValueError(f"lbbsp-cpu needs the 'predictors' package: {exc}") from None
    get_predictor(name, **dict(args))         # fail at start-up on a bad name or argument
    return lambda: get_predictor(name, **dict(args))


@register_policy("lbbsp-cpu")
class LBBSPCpuPolicy(CapAwarePolicy):
    """Analytical LB-BSP: predicted speeds v_i and overheads c_i -> equal predicted finish times.

    x_i = v_i (T* - c_i), T* = (X + Σ v_j c_j) / Σ v_j, clamped to [min_batch, cap_i] with
    water-filling and rounded by largest remainder (Σ x_i = X exactly). The previous split is kept
    unless the new one is predicted to shorten the iteration (max_i c_i + x_i / v_i) by more than
    ``threshold``: re-splitting on noise costs re-cut data ranges and jittery batch sizes for no
    gain. Unmeasured workers (cold start, late joiners) get the mean measured speed and overhead;
    with none measured the split is uniform. Between two decisions a worker's batch changes by at
    most a factor ``max_factor`` (a trust region against one-iteration artefacts; None disables
    it). The overhead c_i is an EMA (``overhead_alpha``) of data + push + pull time. The first
    ``warmup`` reports of each worker are ignored: a first iteration carries lazy initialisation
    and an initial pull that waited for the job to start (measured: 98 ms of "pull" against 1 ms of
    compute), which would otherwise starve that worker. When communication dominates (compute a
    few ms against noisy push/pull times of the same size), equalising c_i + x_i / v_i can drive
    the split to an extreme (seen: 63/1 of 64 on the 2-worker synthetic MLP run, which was in fact
    14% faster there: less push contention); ``use_overhead=False`` or a larger ``min_batch``
    keeps it near speed-proportional.

    ``predictor`` defaults to ``"ema"``: it smooths iteration jitter, reacts to a real step within a
    few iterations, costs microseconds per worker and needs no training; ``"narx"`` (the paper's
    choice) can be selected and uses the host/co-tenant CPU and memory telemetry as exogenous
    inputs. ``history`` observations per worker are kept so that a checkpoint can rebuild any
    predictor by replaying them.
    """

    def __init__(self, predictor: str = "ema", predictor_args: Mapping[str, Any] | None = None,
                 threshold: float = 0.05, overhead_alpha: float = 0.3, use_overhead: bool = True,
                 use_exog: bool | None = None, history: int = 32, warmup: int = 1,
                 max_factor: float | None = 2.0,
                 memory_caps: Mapping[Any, int] | None = None, oom_margin: float = 0.05,
                 predictor_factory: Callable[[], Any] | None = None) -> None:
        super().__init__(memory_caps, oom_margin)
        if not (0.0 <= threshold < 1.0):
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        if not (0.0 < overhead_alpha <= 1.0):
            raise ValueError(f"overhead_alpha must be in (0, 1], got {overhead_alpha}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if max_factor is not None and not max_factor > 1.0:
            raise ValueError(f"max_factor must be > 1 (or None), got {max_factor}")
        self.max_factor = None if max_factor is None else float(max_factor)
        self.warmup = int(warmup)
        self.predictor_name = predictor
        self.predictor_args = dict(predictor_args or {})
        self.threshold = float(threshold)
        self.overhead_alpha = float(overhead_alpha)
        self.use_overhead = bool(use_overhead)
        self.use_exog = (predictor == "narx") if use_exog is None else bool(use_exog)
        self.history = int(history)
        self._factory = predictor_factory or _default_predictor_factory(predictor, self.predictor_args)
        self._exog_fn: Callable[[Mapping[str, Any]], list[float]] | None = None
        if self.use_exog:
            from predictors import exog_from_telemetry
            self._exog_fn = exog_from_telemetry
        self._pred: dict[int, Any] = {}
        self._overhead: dict[int, float] = {}
        self._hist: dict[int, deque[tuple[float, list[float] | None]]] = {}
        self._seen: dict[int, int] = {}  # reports per worker since it joined (for warmup)
        self._prev: dict[int, int] | None = None
        self.changes = 0                 #: how often the returned split changed
        self.predicted_s = math.nan      #: predicted iteration time of the last returned split

    # ----- membership and observations ----------------------------------------------------
    def join(self, worker_id: int) -> None:
        self._forget(worker_id)

    def leave(self, worker_id: int) -> None:
        self._forget(worker_id)

    def _forget(self, w: int) -> None:
        self._pred.pop(w, None)
        self._overhead.pop(w, None)
        self._hist.pop(w, None)
        self._seen.pop(w, None)

    def observe(self, report: WorkerReport) -> None:
        if self._note_oom(report):
            return
        v = measured_speed(report)
        if v is None:
            return
        w = report.worker_id
        n = self._seen[w] = self._seen.get(w, 0) + 1
        if n <= self.warmup:
            return
        exog = self._exog_fn(report.telemetry) if self._exog_fn is not None else None
        self._feed(w, v, exog)
        o = fixed_overhead(report) if self.use_overhead else 0.0
        prev = self._overhead.get(w)
        self._overhead[w] = o if prev is None else self.overhead_alpha * o + (1 - self.overhead_alpha) * prev

    def _feed(self, w: int, v: float, exog: list[float] | None) -> None:
        p = self._pred.get(w)
        if p is None:
            p = self._pred[w] = self._factory()
            self._hist[w] = deque(maxlen=self.history)
        p.update(v, exog)
        self._hist[w].append((v, exog))

    # ----- decision -----------------------------------------------------------------------
    def estimates(self, workers: Sequence[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Predicted speed and overhead per worker (unmeasured ones get the measured means)."""
        speeds: dict[int, float] = {}
        for w in workers:
            p = self._pred.get(w)
            if p is not None:
                v = float(p.predict())
                if math.isfinite(v) and v > 0:
                    speeds[w] = v
        if not speeds:
            return {}, {}
        mean_v = sum(speeds.values()) / len(speeds)
        known_c = [self._overhead[w] for w in speeds if w in self._overhead]
        mean_c = sum(known_c) / len(known_c) if known_c else 0.0
        v_all = {w: speeds.get(w, mean_v) for w in workers}
        c_all = {w: self._overhead.get(w, mean_c) if w in speeds else mean_c for w in workers}
        return v_all, c_all

    def _trust_region(self, prev: Mapping[int, int], caps: Mapping[int, int | None]
                      ) -> tuple[dict[int, int | None], dict[int, int] | None]:
        """Bounds [x / f, x * f] around the previous split (f = ``max_factor``): one noisy
        iteration can then move a worker's batch by at most a factor f, and a real change is still
        followed in a few decisions. Feasible because the previous split lies inside them."""
        f = self.max_factor
        if f is None:
            return dict(caps), None
        hi: dict[int, int | None] = {}
        for w, x in prev.items():
            cap = caps.get(w)
            up = math.ceil(x * f)
            hi[w] = up if cap is None else min(cap, up)
        return hi, {w: math.floor(x / f) for w, x in prev.items()}

    @staticmethod
    def predicted_time(split: Mapping[int, int], speeds: Mapping[int, float],
                       overheads: Mapping[int, float]) -> float:
        """max_i c_i + x_i / v_i: the iteration time the model predicts for ``split``."""
        return max(overheads[w] + x / speeds[w] for w, x in split.items())

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        ws = sorted(workers)
        caps = self._caps_for(ws, max_batch)
        check_feasible(ws, global_batch, min_batch, caps)
        v, c = self.estimates(ws)
        if not v:
            out = bounded_split({w: 1.0 for w in ws}, global_batch, min_batch, caps)
            self.predicted_s = math.nan
        else:
            prev = self._prev
            if prev is None or not _within(prev, ws, global_batch, min_batch, caps):
                out = finish_time_split(v, c, global_batch, min_batch, caps)
            else:
                caps, floors = self._trust_region(prev, caps)
                out = finish_time_split(v, c, global_batch, min_batch, caps, floors=floors)
                t_prev = self.predicted_time(prev, v, c)
                t_new = self.predicted_time(out, v, c)
                if not t_new < t_prev * (1.0 - self.threshold):
                    out = prev
            self.predicted_s = self.predicted_time(out, v, c)
        if out != self._prev:
            if self._prev is not None:
                self.changes += 1
            self._prev = dict(out)
        return dict(out)

    # ----- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor_name,
            "history": {str(w): [[v, e] for v, e in h] for w, h in self._hist.items()},
            "overhead": _str_keys(self._overhead),
            "seen": _str_keys(self._seen),
            "prev": None if self._prev is None else _str_keys(self._prev),
            "changes": self.changes,
            **self._caps_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild predictors by replaying the saved observations (the predictor interface has
        no state export; for EMA/last this is exact up to the replay window)."""
        if state.get("predictor", self.predictor_name) != self.predictor_name:
            log.warning("checkpoint used predictor %r, now %r: replaying its history anyway",
                        state.get("predictor"), self.predictor_name)
        self._pred, self._hist = {}, {}
        for k, h in state.get("history", {}).items():
            for v, e in h:
                self._feed(int(k), float(v), None if e is None else [float(x) for x in e])
        self._overhead = {int(k): float(v) for k, v in state.get("overhead", {}).items()}
        self._seen = {int(k): int(v) for k, v in state.get("seen", {}).items()}
        prev = state.get("prev")
        self._prev = None if prev is None else {int(k): int(v) for k, v in prev.items()}
        self.changes = int(state.get("changes", 0))
        self._load_caps_state(state)


# ---------------------------------------------------------------------------------------------
@register_policy("lbbsp-gpu")
class LBBSPGpuPolicy(CapAwarePolicy):
    """Numerical LB-BSP: move samples from the straggler to the leader until finish times agree.

    Finish time of a worker = compute_s + fixed overhead (data, push, pull; never the barrier
    wait), as the median over a monitoring window of W iterations at its current size (W starts at
    ``window``). Once every worker has a full window, the straggler (slowest) gives Δ samples
    (``step``, default X // 32) to the leader (fastest worker below its memory cap): "fast
    approach". A worker moving back the way it came means we overshot: halve Δ and double W (up to
    ``max_window``): "fine tune". Converged when (f_straggler - f_leader) / f_straggler is within
    ``tolerance`` (a worker held at its memory cap may finish earlier: nothing can be moved to it),
    when a 1-sample step oscillates, or when no move is possible (straggler at the floor, nobody
    with headroom). The split is then frozen.

    Re-trigger (Δ and W back to their initial values): (1) converged, and the spread has been out
    of tolerance for W consecutive iterations (slow drift); (2) in any phase after the first
    approach, a worker's own finish time at an unchanged batch size moved by more than ``drift``
    (median of its last ``window`` iterations against its earlier ones): the environment changed
    (a co-tenant, a throttled link), and a search that has shrunk to 1-sample steps over 12-iteration
    windows would otherwise crawl towards the new balance.

    Memory caps come from ``memory_caps`` and from OOM reports (the excess of an OOM'd worker moves
    to the others at the next decision). No predictions, no randomness. Why not the CPU rule? On
    GPUs time is flat below a saturation batch and memory bounds the batch, so one speed number
    cannot give the split; search can.
    """

    def __init__(self, window: int = 3, step: int | None = None, tolerance: float = 0.05,
                 max_window: int = 12, drift: float = 0.15, use_overhead: bool = True,
                 memory_caps: Mapping[Any, int] | None = None, oom_margin: float = 0.05) -> None:
        super().__init__(memory_caps, oom_margin)
        if window < 1 or max_window < window:
            raise ValueError(f"need 1 <= window <= max_window, got window={window}, max_window={max_window}")
        if step is not None and step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if not (0.0 < tolerance < 1.0):
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
        if not drift > 0:
            raise ValueError(f"drift must be > 0, got {drift}")
        self.window0 = int(window)
        self.max_window = int(max_window)
        self.step0 = None if step is None else int(step)
        self.tolerance = float(tolerance)
        self.drift = float(drift)
        self.use_overhead = bool(use_overhead)
        self._split: dict[int, int] | None = None
        self._total: int | None = None
        self._delta = 1
        self._window = self.window0
        self.phase = "approach"          #: "approach", "fine" or "converged"
        self._fin: dict[int, deque[float]] = {}
        self._dir: dict[int, int] = {}   # last move per worker: +1 received, -1 gave
        self._out = 0                    # consecutive out-of-tolerance iterations while converged
        self._fresh = False
        self._shifted: set[int] = set()  # workers whose finish time jumped at an unchanged size
        self.moves = 0
        self.oscillations = 0
        self.retriggers = 0
        self.last_spread = math.nan

    @property
    def step(self) -> int:
        """The current Δ (samples moved per decision)."""
        return self._delta

    @property
    def window(self) -> int:
        """The current monitoring window W (iterations)."""
        return self._window

    def _initial_step(self, total: int) -> int:
        return self.step0 if self.step0 is not None else max(1, total // 32)

    def _restart_search(self) -> None:
        self.phase = "approach"
        self._delta = self._initial_step(self._total or 1)
        self._window = self.window0
        self._dir.clear()
        self._out = 0

    def join(self, worker_id: int) -> None:
        self._fin[worker_id] = deque(maxlen=self.max_window)

    def leave(self, worker_id: int) -> None:
        self._fin.pop(worker_id, None)
        self._dir.pop(worker_id, None)
        self._shifted.discard(worker_id)

    def observe(self, report: WorkerReport) -> None:
        if self._note_oom(report):
            return
        w = report.worker_id
        if self._split is None or self._split.get(w) != report.batch_size:
            return                            # measured at a size we no longer use
        if not math.isfinite(report.compute_s) or report.compute_s <= 0:
            return
        f = report.compute_s + (fixed_overhead(report) if self.use_overhead else 0.0)
        d = self._fin.get(w)
        if d is None:
            d = self._fin[w] = deque(maxlen=self.max_window)
        d.append(f)
        self._fresh = True
        n = self.window0
        if len(d) >= 2 * n:
            recent, older = _median(list(d)[-n:]), _median(list(d)[:-n])
            if abs(recent - older) > self.drift * older:
                self._shifted.add(w)

    def _set(self, w: int, x: int) -> None:
        assert self._split is not None
        if self._split.get(w) != x:
            self._split[w] = x
            self._fin[w] = deque(maxlen=self.max_window)

    def _medians(self, ws: Sequence[int], n: int) -> dict[int, float] | None:
        out = {}
        for w in ws:
            d = self._fin.get(w)
            if d is None or len(d) < n:
                return None
            out[w] = _median(list(d)[-n:])
        return out

    def _roles(self, f: Mapping[int, float], caps: Mapping[int, int | None]) -> tuple[int, int | None, float]:
        """(straggler, leader or None, spread). The spread is measured between the two: a fast
        worker held back by its memory cap finishing early is not an imbalance we can fix."""
        assert self._split is not None
        s = max(f, key=lambda w: (f[w], -w))
        split = self._split
        room = [w for w in f if w != s and ((c := caps.get(w)) is None or split[w] < c)]
        if not room:
            return s, None, 0.0
        ld = min(room, key=lambda w: (f[w], w))
        return s, ld, ((f[s] - f[ld]) / f[s] if f[s] > 0 else 0.0)

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        ws = sorted(workers)
        caps = self._caps_for(ws, max_batch)
        check_feasible(ws, global_batch, min_batch, caps)
        if self._split is None or sorted(self._split) != ws or self._total != global_batch:
            self._resplit(ws, global_batch, min_batch, caps)
            self._restart_search()
        elif not _within(self._split, ws, global_batch, min_batch, caps):
            self._resplit(ws, global_batch, min_batch, caps)   # a cap shrank (OOM): keep searching
            if self.phase == "converged":
                self.phase = "approach"
        else:
            shifted = self._shifted & set(ws)
            if shifted and (self.phase != "approach" or self._delta != self._initial_step(global_batch)):
                log.info("lbbsp-gpu: finish time of workers %s shifted at unchanged batch sizes; "
                         "restarting the search", sorted(shifted))
                for w in shifted:             # keep only the samples taken after the shift
                    self._fin[w] = deque(list(self._fin[w])[-self.window0:], maxlen=self.max_window)
                self.retriggers += 1
                self._restart_search()
            if self.phase == "converged":
                self._watch(ws, min_batch, caps)
            else:
                self._search(ws, min_batch, caps)
        self._shifted.clear()
        self._fresh = False
        assert self._split is not None
        return dict(self._split)

    def _resplit(self, ws: Sequence[int], total: int, min_batch: int,
                 caps: Mapping[int, int | None]) -> None:
        """Re-split keeping the current proportions (newcomers get the mean share), within bounds."""
        cur = {w: x for w, x in (self._split or {}).items() if w in ws}
        scale = total / self._total if self._total and cur else 1.0
        mean = sum(cur.values()) / len(cur) * scale if cur else 1.0
        weights = {w: cur[w] * scale if w in cur else mean for w in ws}
        new = bounded_split(weights, total, min_batch, caps)
        old = self._split or {}
        self._split = {w: old[w] for w in ws if w in old}
        for w in ws:
            self._set(w, new[w])
        self._total = total

    def _watch(self, ws: Sequence[int], min_batch: int, caps: Mapping[int, int | None]) -> None:
        """Converged: re-trigger once the spread has been out of tolerance for a full window."""
        if not self._fresh:
            return                            # no new report since the last decision
        f = self._medians(ws, self._window)
        if f is None or len(ws) < 2:
            return
        _, _, self.last_spread = self._roles(f, caps)
        self._out = self._out + 1 if self.last_spread > self.tolerance else 0
        if self._out >= self._window:
            log.info("lbbsp-gpu: finish-time spread %.3f out of tolerance for %d iterations; "
                     "restarting the search", self.last_spread, self._out)
            self.retriggers += 1
            self._restart_search()
            self._search(ws, min_batch, caps)

    def _search(self, ws: Sequence[int], min_batch: int, caps: Mapping[int, int | None]) -> None:
        """One leader/straggler decision, once every worker has a full window at its size."""
        assert self._split is not None
        f = self._medians(ws, self._window)
        if f is None or len(ws) < 2:
            return
        s, ld, self.last_spread = self._roles(f, caps)
        if self.last_spread <= self.tolerance:
            self._converge("finish times within tolerance")
            return
        if ld is None or self._split[s] <= min_batch:
            self._converge("no move possible")
            return
        if self._dir.get(s) == +1 or self._dir.get(ld) == -1:
            self.oscillations += 1
            if self._delta == 1:
                self._converge("1-sample step oscillates")
                return
            self._delta = max(1, self._delta // 2)
            self._window = min(2 * self._window, self.max_window)
            self.phase = "fine"
        cap_l = caps.get(ld)
        amount = min(self._delta, self._split[s] - min_batch,
                     (cap_l - self._split[ld]) if cap_l is not None else self._delta)
        self._set(s, self._split[s] - amount)
        self._set(ld, self._split[ld] + amount)
        self._dir[s], self._dir[ld] = -1, +1
        self.moves += 1

    def _converge(self, why: str) -> None:
        log.debug("lbbsp-gpu converged (%s): spread %.3f, step %d, window %d", why, self.last_spread,
                  self._delta, self._window)
        self.phase = "converged"
        self._out = 0

    # ----- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "split": None if self._split is None else _str_keys(self._split),
            "total": self._total, "delta": self._delta, "window": self._window, "phase": self.phase,
            "fin": {str(w): list(d) for w, d in self._fin.items()},
            "dir": _str_keys(self._dir), "out": self._out, "shifted": sorted(self._shifted),
            "moves": self.moves, "oscillations": self.oscillations, "retriggers": self.retriggers,
            **self._caps_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        split = state.get("split")
        self._split = None if split is None else {int(k): int(v) for k, v in split.items()}
        self._total = state.get("total")
        self._delta = int(state.get("delta", 1))
        self._window = int(state.get("window", self.window0))
        self.phase = str(state.get("phase", "approach"))
        self._fin = {int(k): deque((float(x) for x in v), maxlen=self.max_window)
                     for k, v in state.get("fin", {}).items()}
        self._dir = {int(k): int(v) for k, v in state.get("dir", {}).items()}
        self._out = int(state.get("out", 0))
        self._shifted = {int(w) for w in state.get("shifted", [])}
        self.moves = int(state.get("moves", 0))
        self.oscillations = int(state.get("oscillations", 0))
        self.retriggers = int(state.get("retriggers", 0))
        self._load_caps_state(state)


def _median(xs: list[float]) -> float:
    """Median of a short list (cheaper than statistics.median for the 3-12 samples we keep)."""
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])
