"""The evaluator's reports against a real shard 0 (``Lead`` + ``ShardServer``), as forged,
well-formed messages: a report ends a pause and can stop the job at the target accuracy, so
one of a version not reached, with an impossible accuracy, or of a history a rollback abandoned
(in flight across the rollback) is set aside: acknowledged, counted, and nothing else (an
error would end the evaluator, which meets the first after a rollback). Found by reviews.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ps_common import protocol as P
from ps_server import control
from tests.cluster_util import in_process_shard_0, write_config


def _job(tmp_path: Path, **extra: Any) -> Any:
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 50, "target_accuracy": 0.9},
        "cluster": {"num_shards": 1, "num_workers": 1},
        "evaluator": {"enabled": True, "pause_training": True, "every_iterations": 1, "pause_timeout_s": 30},
        **extra})
    return cfg


class _Driver:
    def __init__(self, s0: Any) -> None:
        self.s0, self.lead, self.coord = s0, s0.role, s0.role.coord
        self.sent: list[P.Message] = []
        self.evaluator_token = ""
        s0.router_reply = lambda _ident, msg: self.sent.append(msg) or True

    def join(self, name: str, role: str = "worker") -> tuple[int, str]:
        self.lead._on_join(name.encode(), role, P.Join(name=name, instance=name, job_digest=self.s0.job_digest))
        welcome = [m for m in self.sent if isinstance(m, P.Welcome)][-1]
        if role == "evaluator":
            self.evaluator_token = welcome.token
        return welcome.worker_id, welcome.token

    def evaluator_and_trained_worker(self, pushes: int) -> tuple[int, str]:
        """An evaluator joins, then worker "w0", whose ``pushes`` gradients each make a version."""
        self.join("ev", "evaluator")
        w, token = self.join("w0")
        for _ in range(pushes):
            self.push(w, token)
        return w, token

    def push(self, worker: int, token: str) -> None:
        x = self.coord.plan[worker].batch_size
        self.s0._on_push(b"w", "worker", P.Push(worker_id=worker, token=token, iteration=self.coord.iteration,
                                                batch_size=x, arrays=[np.zeros(self.s0.num_params, np.float32)]))
        self.lead.after_messages()

    def report(self, version: int, accuracy: float, log_hash: str = "", final: bool = False,
               token: str | None = None) -> P.Message:
        msg = P.EvalReport(version=version, accuracy=accuracy, log_hash=log_hash, final=final,
                           token=self.evaluator_token if token is None else token)
        out = self.lead._on_eval(b"ev", "evaluator", msg)
        self.lead.after_messages()
        return out


@pytest.mark.parametrize("version, accuracy, counter", [
    (999, 0.2, "eval.not_reached"),            # before: it ended the pause at version 1
    (1, float("nan"), "eval.bad_accuracy"),    # before: stored, and shown by the status
    (1, 1.5, "eval.bad_accuracy"),
    (12345, 1.0, "eval.not_reached"),          # before: it stopped the job at the target
])
def test_a_report_of_a_version_not_reached_or_an_impossible_accuracy_is_set_aside(tmp_path, version, accuracy,
                                                                                   counter):
    with in_process_shard_0(_job(tmp_path), tmp_path / "run") as s0:
        d = _Driver(s0)
        d.join("ev", "evaluator")
        w, token = d.join("w0")
        d.report(0, 0.1)
        d.push(w, token)
        assert s0.state.version == 1 and d.coord.pause.held == 1
        assert isinstance(d.report(version, accuracy), P.Ack)
        assert d.coord.counters[counter] == 1
        assert d.coord.pause.held == 1 and not d.coord.stop and d.coord.last_accuracy == 0.1
        d.report(1, 0.5, s0.state.log_hash)   # the real measurement ends the pause
        assert d.coord.pause.held is None and not d.coord.stop


def test_a_measurement_from_before_a_rollback_counts_for_nothing_in_the_new_history(tmp_path):
    with in_process_shard_0(_job(tmp_path, checkpoint={"every_iterations": 1}), tmp_path / "run") as s0:
        d = _Driver(s0)
        d.join("ev", "evaluator")
        w, token = d.join("w0")
        d.report(0, 0.1, s0.state.log_hash)
        d.push(w, token)
        d.report(1, 0.2, s0.state.log_hash)
        d.push(w, token)
        old = s0.state.log_hash               # version 2 of the history about to be abandoned
        s0.checkpointer.flush()
        d.lead.rollback_all(1, "a test")
        w, token = d.join("w0-again")
        d.push(w, token)                      # version 2 again, of the new history
        assert s0.state.version == 2 and s0.state.log_hash != old and d.coord.pause.held == 2
        assert isinstance(d.report(2, 0.95, old), P.Ack)   # in flight across the rollback
        assert d.coord.pause.held == 2 and not d.coord.stop, "set aside: the new version 2 is not measured"
        assert d.coord.counters["eval.other_history"] == 1
        assert not d.coord.evaluator_done
        ack = d.report(2, 0.5, old, final=True)   # set aside too: the evaluator stays for the new one
        assert isinstance(ack, P.Ack) and ack.what == "eval_report"
        assert not d.coord.evaluator_done and d.coord.counters["eval.other_history"] == 2
        assert d.coord.pause.held == 2 and not d.coord.stop
        d.report(2, 0.95, s0.state.log_hash)  # the new history's own measurement counts
        assert d.coord.pause.held is None and d.coord.stop


def test_a_final_measurement_of_the_history_a_rollback_left_does_not_end_the_new_one(tmp_path):
    """The stop at version 2, the evaluator's final report, then a rollback before every
    worker knew the stop: shard 0 must wait for the new history's final measurement, not
    finish on the old one's (before: ``evaluator_done`` survived the rollback)."""
    with in_process_shard_0(_job(tmp_path, checkpoint={"every_iterations": 1},
                                 training={"global_batch": 32, "max_iterations": 2}), tmp_path / "run") as s0:
        d = _Driver(s0)
        d.join("ev", "evaluator")
        w, token = d.join("w0")
        for v in range(2):
            d.report(v, 0.1, s0.state.log_hash)
            d.push(w, token)
        assert d.coord.stop and s0.state.version == 2
        ack = d.report(2, 0.4, s0.state.log_hash, final=True)
        assert d.coord.evaluator_done and not d.coord.everyone_knows_stop()   # w0 not told yet
        assert isinstance(ack, P.Ack) and ack.what == "eval_report", "the evaluator must stay"
        s0.checkpointer.flush()
        d.lead.rollback_all(1, "a test")
        assert not d.coord.evaluator_done
        w, token = d.join("w0-again")
        d.report(1, 0.2, s0.state.log_hash)
        d.push(w, token)                                  # version 2 again, a new history: stop
        assert d.coord.stop and s0.state.version == 2
        d.coord.told_stop(w)
        assert not d.coord.everyone_knows_stop(), "no final measurement of this history yet"
        ack = d.report(2, 0.45, s0.state.log_hash, final=True)
        assert d.coord.everyone_knows_stop() and isinstance(ack, P.Ack) and ack.what == "eval_final_done"


def test_only_the_newest_evaluators_reports_count(tmp_path):
    """Two evaluator processes (an operator restarted one while the old one still ran): once
    the newer one has reported, the older one's reports are refused ``superseded`` (it ends); a
    token shard 0 never gave is refused ``unknown_evaluator`` (its evaluator joins again);
    neither changes anything. An observer that joins as an evaluator and never reports
    supersedes nobody."""
    from ps_server.router import Refused

    with in_process_shard_0(_job(tmp_path), tmp_path / "run") as s0:
        d = _Driver(s0)
        _, old = d.join("ev-a", "evaluator")
        w, token = d.join("w0")
        d.join("observer", "evaluator")
        d.report(0, 0.1, s0.state.log_hash, token=old)
        d.push(w, token)
        _, new = d.join("ev-b", "evaluator")
        assert old and new and old != new
        d.report(1, 0.2, s0.state.log_hash, token=old)   # ev-b has not reported: ev-a still counts
        assert d.coord.pause.held is None and d.coord.last_accuracy == 0.2
        d.push(w, token)
        d.report(2, 0.3, s0.state.log_hash, token=new)   # now ev-b counts
        assert d.coord.pause.held is None and d.coord.last_accuracy == 0.3
        d.push(w, token)
        for t, code in ((old, "superseded"), ("", "unknown_evaluator"), ("f" * 32, "unknown_evaluator"),
                        (new[:-1] + "\u00e9", "unknown_evaluator")):
            with pytest.raises(Refused) as err:
                d.report(3, 0.99, s0.state.log_hash, final=True, token=t)
            assert err.value.code == code
        assert d.coord.pause.held == 3 and not d.coord.stop and not d.coord.evaluator_done
        assert d.coord.last_accuracy == 0.3 and d.coord.counters["eval.superseded"] == 1
        d.report(3, 0.5, s0.state.log_hash, token=new)
        assert d.coord.pause.held is None and d.coord.last_accuracy == 0.5


def test_without_pauses_a_measurement_of_an_older_version_of_the_abandoned_history_is_set_aside(tmp_path):
    """Beside training the evaluator measures kept snapshots of older versions. Their answers
    carried no log hash before 2026-11-28 (only the current version's did), so a measurement
    in flight across a rollback counted for the new history's version of the same number.
    Every snapshot now keeps its version's hash: the real shard answers an exact pull of an
    older version with it, and a report carrying it is checked."""
    from ps_server.pulls import PendingPull

    job = _job(tmp_path, checkpoint={"every_iterations": 1},
               evaluator={"enabled": True, "pause_training": False, "every_iterations": 1})
    with in_process_shard_0(job, tmp_path / "run") as s0:
        d = _Driver(s0)
        d.evaluator_and_trained_worker(3)
        hashes = {v: d.lead.followers.hash_of(v) for v in (1, 2)}
        answer = s0._pull_reply(PendingPull(b"ev", -1, 1, exact=True))
        assert isinstance(answer, P.Params) and answer.version == 1 and s0.state.version == 3
        assert answer.log_hash == hashes[1], "an older snapshot's answer names its history"
        s0.checkpointer.flush()
        d.lead.rollback_all(1, "a test")
        w, token = d.join("w0-again")
        d.push(w, token)
        d.push(w, token)                               # versions 2 and 3 again, a new history
        assert s0.state.version == 3 and d.lead.followers.hash_of(2) != hashes[2]
        d.report(2, 0.99, hashes[2])                   # the old version 2, measured before the rollback
        assert d.coord.counters["eval.other_history"] == 1 and d.coord.last_accuracy != 0.99
        d.report(2, 0.5, d.lead.followers.hash_of(2))  # this history's version 2 counts
        assert d.coord.last_accuracy == 0.5


def test_a_measurement_older_than_the_commit_log_is_checked_against_its_kept_snapshot(tmp_path, monkeypatch):
    """The evaluator measures kept snapshots, and one that lags far enough reports a version
    the coordinator's log of recent commits (1,024) no longer holds. Before 2026-11-29 such a
    report was not checked at all; the snapshot it measured keeps its version's hash. A log of
    4 commits stands in for the 1,024."""
    monkeypatch.setattr(control, "COMMIT_LOG", 4)
    job = _job(tmp_path, evaluator={"enabled": True, "pause_training": False, "every_iterations": 1})
    with in_process_shard_0(job, tmp_path / "run") as s0:
        d = _Driver(s0)
        d.evaluator_and_trained_worker(8)
        assert s0.state.version == 8 and d.lead.followers.log[0].version == 5
        assert d.lead.followers.hash_of(2) is None, "version 2 is older than the log"
        kept = s0.state.snapshot_at(2)
        assert kept is not None
        d.report(2, 0.99, "f" * 16)                    # another history's version 2
        assert d.coord.counters["eval.other_history"] == 1 and d.coord.last_accuracy != 0.99
        d.report(2, 0.5, kept.log_hash)                # this history's
        assert d.coord.last_accuracy == 0.5 and d.coord.counters["eval.other_history"] == 1

