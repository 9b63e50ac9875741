"""evaluator.pause_training with no sockets: the coordinator holds every assignment at each
measured version until the evaluator reports that version (or the pause times out), and its
clock leaves the pause out of elapsed time and of the iteration's duration. Also the summary's
arithmetic over such records and the evaluator's polling rule."""

from __future__ import annotations

import json
import time

import pytest

from batchsize_manager.manager import BatchSizeManager
from ps_common.config import ConfigError, validate
from ps_common.transport import TransportTimeout
from ps_launcher.summary import PausedBefore, summarize, time_to_accuracy
from ps_server.coordinator import Coordinator
from ps_server.pause import EvaluatorPause
from ps_server.sync import sync_policy_for
from ps_worker.client import PullAborted
from ps_worker.evaluator import PAUSED_POLL_S, next_poll_s, pull_joining_again

S = 2  # shards


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def coordinator(sync="bsp", every=2, evaluator=True, pause=True, **training):
    cfg = validate({"training": {"global_batch": 40, "max_iterations": 100, **training},
                    "cluster": {"num_workers": 2}, "mode": {"sync": sync},
                    "evaluator": {"every_iterations": every, "pause_training": pause,
                                  "pause_timeout_s": 5.0}})
    clock = Clock()
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 40), sync_policy_for(cfg), num_shards=S,
                    clock=clock)
    if evaluator:
        c.evaluator_joined()
    for i in range(2):
        c.join(f"w{i}", f"instance-{i}")
    c.try_start()
    return c, clock


def one_iteration(c, clock, seconds=1.0):
    """Both workers compute for ``seconds`` and push to every shard; the commit's record."""
    t = c.iteration
    for w in c.live():
        assert c.assignment(w, t) is not None
    clock.t += seconds
    for w in c.live():
        for k in range(S):
            c.on_gradient(k, w, t, c.expected(w, t))
    (d,) = c.decide()
    return d.record


def test_assignments_wait_at_each_measured_version_until_the_evaluator_reports_it():
    c, clock = coordinator(every=2)
    assert c.pause.held == 0 and c.assignment(0, 0) is None, "version 0 is measured before training"
    assert "paused while the evaluator measures version 0" in c.waiting_reason(0, 0, 0)
    clock.t += 3.0
    assert c.on_eval(0.1, version=0) is True
    rec = one_iteration(c, clock, 1.0)
    assert rec.version == 1 and c.pause.held is None, "version 1 is not measured: no pause"
    assert rec.duration == pytest.approx(1.0) and rec.elapsed == pytest.approx(1.0), \
        "the 3 s pause before it is left out"
    assert rec.paused_s == pytest.approx(3.0) and rec.paused_total_s == pytest.approx(3.0)
    rec = one_iteration(c, clock, 1.0)
    assert rec.version == 2 and c.pause.held == 2
    assert c.assignment(0, 2) is None and c.assignment(1, 2) is None
    clock.t += 0.5
    assert c.on_eval(0.2, version=1) is False, "a measurement of another version ends nothing"
    assert c.assignment(0, 2) is None
    clock.t += 1.5
    assert c.elapsed() == pytest.approx(2.0), "the pause under way does not count either"
    assert c.on_eval(0.3, version=2) is True
    assert c.assignment(0, 2) is not None
    rec = one_iteration(c, clock, 1.0)
    assert rec.duration == pytest.approx(1.0) and rec.elapsed == pytest.approx(3.0)
    assert rec.paused_s == pytest.approx(2.0) and rec.paused_total_s == pytest.approx(5.0)
    assert c.pause.pauses == 2


def test_no_pause_without_the_option():
    c, clock = coordinator(pause=False)
    assert c.pause.held is None and c.assignment(0, 0) is not None
    one_iteration(c, clock)
    rec = one_iteration(c, clock)
    assert rec.version == 2 and c.pause.held is None and rec.paused_total_s == 0.0


def test_with_pauses_the_job_starts_once_the_evaluator_has_joined():
    c, clock = coordinator(evaluator=False)
    assert not c.started and c.assignment(0, 0) is None
    assert "waiting for the evaluator" in c.waiting_reason(0, 0, 0)
    c.evaluator_joined()
    assert c.try_start() is not None and c.pause.held == 0
    c.on_eval(0.1, version=0)
    assert c.assignment(0, 0) is not None


def test_a_pause_that_times_out_lets_training_go_on_and_pauses_resume_with_the_next_report():
    c, clock = coordinator(every=1)
    clock.t += 4.9
    assert c.check_pause() is False and c.assignment(0, 0) is None
    clock.t += 0.2
    assert c.check_pause() is True, "5 s without a measurement of version 0"
    assert [e["event"] for e in c.drain_events()] == ["evaluator_pause_timeout"]
    rec = one_iteration(c, clock)
    assert rec.paused_s == pytest.approx(5.1) and rec.elapsed == pytest.approx(1.0)
    assert c.pause.held is None, "no pause while the evaluator is silent"
    one_iteration(c, clock)
    c.on_eval(0.5, version=0)  # it is back (late): version 3 is held again
    rec = one_iteration(c, clock)
    assert rec.version == 3 and c.pause.held == 3 and c.pause.timeouts == 1


def test_a_stop_ends_the_pause_and_the_max_seconds_rule_counts_training_time_only():
    c, clock = coordinator(every=1, max_seconds=2.5)
    c.on_eval(0.1, version=0)
    one_iteration(c, clock, 1.0)
    assert c.pause.held == 1
    clock.t += 4.0  # paused: 5 s of wall time, 1 s of training
    assert c.check_time() is False, "the pause is not training time"
    c.on_eval(0.2, version=1)
    one_iteration(c, clock, 1.0)
    c.on_eval(0.3, version=2)
    one_iteration(c, clock, 1.0)   # 3 s of training: the commit stops the run
    assert c.stop and c.stop_version == 3
    assert c.pause.held is None, "a stop is never held"


def test_target_accuracy_reported_during_a_pause_stops_at_the_measured_version():
    c, clock = coordinator(every=2, target_accuracy=0.9)
    c.on_eval(0.1, version=0)
    one_iteration(c, clock)
    one_iteration(c, clock)
    assert c.pause.held == 2
    c.on_eval(0.95, version=2)
    c.request_stop("reached target_accuracy")   # what shard 0 does on that report
    assert c.stop_version == 2, "nothing trained past the version that reached the target"


def test_async_modes_hold_new_assignments_and_let_assigned_work_commit():
    c, clock = coordinator(sync="asp", every=2)
    c.on_eval(0.1, version=0)
    a0, a1 = c.assignment(0, 0), c.assignment(1, 0)
    assert a0 is not None and a1 is not None
    for w, a in ((0, a0), (1, a1)):
        for k in range(S):
            c.on_gradient(k, w, 0, a.batch_size)
    assert len(c.decide()) == 1 and len(c.decide()) == 1
    assert c.version == 2 and c.pause.held == 2
    assert c.assignment(0, 1) is None and c.assignment(1, 1) is None
    c.on_eval(0.2, version=2)
    assert c.assignment(0, 1) is not None


def test_state_dict_elapsed_leaves_the_pauses_out_and_a_resume_holds_nothing():
    c, clock = coordinator(every=1)
    clock.t += 2.0
    c.on_eval(0.1, version=0)
    one_iteration(c, clock, 1.0)
    clock.t += 7.0  # a pause under way at the checkpoint
    state = c.state_dict()
    assert state["elapsed"] == pytest.approx(1.0)
    c.load_state_dict(state)
    assert c.pause.held is None


def test_pause_timeout_must_be_below_the_transport_timeout():
    with pytest.raises((ConfigError, ValueError), match="pause_timeout_s"):
        validate({"evaluator": {"pause_training": True, "pause_timeout_s": 200}})
    validate({"evaluator": {"pause_training": False, "pause_timeout_s": 200}})  # unused: fine


def test_the_pause_rule_counts_each_pause_once():
    p = EvaluatorPause(every=3, timeout_s=1.0, enabled=True, present=True)
    assert not p.hold(2, 0.0) and p.hold(3, 0.0) and not p.hold(6, 0.1), "one pause at a time"
    assert p.reported(3, 0.5) == pytest.approx(0.5)
    assert p.reported(3, 0.6) is None, "a repeated report ends nothing"
    assert p.take_since_commit() == pytest.approx(0.5) and p.take_since_commit() == 0.0
    assert p.hold(6, 1.0) and p.expired(1.5) is None and p.expired(2.0) == pytest.approx(1.0)
    assert p.broken and not p.hold(9, 3.0)
    assert p.total_s == pytest.approx(1.5) and p.pauses == 2 and p.timeouts == 1


def test_summary_times_leave_out_the_pauses_before_each_version():
    # records as shard 0 writes them: version 2 and 4 measured, 3 s and 2 s of pause
    coord = [{"version": 1, "elapsed": 1.0, "paused_s": 0.0, "paused_total_s": 0.0},
             {"version": 2, "elapsed": 2.0, "paused_s": 0.0, "paused_total_s": 0.0},
             {"version": 3, "elapsed": 3.0, "paused_s": 3.0, "paused_total_s": 3.0},
             {"version": 4, "elapsed": 4.0, "paused_s": 0.0, "paused_total_s": 3.0},
             {"version": 5, "elapsed": 5.0, "paused_s": 2.0, "paused_total_s": 5.0}]
    p = PausedBefore(coord)
    assert [p.at(v) for v in (0, 2, 3, 4, 5, 9)] == [0.0, 0.0, 3.0, 3.0, 5.0, 5.0]
    assert p.stats() == {"total_s": 5.0, "count": 2, "mean_s": 2.5, "max_s": 3.0}
    assert PausedBefore([{"version": 1, "elapsed": 1.0}]).stats() is None
    curve = [{"accuracy": 0.5, "elapsed": 2.0, "iterations": 2, "samples": 80},
             {"accuracy": 0.9, "elapsed": 7.0 - p.at(4), "iterations": 4, "samples": 160}]
    assert time_to_accuracy(curve, 0.9)["seconds"] == pytest.approx(4.0)


def test_the_evaluator_asks_often_only_when_a_measured_version_is_near():
    # 100 versions per second, 50 to go: sleep about a quarter second, at most slow_s
    assert next_poll_s((0.0, 0), 0.5, 50, 100, slow_s=0.2) == pytest.approx(0.2)
    assert next_poll_s((0.0, 0), 0.5, 50, 100, slow_s=1.0) == pytest.approx(0.25)
    assert next_poll_s((0.0, 0), 0.5, 99, 100, slow_s=1.0) == PAUSED_POLL_S
    assert next_poll_s(None, 0.5, 10, 100, slow_s=1.0) == PAUSED_POLL_S, "no rate yet"
    assert next_poll_s((0.0, 10), 0.5, 10, 100, slow_s=1.0) == PAUSED_POLL_S, "no progress seen"
    assert next_poll_s((0.0, 0), 0.5, 100, 100, slow_s=1.0) == PAUSED_POLL_S, "due now"


def _write_jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.parametrize("workers_from", ["own", "shard0"])
def test_summary_leaves_the_pause_out_of_the_wait_that_held_it(tmp_path, workers_from):
    """Version 2 measured with a 2 s pause: the worker's wait after pushing iteration 1 (the
    wait for version 2's answer) held it; its record, and the report it sent with iteration 2's
    push, say 2.01 s. The summary says 0.01 s, as the coordinator's clock does."""
    coord = [{"version": v, "iteration": v - 1, "elapsed": 0.1 * v, "duration": 0.1, "wall_time": 100.0 + v,
              "paused_s": 2.0 if v == 3 else 0.0, "paused_total_s": 2.0 if v >= 3 else 0.0,
              "applied_samples": 10 * v, "samples": 10 * v, "epoch": 0, "loss": 1.0,
              "accepted": [0], "batch_sizes": {"0": 10},
              "workers": {"0": {"compute_s": 0.05, "prev_wait_s": 2.01 if v == 3 else 0.01,
                                "iteration_s": 2.1 if v == 3 else 0.1}}}
             for v in range(1, 5)]
    _write_jsonl(tmp_path / "metrics" / "coordinator.jsonl", coord)
    if workers_from == "own":
        _write_jsonl(tmp_path / "metrics" / "worker-0.jsonl", [
            {"worker": 0, "iteration": t, "batch_size": 10, "compute_s": 0.05, "push_s": 0.0,
             "wait_s": 2.01 if t == 1 else 0.01, "pull_s": 0.0, "iteration_s": 2.1 if t == 1 else 0.1}
            for t in range(4)])
    s = summarize(tmp_path, global_batch=10)
    w = s["workers"]["0"]
    assert w["mean_wait_s"] == pytest.approx(0.01) and w["mean_iteration_s"] == pytest.approx(0.1)
    assert s["evaluator_pauses"]["total_s"] == 2.0


def test_a_resumed_job_does_not_pause_at_the_version_it_resumes_from():
    c, clock = coordinator(every=1)
    c.on_eval(0.1, version=0)
    one_iteration(c, clock)
    state = c.state_dict()
    c.on_eval(0.2, version=1)
    c.load_state_dict(state)          # a rollback to version 1: the workers join again
    for i in range(2):
        c.join(f"w{i}", f"again-{i}")
    assert c.try_start() is not None and c.pause.held is None, "version 1 was measured before"
    rec = one_iteration(c, clock)
    assert rec.version == 2 and c.pause.held == 2


class _MovedShard:
    """A pull that only a join made after ``registered_after`` joins can satisfy: the joins
    before it hand back the restarted shard's old address, where a pull waits until aborted
    (or, without an abort, for the transport's whole timeout)."""

    def __init__(self, registered_after: int) -> None:
        self.registered_after = registered_after
        self.joins = 0
        self.waits: list[float] = []

    def join(self) -> None:
        self.joins += 1

    def pull(self, abort):
        if self.joins > self.registered_after:
            return "params"
        t0 = time.monotonic()
        while (reason := abort()) is None:
            time.sleep(0.002)
        self.waits.append(time.monotonic() - t0)
        raise PullAborted(reason)


def test_the_evaluator_joins_again_until_a_restarted_shard_has_registered():
    """The first join after a shard restarts can come before the shard has told shard 0 its new
    address: the evaluator keeps joining, each try twice as patient, instead of waiting out the
    whole transport timeout on the old address and failing."""
    shard = _MovedShard(registered_after=2)
    got = pull_joining_again(shard.pull, shard.join, what="version 30", patience_s=0.02, timeout_s=5.0)
    assert got == "params" and shard.joins == 3
    assert len(shard.waits) == 3 and shard.waits[0] >= 0.02
    assert shard.waits[1] >= 0.04 and shard.waits[2] >= 0.08   # growing patience: a slow pull gets through


def test_the_evaluator_gives_up_after_the_transport_timeout_and_says_why():
    shard = _MovedShard(registered_after=10**6)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"version 30 within 0.3s, after joining again \d+ times"):
        pull_joining_again(shard.pull, shard.join, what="version 30", patience_s=0.02, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert shard.joins == len(shard.waits) - 1 >= 3
