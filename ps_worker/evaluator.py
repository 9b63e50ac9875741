"""The evaluator: test accuracy of the current parameters, off the workers' critical path.

It runs as its own process, watches the coordinator's status, and every
``evaluator.every_iterations`` versions pulls a consistent copy of the parameters (the same
version from every shard), measures test accuracy and reports it to the coordinator (which may
stop the run at a target accuracy). A final measurement is taken when the run stops.

With ``evaluator.pause_training`` shard 0 holds the workers at each measured version until this
report arrives (:mod:`ps_server.pause`), so it asks for the status often once such a version is
near (:func:`next_poll_s`).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import zmq

from ps_common import protocol as P
from ps_common.config import JobConfig
from ps_common.heap import keep_freed_memory
from ps_common.metrics import MetricsWriter, existing_for
from ps_common.transport import RemoteError, TransportTimeout
from ps_ml.datasets import ArrayDataset, dataset_from_config
from ps_ml.models import FlatParameters, build_model
from ps_worker.client import PullAborted, PullResult, ShardClients

log = logging.getLogger(__name__)

PAUSED_POLL_S = 0.01  # pause_training: the status is asked this often once a version is near
PULL_PATIENCE_S = 10.0  # an existing version unanswered this long: a shard may have moved
#: after a final report shard 0 did not finish on, the evaluator asks for the status with this
#: timeout, and takes shard 0 for gone (and exits) once it has been silent FINAL_GONE_S: it
#: answers within milliseconds while it runs, but a rollback it handles can hold it a while
FINAL_LINGER_REPLY_S = 1.0
FINAL_GONE_S = 5.0


def next_poll_s(prev: tuple[float, int] | None, now: float, version: int, next_version: int,
                slow_s: float, fast_s: float = PAUSED_POLL_S) -> float:
    """How long to sleep before asking for the status again, under ``pause_training``: the
    workers will wait at ``next_version`` until it is measured, so ask every ``fast_s`` once it
    is near, and until then sleep half the time the versions' recent rate (``prev``: the last
    status's time and version) says it is away, within [fast_s, slow_s]."""
    if prev is None or next_version <= version:
        return fast_s
    t0, v0 = prev
    if version <= v0 or now <= t0:
        return fast_s   # no rate measured (or the version went back): stay prompt
    eta = (next_version - version) * (now - t0) / (version - v0)
    return min(slow_s, max(fast_s, 0.5 * eta))


def lower_priority(nice: int) -> None:
    """Run at CPU niceness ``nice``, and at 19 also SCHED_IDLE, so that the evaluator yields to
    every training process that wakes (it still costs training its share of the caches and of
    the gaps: 6-27% on LeNet on 2 cores, README).

    Linux shares the CPU between sessions (autogroups) first, and under EEVDF a SCHED_IDLE task
    is preempted at once only by tasks of its own group: the launcher therefore keeps the
    evaluator in the training processes' session. An evaluator that leads a session of its own
    (started by hand with ``setsid``) also lowers its autogroup's nice, the most it can do; one in
    a shared session leaves it alone, as that would lower everything the session runs."""
    try:
        os.nice(nice)
    except OSError as exc:
        log.warning("could not lower the evaluator's priority: %s", exc)
    if os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as fh:
                fh.write(str(nice))
        except OSError:
            pass  # no autogroups here (or not allowed): the plain nice is what counts then
    if nice >= 19 and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def channels_last_forward(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model``'s forward on a copy whose 4-d weights, like its image inputs, are laid out
    channels-last (NHWC), the layout oneDNN's CPU convolutions run natively.

    Why: the evaluator runs as many forward passes as training does on a CPU, and every cycle
    it spends is taken from the gaps training leaves. One thread, 10,000 MNIST test samples at 64
    per pass: LeNet 0.20 s instead of 0.34 s, the 1.2M-parameter CNN 1.3 s instead of 2.4 s;
    outputs within float rounding of the plain forward's. (Weights prepacked for oneDNN with
    ``torch.utils.mkldnn`` were 20-30% faster again, but that module is built on the deprecated
    TorchScript.) The copy keeps the caller's parameters, and views of them, as they were."""
    packed = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # documented, not in the stubs

    def forward(x: torch.Tensor) -> torch.Tensor:
        return packed(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x)

    return forward


def evaluate(model: torch.nn.Module, data: ArrayDataset, *, limit: int | None = None,
             batch: int = 64, channels_last: bool = True) -> tuple[float, float]:
    """(accuracy, mean loss) on the first ``limit`` test samples (all when None), with
    :func:`channels_last_forward` when ``channels_last`` (a layer that fails on its tensors
    falls back to the plain forward for the rest)."""
    n = data.num_test if limit is None else min(limit, data.num_test)
    was_training = model.training
    model.eval()  # before the copy: dropout and the like must be off in it too
    forward = channels_last_forward(model) if channels_last else model
    correct, loss_sum = 0, 0.0
    try:
        with torch.inference_mode():
            for a in range(0, n, batch):
                x, y = data.test_batch(a, min(a + batch, n))
                try:
                    out = forward(x)
                except RuntimeError as exc:
                    if forward is model:
                        raise
                    log.info("evaluating with the model's own layout: %s", exc)
                    forward = model
                    out = model(x)
                loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
                correct += int((out.argmax(1) == y).sum())
    finally:
        model.train(was_training)
    return correct / n, loss_sum / n


def pull_joining_again(pull: Callable[[Callable[[], str | None]], PullResult], join: Callable[[], None], *,
                       what: str, patience_s: float, timeout_s: float) -> PullResult:
    """``pull(abort)`` of something the coordinator says exists. A shard that does not answer
    within ``patience_s`` may have restarted at a new address (its checkpoint can be the very
    version last seen, so nothing went back): ``join()`` again, for the endpoints, and ask
    again, each try twice as patient as the one before, until ``timeout_s`` have passed.

    A join that comes before the restarted shard has registered with shard 0 gets the old
    address back; the next try joins again (one join and then a pull of the whole timeout on
    that address failed the evaluator). A pull that is merely slow, over a slow link, costs a
    few wasted tries."""
    deadline = time.monotonic() + timeout_s
    joins = 0
    while True:
        try:
            return pull(_impatient(min(patience_s, deadline - time.monotonic())))
        except (PullAborted, TransportTimeout) as exc:
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"no parameters of {what} within {timeout_s:g}s, "
                                       f"after joining again {joins} times ({exc})") from None
            log.warning("no parameters of %s (%s): joining again", what, exc)
            join()
            joins += 1
            patience_s *= 2


def _impatient(patience_s: float) -> Callable[[], str | None]:
    """A pull's ``abort``: gives a reason once ``patience_s`` have passed since it was made."""
    t0 = time.monotonic()

    def reason() -> str | None:
        waited = time.monotonic() - t0
        return f"no answer from every shard within {waited:.1f}s" if waited > patience_s else None
    return reason


class Evaluator:
    def __init__(self, cfg: JobConfig, server: str, *, run_dir: str | Path | None = None,
                 ctx: zmq.Context | None = None, dataset: ArrayDataset | None = None,
                 poll_s: float = 0.2, overwrite: bool = False) -> None:
        self.cfg = cfg
        torch.set_num_threads(1)
        keep_freed_memory()
        if cfg.evaluator.nice:  # yield to training
            lower_priority(cfg.evaluator.nice)
        self.ctx = ctx or zmq.Context.instance()
        self.client = ShardClients(self.ctx, server, timeout_s=cfg.transport.timeout_s,
                                   connect_timeout_s=cfg.transport.connect_timeout_s,
                                   security=cfg.security, role="evaluator", hwm=cfg.transport.hwm)
        self.consistent = True  # as the coordinator's Welcome says (round modes; async: False)
        self.data = dataset or dataset_from_config(cfg.data, cfg.run.seed)
        self.model = build_model(cfg.model.name, seed=cfg.run.seed)
        self.flat = FlatParameters(self.model)
        self.params = np.empty(self.flat.numel, dtype=np.float32)
        self.poll_s = poll_s
        self.paused = cfg.evaluator.pause_training  # the workers wait for each measurement
        # paused: find a restarted shard well within a pause's timeout
        self.pull_patience_s = max(1.0, cfg.evaluator.pause_timeout_s / 4) if self.paused else PULL_PATIENCE_S
        self.metrics = MetricsWriter(Path(run_dir) / "metrics" / "evaluator.jsonl" if run_dir else None,
                                     existing_for(overwrite=overwrite))
        self.results: list[dict[str, float]] = []
        self._last_hash = ""
        self.skipped = 0
        self.token = ""        # from the Welcome: only the newest evaluator's reports count

    def run(self) -> list[dict[str, float]]:
        """Measure versions 0, k, 2k, ... exactly (from the shards' snapshots), then the final one.

        If the evaluator falls so far behind that a snapshot was dropped, it skips ahead to
        the newest multiple of k and counts the skip.
        """
        self._join()
        every = self.cfg.evaluator.every_iterations
        next_version = 0
        last_done = -1
        stop_seen: float | None = None
        prev: tuple[float, int] | None = None   # (when, version) of the last status seen started
        last_seen = -1
        try:
            while True:
                status = self.client.send_to_coordinator(P.StatusRequest(), P.Status)
                assert isinstance(status, P.Status)
                seen_at = time.monotonic()
                if status.started and status.version < last_seen and not status.stop:
                    # The job rolled back (a shard restarted, perhaps at a new address).
                    next_version = self._went_back(status.version, next_version, every)
                    prev, last_done, stop_seen = None, -1, None
                last_seen = status.version if status.started else last_seen
                if status.stop and stop_seen is None:
                    stop_seen = time.monotonic()
                    next_version = self._catch_up_from(next_version, status.version, every)
                if status.started and status.version >= next_version and (
                        not status.stop or next_version < status.version):
                    try:
                        # every measurement goes to shard 0 too, also those caught up after the
                        # stop: its records alone then hold the accuracy curve (ps-summary)
                        last_done = self._measure(next_version, report=True, exact=True)
                        next_version += every
                    except RemoteError as exc:
                        if exc.code != "snapshot_gone":
                            raise
                        newest = status.version // every * every
                        log.warning("evaluator fell behind: skipping versions %d..%d", next_version,
                                    newest - every)
                        self.skipped += (newest - next_version) // every
                        next_version = newest
                    continue
                if status.stop:
                    # The final version, exactly: every shard holds it once the stop is known.
                    other_history = bool(status.log_hash and self._last_hash and self._last_hash != status.log_hash)
                    if status.version != last_done or other_history:
                        last_done = self._measure(status.version, report=False, exact=True)
                    done = self._report(self.results[-1] if self.results else None, final=True,
                                        log_hash=self._last_hash)
                    changed = None if done else self._changed_after_final(status)
                    if changed is None:
                        return self.results
                    # A rollback after the final report: the new history's stop needs its
                    # own final measurement; go on as after any rollback.
                    next_version = self._went_back(changed.version, next_version, every)
                    last_seen, prev, last_done, stop_seen = changed.version, None, -1, None
                    continue
                if self.paused and status.started:
                    time.sleep(next_poll_s(prev, seen_at, status.version, next_version, self.poll_s))
                    prev = (seen_at, status.version)
                else:  # paused runs hold version 0 for it from the start
                    time.sleep(min(self.poll_s, 5 * PAUSED_POLL_S) if self.paused else self.poll_s)
        finally:
            self.metrics.close()
            self.client.close()

    def _went_back(self, version: int, next_version: int, every: int) -> int:
        """The job went back to ``version``: join again for the shards' endpoints, and return the
        next version to measure. Paused, the versions made again, where the pauses now come;
        else the next one not measured. (The caller forgets what it measured of the abandoned
        history: no final measurement for the new one, even of the same version number.)"""
        self._join()
        if self.paused:
            next_version = -(-version // every) * every
        log.info("the job went back to version %d: joined again, measuring from %d", version, next_version)
        return next_version

    def _changed_after_final(self, final: P.Status) -> P.Status | None:
        """After a final report that shard 0 did not finish on: wait while it answers, stopped
        at the same version of the same history. The status that shows the job went back (a
        rollback before every worker knew the stop), or None once shard 0 is gone."""
        answered = time.monotonic()
        while True:
            time.sleep(self.poll_s)
            try:
                status = self.client.send_to_coordinator(P.StatusRequest(), P.Status,
                                                         timeout_s=FINAL_LINGER_REPLY_S)
            except (TransportTimeout, RemoteError) as exc:
                if time.monotonic() - answered < FINAL_GONE_S:
                    continue
                log.info("after the final report: shard 0 is gone (%s)", exc)
                return None
            answered = time.monotonic()
            assert isinstance(status, P.Status)
            if not status.stop or (status.version, status.log_hash) != (final.version, final.log_hash):
                return status

    def _catch_up_from(self, next_version: int, final: int, every: int) -> int:
        """At the stop, the shards wait for the final measurement at most finish_timeout_s: with a
        backlog (the evaluator yields to training, so on a busy host it falls behind), measure
        only the newest snapshots that fit in half that time, by the time one evaluation took."""
        backlog = max(0, (final - next_version) // every + (1 if final >= next_version else 0))
        per_eval = max((r["eval_s"] for r in self.results[-3:]), default=0.0) * 1.5 + 0.05
        budget = 0.5 * self.cfg.training.finish_timeout_s
        fits = int(budget / per_eval) if per_eval > 0 else backlog
        if backlog <= fits:
            return next_version
        skip_to = final // every * every - max(0, fits - 1) * every
        log.warning("evaluator %d measurements behind at the stop: skipping to version %d", backlog, skip_to)
        self.skipped += max(0, (skip_to - next_version) // every)
        return max(next_version, skip_to)

    def _join(self) -> None:
        welcome = self.client.join("evaluator", self.cfg.job_digest(), "cpu")
        self.consistent, self.token = welcome.consistent_pulls, welcome.token

    def _pull(self, version: int, exact: bool) -> PullResult:
        """The parameters of ``version``, which the coordinator's status says exist (see
        :func:`pull_joining_again`: a shard may have restarted at a new address)."""
        def pull(abort: Callable[[], str | None]) -> PullResult:
            return self.client.pull(self.params, worker_id=-1, min_version=version, honor_stop=False,
                                    exact=exact, consistent=self.consistent, abort=abort)

        return pull_joining_again(pull, self._join, what=f"version {version}",
                                  patience_s=self.pull_patience_s, timeout_s=self.cfg.transport.timeout_s)

    def _measure(self, version: int, *, report: bool, exact: bool) -> int:
        res = self._pull(version, exact)
        self.flat.load_(self.params)
        t0 = time.perf_counter()
        acc, loss = evaluate(self.model, self.data, limit=self.cfg.evaluator.test_samples,
                             batch=self.cfg.evaluator.batch)
        rec = {"version": res.version, "samples": res.samples,
               "accuracy": acc, "loss": loss, "version_time": res.version_time,
               "eval_s": time.perf_counter() - t0}
        self.results.append(rec)
        self._last_hash = res.log_hash   # of the newest measurement, which the final report repeats
        self.metrics.write(**rec)
        log.info("version %d: test accuracy %.4f loss %.4f", res.version, acc, loss)
        if report:
            self._report(rec, final=False, log_hash=res.log_hash)
        return res.version

    def _report(self, rec: dict | None, *, final: bool, log_hash: str = "") -> bool:
        """Send a measurement; for a final one, True when shard 0 finishes on it (or is gone)."""
        def send() -> P.Message:
            if rec is None:
                msg = P.EvalReport(final=final, token=self.token)
            else:
                msg = P.EvalReport(version=int(rec["version"]), samples=int(rec["samples"]),
                                   accuracy=float(rec["accuracy"]), loss=float(rec["loss"]), final=final,
                                   log_hash=log_hash, token=self.token)
            return self.client.send_to_coordinator(msg, P.Ack)

        try:
            try:
                ack = send()
            except RemoteError as exc:
                if exc.code != "unknown_evaluator":   # "superseded": a newer evaluator counts
                    raise
                log.info("shard 0 does not know this evaluator (restarted?): joining again")
                self._join()
                ack = send()
        except Exception as exc:  # after the stop shard 0 may already be gone: nothing to tell
            if not final or (isinstance(exc, RemoteError) and exc.code == "superseded"):
                raise
            log.info("final report not delivered: %s", exc)
            return True
        return isinstance(ack, P.Ack) and ack.what == "eval_final_done"
