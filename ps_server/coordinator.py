"""The coordinator (a role of shard 0): membership, iteration plans, data cursor, stop rules.

Pure bookkeeping with an injected clock; the server loop calls it and does the I/O. Under BSP
the coordinator makes one plan per iteration: the live workers, each one's batch size from the
batch policy (sum exactly X), and each one's sample ranges cut from the data cursor. The plan
for t+1 is made when iteration t completes, from the reports that came with t's pushes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from batchsize_manager import BatchPolicy, WorkerReport
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


@dataclass
class IterationRecord:
    """What the coordinator logs for each finished iteration."""

    iteration: int
    elapsed: float
    duration: float
    batch_sizes: dict[int, int]
    ranges: dict[int, list[list[int]]]
    loss: float
    epoch: int
    samples: int
    reports: list[WorkerReport] = field(default_factory=list)


class Coordinator:
    def __init__(self, cfg: JobConfig, num_samples: int, policy: BatchPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.num_samples = num_samples
        self.policy = policy
        self.clock = clock
        self.cursor = DataCursor(num_samples)
        self.workers: dict[int, WorkerInfo] = {}
        self._next_id = 0
        self.started = False
        self.start_time = 0.0
        self.iteration_started = 0.0
        self.iteration = -1
        self.plan: dict[int, Assignment] = {}
        self.stop = False
        self.stop_reason = ""
        self.last_accuracy = -1.0
        self.reports: dict[int, WorkerReport] = {}
        self.losses: dict[int, float] = {}

    # ----- membership -------------------------------------------------------------------
    def join(self, name: str, device: str = "cpu") -> int:
        wid = self._next_id
        self._next_id += 1
        now = self.clock()
        self.workers[wid] = WorkerInfo(wid, name, now, device, now)
        self.policy.join(wid)
        log.info("worker %d (%s) joined; %d live", wid, name, len(self.workers))
        return wid

    def leave(self, worker_id: int) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self.policy.leave(worker_id)
            log.info("worker %d left; %d live", worker_id, len(self.workers))

    # ----- iteration plans --------------------------------------------------------------
    def try_start(self) -> bool:
        """Plan iteration 0 once the configured number of workers has joined."""
        if self.started or len(self.workers) < self.cfg.cluster.num_workers:
            return False
        self.started = True
        self.start_time = self.clock()
        self._plan(0)
        return True

    def _plan(self, iteration: int) -> None:
        self.iteration = iteration
        self.iteration_started = self.clock()
        self.reports, self.losses = {}, {}
        live = sorted(self.workers)
        X = self.cfg.training.global_batch
        sizes = self.policy.assign(live, X, self.cfg.training.min_batch)
        if sorted(sizes) != live or sum(sizes.values()) != X or min(sizes.values()) <= 0:
            raise RuntimeError(f"batch policy {self.policy.name} returned an invalid split {sizes}")
        self.plan = {
            w: Assignment(iteration=iteration, batch_size=x, ranges=self.cursor.take(x),
                          expected_workers=len(live), global_batch=X)
            for w, x in sizes.items()
        }

    def assignment(self, worker_id: int, iteration: int) -> Assignment | None:
        if iteration != self.iteration:
            return None
        return self.plan.get(worker_id)

    def record_push(self, report: WorkerReport, loss: float) -> None:
        self.reports[report.worker_id] = report
        self.losses[report.worker_id] = loss
        self.policy.observe(report)
        if report.worker_id in self.workers:
            self.workers[report.worker_id].last_seen = self.clock()

    def complete_iteration(self, iteration: int) -> IterationRecord:
        """Iteration ``iteration`` was applied: check stop rules and plan the next one."""
        now = self.clock()
        sizes = {w: a.batch_size for w, a in self.plan.items()}
        X = sum(sizes.values()) or 1
        loss = sum(self.losses.get(w, 0.0) * x for w, x in sizes.items()) / X
        record = IterationRecord(
            iteration=iteration, elapsed=now - self.start_time, duration=now - self.iteration_started,
            batch_sizes=sizes, ranges={w: a.ranges for w, a in self.plan.items()},
            loss=loss, epoch=self.cursor.epoch,
            samples=self.cursor.state.samples_served, reports=list(self.reports.values()),
        )
        self._check_stop(iteration + 1, now)
        if self.stop:
            self.plan = {}
            self.iteration = iteration + 1
        else:
            self._plan(iteration + 1)
        return record

    # ----- stop rules -------------------------------------------------------------------
    def _check_stop(self, version: int, now: float) -> None:
        t = self.cfg.training
        if self.stop:
            return
        if t.max_iterations is not None and version >= t.max_iterations:
            self.request_stop(f"reached max_iterations={t.max_iterations}")
        elif t.epochs is not None and self.cursor.state.samples_served >= t.epochs * self.num_samples:
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
