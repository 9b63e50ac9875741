"""The coordinator (a role of shard 0): membership, assignments, data cursor, stop rules.

Pure bookkeeping with an injected clock; the server loop calls it and does the I/O.

- Round modes (BSP, LB-BSP, backup workers): one plan per iteration. The live workers, each
  one's batch size from the batch policy, each one's sample ranges cut from the data cursor.
  The plan for t+1 is made when iteration t is applied, from the reports that came with t's
  pushes. Samples of gradients that were not applied (a backup worker's late gradient) go back
  to the cursor, so every applied sample is used exactly once per epoch.
- Async modes (ASP, SSP): each worker has its own clock; its next assignment is cut when it
  asks for it.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from ps_common.config import JobConfig
from ps_common.protocol import Assignment
from ps_server.data_cursor import DataCursor

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    worker_id: int
    name: str
    joined_at: float
    device: str = "cpu"
    last_seen: float = 0.0
    clock: int = 0  # iterations pushed
    token: str = ""  # membership secret handed out in Welcome


@dataclass
class UpdateRecord:
    """What the coordinator logs for each applied update (one iteration in round modes)."""

    iteration: int
    elapsed: float
    duration: float
    batch_sizes: dict[int, int]
    ranges: dict[int, list[list[int]]]
    accepted: list[int]
    loss: float
    epoch: int
    samples: int
    applied_samples: int
    reports: list[WorkerReport] = field(default_factory=list)


class Coordinator:
    def __init__(self, cfg: JobConfig, num_samples: int, manager: BatchSizeManager, *,
                 kind: str = "round", clock: Callable[[], float] = time.monotonic) -> None:
        if kind not in ("round", "async"):
            raise ValueError(f"unknown coordination kind {kind!r}")
        self.cfg = cfg
        self.kind = kind
        self.num_samples = num_samples
        self.manager = manager
        self.clock = clock
        self.cursor = DataCursor(num_samples)
        self.workers: dict[int, WorkerInfo] = {}
        self._next_id = 0
        self.started = False
        self.start_time = 0.0
        self.last_update_time = 0.0
        self.iteration = -1
        self.plan: dict[int, Assignment] = {}
        self.async_plan: dict[int, Assignment] = {}
        self.stop = False
        self.stop_reason = ""
        self.last_accuracy = -1.0
        self.applied_samples = 0
        self.updates = 0
        self.reports: dict[int, WorkerReport] = {}
        self.losses: dict[int, float] = {}
        self.lost: list[tuple[int, str, float]] = []
        self.replan_pending = False
        self.resumed = False
        self.elapsed_at_resume = 0.0
        self.events: list[dict] = []  # drained and logged by the server
        self._last_X: int | None = None
        self._ramp: tuple[int, float, float] | None = None

    @property
    def global_batch(self) -> int:
        return self.cfg.training.global_batch

    # ----- membership -------------------------------------------------------------------
    def join(self, name: str, device: str = "cpu") -> int:
        wid = self._next_id
        self._next_id += 1
        now = self.clock()
        clock = min((w.clock for w in self.workers.values()), default=0)
        self.workers[wid] = WorkerInfo(wid, name, now, device, now, clock, os.urandom(8).hex())
        self.manager.join(wid)
        log.info("worker %d (%s) joined; %d live", wid, name, len(self.workers))
        return wid

    def leave(self, worker_id: int, reason: str = "left") -> dict[int, int] | None:
        """Remove a worker (graceful leave or declared lost); never let a barrier wait for it.

        Its unused samples go back to the cursor. In round modes, if it was part of the current
        iteration's plan, returns the reduced set {worker: batch size} that the iteration must
        now be committed to (the server sends that commit to every shard); else None. If it was
        the last worker of the plan, the iteration is planned again for whoever joins next.
        """
        if self.workers.pop(worker_id, None) is None:
            return None
        self.manager.leave(worker_id)
        self.lost.append((worker_id, reason, self.clock()))
        log.info("worker %d %s; %d live", worker_id, reason, len(self.workers))
        pending = self.async_plan.pop(worker_id, None)
        if pending is not None:
            self.cursor.give_back(pending.ranges)
        if self.kind != "round" or worker_id not in self.plan or self.stop:
            return None
        self.cursor.give_back(self.plan.pop(worker_id).ranges)
        if not self.plan:
            self.replan_pending = True
            return None
        return {w: a.batch_size for w, a in self.plan.items()}

    def token_ok(self, worker_id: int, token: str) -> bool:
        info = self.workers.get(worker_id)
        return info is not None and hmac.compare_digest(info.token, token)

    def silent_workers(self, timeout_s: float) -> list[int]:
        """Workers not heard from (push or heartbeat) for longer than ``timeout_s``."""
        now = self.clock()
        return [w for w, info in self.workers.items() if now - info.last_seen > timeout_s]

    def heard_from(self, worker_id: int) -> bool:
        info = self.workers.get(worker_id)
        if info is None:
            return False
        info.last_seen = self.clock()
        return True

    def live(self) -> list[int]:
        return sorted(self.workers)

    # ----- starting and planning ----------------------------------------------------------
    def try_start(self) -> bool:
        """Start once the configured number of workers has joined (plans iteration 0).

        Also re-plans an iteration whose every worker left, once somebody is live again.
        """
        if self.started and self.replan_pending and self.workers and not self.stop:
            self.replan_pending = False
            self._plan(self.iteration)
            return True
        if self.started or len(self.workers) < self.cfg.cluster.num_workers:
            return False
        self.started = True
        now = self.clock()
        if not self.resumed:
            self.start_time = now
            self.iteration = 0
        else:  # keep the elapsed clock running across the restart
            self.start_time = now - self.elapsed_at_resume
        self.last_update_time = now
        if self.kind == "round":
            self._plan(self.iteration)
        return True

    def current_global_batch(self) -> int:
        """X for the next plan: constant, or worker_batch x live workers (elastic.keep)."""
        e = self.cfg.elastic
        if e.keep == "worker_batch" and self.kind == "round":
            wb = e.worker_batch or max(1, self.global_batch // self.cfg.cluster.num_workers)
            return wb * max(1, len(self.workers))
        return self.global_batch

    def drain_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def _lr_factor(self, iteration: int, X: int) -> float:
        """Linear scaling to X / X_configured, ramped from the previous factor; changes logged."""
        e = self.cfg.elastic
        if e.lr_rule == "none" or e.keep == "global_batch":
            return 1.0
        target = X / self.global_batch
        if self._last_X is None:
            self._last_X = self.global_batch if self.updates == 0 else X
        if X != self._last_X:
            now = self._lr_at(iteration)
            self._ramp = (iteration, now, target)
            self.events.append({"event": "global_batch_changed", "iteration": iteration,
                                "from": self._last_X, "to": X, "lr_factor_from": now, "lr_factor_to": target,
                                "ramp_iterations": e.ramp_iterations, "rule": "linear scaling"})
            log.info("global batch %s -> %d at iteration %d: lr factor %.3f -> %.3f over %d iterations",
                     self._last_X, X, iteration, now, target, e.ramp_iterations)
            self._last_X = X
        return self._lr_at(iteration)

    def _lr_at(self, iteration: int) -> float:
        if self._ramp is None:
            return 1.0
        start, a, b = self._ramp
        ramp = self.cfg.elastic.ramp_iterations
        if ramp <= 0:
            return b
        return a + (b - a) * min(1.0, (iteration - start + 1) / ramp)

    def _split(self, live: list[int]) -> tuple[dict[int, int], int]:
        """Batch sizes for ``live`` and their sum.

        With backup workers each of the N + b workers gets a share of X / N, so the first N
        gradients add up to X.
        """
        X = self.current_global_batch()
        b = self.cfg.mode.backup_workers if self.cfg.mode.sync == "backup" else 0
        required = max(1, self.cfg.cluster.num_workers - b)
        total = X if b == 0 else max(len(live), round(X * len(live) / required))
        if sorted(self.manager.live_workers) != live:
            raise RuntimeError(f"manager members {self.manager.live_workers} differ from {live}")
        self.manager.global_batch = total
        return self.manager.assign(), total

    def _plan(self, iteration: int) -> None:
        self.iteration = iteration
        self.reports, self.losses = {}, {}
        live = self.live()
        if not live:
            self.plan = {}
            return
        sizes, total = self._split(live)
        lr = self._lr_factor(iteration, self.current_global_batch())
        self.plan = {
            w: Assignment(iteration=iteration, batch_size=x, ranges=self.cursor.take(x),
                          expected_workers=len(live), global_batch=total, lr_scale=lr)
            for w, x in sizes.items()
        }

    def assignment(self, worker_id: int, iteration: int) -> Assignment | None:
        """The assignment answering a pull: ``iteration`` is the shard version (round modes) or
        the worker's next clock (async modes)."""
        if self.stop or worker_id not in self.workers or not self.started:
            return None
        if self.kind == "round":
            return self.plan.get(worker_id) if iteration == self.iteration else None
        a = self.async_plan.get(worker_id)
        if a is None or a.iteration != iteration:
            if a is not None:
                self.cursor.give_back(a.ranges)
            live = self.live()
            sizes, total = self._split(live)
            x = sizes[worker_id]
            a = Assignment(iteration=iteration, batch_size=x, ranges=self.cursor.take(x),
                           expected_workers=len(live), global_batch=total)
            self.async_plan[worker_id] = a
        return a

    # ----- progress -------------------------------------------------------------------------
    def record_push(self, report: WorkerReport, loss: float) -> None:
        self.reports[report.worker_id] = report
        self.losses[report.worker_id] = loss
        self.manager.observe(report)
        info = self.workers.get(report.worker_id)
        if info is not None:
            info.last_seen = self.clock()
            info.clock = max(info.clock, report.iteration + 1)

    def on_update(self, iteration: int, accepted: Iterable[int], samples: int) -> UpdateRecord:
        """An update was applied on shard 0: log it, check stop rules, plan what comes next."""
        now = self.clock()
        accepted = sorted(accepted)
        self.applied_samples += samples
        self.updates += 1
        if self.kind == "round":
            plan = self.plan
            for w, a in plan.items():
                if w not in accepted:  # dropped (late backup worker): its samples are reused
                    self.cursor.give_back(a.ranges)
        else:
            plan = {w: a for w, a in self.async_plan.items() if w in accepted}
            for w in accepted:
                self.async_plan.pop(w, None)
        sizes = {w: a.batch_size for w, a in plan.items() if w in accepted}
        n = sum(sizes.values()) or 1
        loss = sum(self.losses.get(w, 0.0) * x for w, x in sizes.items()) / n
        record = UpdateRecord(
            iteration=iteration, elapsed=now - self.start_time, duration=now - self.last_update_time,
            batch_sizes={w: a.batch_size for w, a in plan.items()},
            ranges={w: a.ranges for w, a in plan.items()}, accepted=accepted, loss=loss,
            epoch=self.cursor.epoch, samples=self.cursor.state.samples_served,
            applied_samples=self.applied_samples,
            reports=[self.reports[w] for w in accepted if w in self.reports])
        self.last_update_time = now
        self._check_stop(now)
        if self.kind == "round":
            if self.stop:
                self.plan = {}
                self.iteration = iteration + 1
            else:
                self._plan(iteration + 1)
        return record

    # ----- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed coordinator needs: the data cursor at the end of the last applied
        iteration (the in-flight plan's samples count as unused), progress counters, the batch
        policy's state. Membership is not saved: workers join again after a restart."""
        cursor = DataCursor(self.num_samples)
        cursor.load_state_dict(self.cursor.state_dict())
        for a in list(self.plan.values()) + list(self.async_plan.values()):
            cursor.give_back(a.ranges)
        policy_state = self.manager.state_dict()
        return {"cursor": cursor.state_dict(), "iteration": self.updates if self.kind == "round" else 0,
                "elapsed": self.elapsed(), "updates": self.updates,
                "applied_samples": self.applied_samples, "last_accuracy": self.last_accuracy,
                "next_id": self._next_id, "policy": policy_state}

    def load_state_dict(self, d: dict) -> None:
        """Resume: progress and cursor from the checkpoint; wait for the workers to join again."""
        for w in list(self.workers):
            self.manager.leave(w)
        self.workers.clear()
        self.plan, self.async_plan = {}, {}
        self.cursor.load_state_dict(d["cursor"])
        self.iteration = int(d["iteration"])
        self.updates = int(d["updates"])
        self.applied_samples = int(d["applied_samples"])
        self.last_accuracy = float(d["last_accuracy"])
        self.elapsed_at_resume = float(d.get("elapsed", 0.0))
        self._next_id = max(self._next_id, int(d["next_id"]))
        if d.get("policy") is not None:
            try:
                self.manager.load_state_dict(d["policy"])
            except (ValueError, KeyError) as exc:  # a policy change between runs: start afresh
                log.warning("batch policy state not restored: %s", exc)
        for w in self.manager.live_workers:  # members of the old incarnation join again
            self.manager.leave(w)
        self.started, self.stop, self.stop_reason = False, False, ""
        self.resumed = True

    def iterations_done(self) -> float:
        """Progress in global batches: iterations in round modes, X-sample equivalents in async."""
        if self.kind == "round":
            return float(self.updates)
        return self.applied_samples / self.global_batch

    # ----- stop rules -------------------------------------------------------------------
    def _check_stop(self, now: float) -> None:
        t = self.cfg.training
        if self.stop:
            return
        if t.max_iterations is not None and self.iterations_done() >= t.max_iterations:
            self.request_stop(f"reached max_iterations={t.max_iterations}")
        elif t.epochs is not None and self.applied_samples >= t.epochs * self.num_samples:
            self.request_stop(f"reached epochs={t.epochs}")
        elif t.max_seconds is not None and now - self.start_time >= t.max_seconds:
            self.request_stop(f"reached max_seconds={t.max_seconds}")
        elif t.target_accuracy is not None and self.last_accuracy >= t.target_accuracy:
            self.request_stop(f"reached target_accuracy={t.target_accuracy}")

    def request_stop(self, reason: str) -> None:
        if not self.stop:
            self.stop, self.stop_reason = True, reason
            log.info("stopping: %s", reason)

    def on_eval(self, accuracy: float) -> None:
        self.last_accuracy = accuracy

    def elapsed(self) -> float:
        return self.clock() - self.start_time if self.started else 0.0
