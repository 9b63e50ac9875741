"""BatchSizeManager: the one object a training loop (ours or another framework's) talks to.

It owns membership, the bounds (x_min, x_max, per-worker memory caps), the policy, validation of
every answer, and the measurement of its own decision time (so "overhead as a fraction of the
iteration" is measured, not assumed). No sockets, no sleeps; time comes from an injected clock.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any, Callable, Mapping

from batchsize_manager.allocation import check_feasible
from batchsize_manager.lbbsp import cap_after_oom, is_oom
from batchsize_manager.policies import BatchPolicy, WorkerReport, get_policy

log = logging.getLogger(__name__)

STATE_VERSION = 1


class BatchSizeManager:
    """Split a constant global batch X over the live workers, iteration after iteration.

    Usage per iteration: ``observe(report)`` for each worker's report of the finished iteration,
    then ``assign()`` for the next one. ``join``/``leave`` may come between any two calls.

    Bounds: every size is in [``min_batch``, cap_i], cap_i being the smallest of ``max_batch``,
    ``memory_caps[i]``, a cap learned from an out-of-memory report (``telemetry["oom"] == 1``,
    recorded ``oom_margin`` below the failed size) and the policy's own caps. An X that cannot be
    split within them raises ``ValueError`` saying why.
    """

    def __init__(self, policy: BatchPolicy | str, global_batch: int, *, min_batch: int = 1,
                 max_batch: int | None = None, policy_args: Mapping[str, Any] | None = None,
                 memory_caps: Mapping[int, int] | None = None, oom_margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(policy, str):
            self.policy = get_policy(policy, **dict(policy_args or {}))
        elif isinstance(policy, BatchPolicy):
            if policy_args:
                raise ValueError("policy_args only apply when the policy is given by name")
            self.policy = policy
        else:
            raise TypeError(f"policy must be a BatchPolicy or a registered name, got {type(policy)}")
        if int(global_batch) < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if int(min_batch) < 1:
            raise ValueError(f"min_batch must be >= 1, got {min_batch}")
        if max_batch is not None and int(max_batch) < int(min_batch):
            raise ValueError(f"max_batch={max_batch} is below min_batch={min_batch}")
        if not (0.0 <= oom_margin < 1.0):
            raise ValueError(f"oom_margin must be in [0, 1), got {oom_margin}")
        self.global_batch = int(global_batch)
        self.min_batch = int(min_batch)
        self.max_batch = None if max_batch is None else int(max_batch)
        self.oom_margin = float(oom_margin)
        self.clock = clock
        self._config_caps = {int(k): int(v) for k, v in (memory_caps or {}).items()}
        self._oom_caps: dict[int, int] = {}
        self._live: set[int] = set()
        self._accepts_caps = "max_batch" in inspect.signature(self.policy.assign).parameters
        self.last_assignment: dict[int, int] = {}
        self.last_decision_s = 0.0
        self.total_decision_s = 0.0
        self.decisions = 0
        self.ignored_reports = 0
        self._pending_s = 0.0          # observe() time since the last assign()

    # ----- membership ---------------------------------------------------------------------
    @property
    def live_workers(self) -> list[int]:
        """Live worker ids, sorted."""
        return sorted(self._live)

    def join(self, worker_id: int) -> None:
        """A worker became live (joining twice is a no-op)."""
        w = int(worker_id)
        if w not in self._live:
            self._live.add(w)
            self.policy.join(w)

    def leave(self, worker_id: int) -> None:
        """A worker left or was declared lost (unknown ids are ignored)."""
        w = int(worker_id)
        if w in self._live:
            self._live.discard(w)
            self.policy.leave(w)

    # ----- decisions ----------------------------------------------------------------------
    def observe(self, report: WorkerReport) -> None:
        """Feed one worker's report; late reports of departed workers are dropped and counted."""
        t0 = self.clock()
        try:
            if report.worker_id not in self._live:
                self.ignored_reports += 1
                return
            if is_oom(report):
                cap = cap_after_oom(report.batch_size, self.oom_margin)
                self._oom_caps[report.worker_id] = min(cap, self._oom_caps.get(report.worker_id, cap))
            self.policy.observe(report)
        finally:
            self._pending_s += self.clock() - t0

    def caps(self) -> dict[int, int]:
        """The effective cap of every live worker that has one (absent = only bounded by X)."""
        per_worker = self.memory_caps
        if self.max_batch is None:
            return {w: c for w, c in per_worker.items() if w in self._live}
        return {w: min(self.max_batch, per_worker.get(w, self.max_batch)) for w in self._live}

    @property
    def memory_caps(self) -> dict[int, int]:
        """Per-worker caps from config and OOM reports (manager's and policy's)."""
        caps = dict(self._config_caps)
        for src in (self._oom_caps, self.policy.memory_caps()):
            for w, c in src.items():
                caps[w] = min(c, caps.get(w, c))
        return caps

    def assign(self) -> dict[int, int]:
        """The next {worker: batch size} for the live workers: Σ = X, each within its bounds."""
        t0 = self.clock()
        try:
            live = self.live_workers
            caps = self.caps()
            check_feasible(live, self.global_batch, self.min_batch, caps)
            if self._accepts_caps:
                sizes = self.policy.assign(live, self.global_batch, self.min_batch,
                                           max_batch=caps or None)
            else:
                sizes = self.policy.assign(live, self.global_batch, self.min_batch)
            self._validate(sizes, live, caps)
            self.last_assignment = dict(sizes)
            return dict(sizes)
        finally:
            self.last_decision_s = self._pending_s + (self.clock() - t0)
            self._pending_s = 0.0
            self.total_decision_s += self.last_decision_s
            self.decisions += 1

    def _validate(self, sizes: Mapping[int, int], live: list[int], caps: Mapping[int, int]) -> None:
        name = self.policy.name or type(self.policy).__name__
        if sorted(sizes) != live:
            raise RuntimeError(f"batch policy {name} answered for workers {sorted(sizes)}, live are {live}")
        if sum(sizes.values()) != self.global_batch:
            raise RuntimeError(f"batch policy {name} split sums to {sum(sizes.values())}, "
                               f"not X={self.global_batch}: {dict(sizes)}")
        for w, x in sizes.items():
            cap = caps.get(w)
            if x < self.min_batch or (cap is not None and x > cap):
                raise RuntimeError(f"batch policy {name} gave worker {w} batch {x}, outside "
                                   f"[{self.min_batch}, {cap if cap is not None else 'X'}]")

    @property
    def mean_decision_s(self) -> float:
        """Mean seconds per decision (observe of the reports + assign)."""
        return self.total_decision_s / self.decisions if self.decisions else math.nan

    # ----- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (str keys) for the coordinator's checkpoint."""
        return {
            "version": STATE_VERSION,
            "policy": self.policy.name,
            "global_batch": self.global_batch,
            "min_batch": self.min_batch,
            "max_batch": self.max_batch,
            "live": self.live_workers,
            "oom_caps": {str(k): v for k, v in self._oom_caps.items()},
            "last_assignment": {str(k): v for k, v in self.last_assignment.items()},
            "decisions": self.decisions,
            "total_decision_s": self.total_decision_s,
            "policy_state": self.policy.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; X and the bounds stay as configured now."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported BatchSizeManager state version {state.get('version')!r}")
        if state.get("policy") != self.policy.name:
            raise ValueError(f"checkpoint is for batch policy {state.get('policy')!r}, "
                             f"this manager runs {self.policy.name!r}")
        for key in ("global_batch", "min_batch", "max_batch"):
            if state.get(key) != getattr(self, key):
                log.info("batch-size manager: %s was %r in the checkpoint, now %r", key,
                         state.get(key), getattr(self, key))
        self._live = {int(w) for w in state.get("live", [])}
        self._oom_caps = {int(k): int(v) for k, v in state.get("oom_caps", {}).items()}
        self.last_assignment = {int(k): int(v) for k, v in state.get("last_assignment", {}).items()}
        self.decisions = int(state.get("decisions", 0))
        self.total_decision_s = float(state.get("total_decision_s", 0.0))
        self.policy.load_state_dict(state.get("policy_state", {}))
