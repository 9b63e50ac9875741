"""evaluator.pause_training with real processes: training waits at every measured version until
the evaluator has reported it, the pauses stay out of the run's times, and an evaluator that dies
during a pause holds the job up for at most ``pause_timeout_s``. Also, paused or not, the
evaluator follows a shard that restarts at a new address and rolls the job back; and a forged,
well-formed measurement of another history neither ends a pause nor counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from ps_common.transport import Connection, RemoteError
from tests.cluster_util import final_params, start_job, wait_exit, write_config

pytestmark = pytest.mark.system


def _lines(path):
    return list(read_jsonl(path)) if path.exists() else []


ITERATIONS, EVERY = 60, 20
MEASURED = list(range(0, ITERATIONS + 1, EVERY))     # 0, 20, 40, 60
PAUSED = MEASURED[:-1]                               # the final version ends the run, no pause


def _launch(run_dir, pause):
    cmd = [sys.executable, "-m", "ps_launcher.cli", "configs/mnist_bsp.yaml", "--run-dir", str(run_dir),
           "--no-progress", "--set", "training.epochs=null", "--set", f"training.max_iterations={ITERATIONS}",
           "--set", "training.target_accuracy=null", "--set", f"evaluator.every_iterations={EVERY}",
           "--set", "evaluator.test_samples=2000",
           "--set", f"evaluator.pause_training={str(pause).lower()}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_training_waits_for_each_measurement_and_its_times_leave_the_pauses_out(tmp_path):
    run_dir = tmp_path / "run"
    summary = _launch(run_dir, pause=True)
    assert summary["final"]["agree"] and summary["iterations"] == ITERATIONS
    # The pauses move no sample and change no update: bit for bit the run without them.
    plain = _launch(tmp_path / "plain", pause=False)
    assert plain["evaluator_pauses"] is None
    paused_params, _ = final_params(run_dir)
    plain_params, _ = final_params(tmp_path / "plain")
    assert np.array_equal(paused_params, plain_params)
    coord = {r["version"]: r for r in _lines(run_dir / "metrics" / "coordinator.jsonl") if "event" not in r}
    evals = {e["version"]: e for e in _lines(run_dir / "metrics" / "evaluator.jsonl")}
    assert sorted(evals) == MEASURED
    for v in PAUSED:
        nxt = coord[v + 1]
        # Version v + 1 was made after the measurement of v was written: nobody trained meanwhile.
        assert nxt["wall_time"] > evals[v]["wall_time"], (v, nxt["wall_time"], evals[v]["wall_time"])
        # The pause enclosed the whole evaluation, and the iteration's duration leaves it out.
        assert nxt["paused_s"] >= evals[v]["eval_s"], (v, nxt["paused_s"], evals[v]["eval_s"])
        if v > 0:  # between the two commits: the iteration's duration plus the pause, counted once
            between = nxt["wall_time"] - coord[v]["wall_time"]
            assert abs(between - nxt["duration"] - nxt["paused_s"]) < 0.5 * evals[v]["eval_s"], (v, between, nxt)
    assert all(coord[v]["paused_s"] == 0.0 for v in coord if v - 1 not in PAUSED)
    pauses = summary["evaluator_pauses"]
    assert pauses["count"] == len(PAUSED) and pauses["total_s"] == pytest.approx(coord[ITERATIONS]["paused_total_s"])
    assert pauses["total_s"] >= sum(evals[v]["eval_s"] for v in PAUSED)
    assert summary["training_s"] == pytest.approx(coord[ITERATIONS]["elapsed"])
    # Time to accuracy is on the training clock: the measured version's elapsed, pauses left out.
    for p in summary["accuracy_curve"]:
        if p["version"] > 0:
            assert p["elapsed"] == pytest.approx(coord[p["version"]]["elapsed"], abs=0.05), p
    assert "training paused for the evaluator" in (run_dir / "summary.md").read_text()


def test_an_evaluator_that_dies_holds_training_up_for_at_most_the_pause_timeout(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 64, "max_iterations": 60, "finish_timeout_s": 5},
        "cluster": {"num_shards": 2, "num_workers": 2},
        "evaluator": {"every_iterations": 10, "nice": 0, "pause_training": True, "pause_timeout_s": 2.0}})
    run_dir = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 2, run_dir, evaluator=True)
    evaluator = next(c for c in procs.children if c.role == "evaluator")
    coord_log = run_dir / "metrics" / "coordinator.jsonl"
    deadline = time.monotonic() + 120
    while not any(r.get("event") == "eval" for r in _lines(coord_log)):
        assert time.monotonic() < deadline, "the evaluator never reported"
        assert evaluator.proc.poll() is None, evaluator.tail()
        time.sleep(0.02)
    os.kill(evaluator.proc.pid, signal.SIGKILL)   # it dies with a measured version ahead
    evaluator.proc.wait(timeout=10)
    # Well-formed reports of the held version by a peer with the evaluator's credential but no
    # token a Welcome gave: refused, so the pause is not ended by them (it times out below).
    forger = Connection(zmq.Context.instance(), eps[0], role="evaluator", timeout_s=10, security=cfg.security)
    try:
        for token in ("", "f" * 32):
            status = forger.request(P.StatusRequest(), P.Status)
            with pytest.raises(RemoteError) as err:
                forger.request(P.EvalReport(version=status.version, accuracy=0.5, log_hash=status.log_hash,
                                            final=True, token=token), P.Ack)
            assert err.value.code == "unknown_evaluator"
    finally:
        forger.close()
    wait_exit([*workers, *[c for c in procs.children if c.role.startswith("shard")]], timeout_s=120)
    recs = _lines(coord_log)
    timeouts = [r for r in recs if r.get("event") == "evaluator_pause_timeout"]
    assert len(timeouts) == 1, "one pause timed out; none was taken after it"
    held = timeouts[0]["version"]
    commits = {r["version"]: r for r in recs if "event" not in r}
    assert max(commits) == 60, "training went on to the end"
    assert commits[held + 1]["paused_s"] >= 2.0, "the workers waited out the timeout"
    assert all(commits[v]["paused_s"] == 0.0 for v in commits if v > held + 1)


@pytest.mark.parametrize("pause", [True, False], ids=["paused", "beside"])
def test_the_evaluator_follows_a_rollback_and_the_result_is_single_process_sgd(procs, tmp_path, pause):
    """A follower shard killed and restarted at a new address with --resume rolls every shard
    back to a common checkpoint, which may be before versions already measured: the evaluator
    joins again for the new endpoints (it saw the version go back, or a shard stopped
    answering), measures through to the end, no pause waits out its timeout, and the parameters
    equal single-process SGD over the same batches."""
    from ps_ml.datasets import load_dataset
    from ps_ml.reference import train_reference
    from tests.cluster_util import consistent_end, status

    cfg_path, cfg = write_config(tmp_path, {
        "run": {"name": "pause-rollback", "seed": 2}, "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": 600, "synthetic_test": 300},
        # finish_timeout_s: beside training, the evaluator may wait PULL_PATIENCE_S (10 s) on the
        # dead follower's address before it joins again for the new one; with 10 s here too, shard
        # 0 could finish 60 ms before it came back (seen in CI), and the evaluator failed
        "training": {"global_batch": 60, "max_iterations": 60, "finish_timeout_s": 30},
        "optimizer": {"lr": 0.05, "momentum": 0.9}, "cluster": {"num_shards": 2, "num_workers": 2},
        "checkpoint": {"every_iterations": 10}, "heartbeat": {"interval_s": 0.2, "timeout_s": 2.0},
        "evaluator": {"every_iterations": 10, "nice": 0, "pause_training": pause, "pause_timeout_s": 5.0}})
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 2, run, evaluator=True)
    evaluator = next(c for c in procs.children if c.role == "evaluator")
    deadline = time.monotonic() + 120
    while status(eps[0]).version < 25:
        assert time.monotonic() < deadline, "version 25 not reached"
        time.sleep(0.05)
    shard1 = next(c for c in procs.children if c.role == "shard-1")
    os.kill(shard1.proc.pid, signal.SIGKILL)
    shard1.proc.wait(timeout=10)
    again = procs.start("shard-1b", "ps_server.cli", ["--config", str(cfg_path), "--run-dir", str(run),
                                                       "--shard", "1", "--port", "0", "--coordinator", eps[0],
                                                       "--resume"])
    procs.wait_endpoint(again, 60)
    wait_exit([*workers, evaluator], timeout_s=180)
    wait_exit([c for c in procs.children if c.role.startswith("shard") and c.proc.poll() != -9], 60)
    params, version = consistent_end(run, 2)
    assert version == 60
    recs = _lines(run / "metrics" / "coordinator.jsonl")
    (rollback,) = [r for r in recs if r.get("event") == "rollback"]
    assert not [r for r in recs if r.get("event") == "evaluator_pause_timeout"], "a pause waited out its timeout"
    measured = [e["version"] for e in _lines(run / "metrics" / "evaluator.jsonl")]
    assert measured[-1] == 60 and any(v > rollback["version"] for v in measured), (rollback, measured)
    if pause:  # every version a pause held after the rollback was measured (as made again)
        assert all(v in measured for v in range(10 * -(-rollback["version"] // 10), 61, 10)), (rollback, measured)
    # (beside training it may skip a version whose snapshot the rollback's restore dropped)
    data = load_dataset("synthetic", seed=2, synthetic_train=600, synthetic_test=300)
    ref = train_reference("mlp", 2, data, 2, 60, 60, lr=0.05, momentum=0.9)
    assert np.linalg.norm(params - ref) / np.linalg.norm(ref) < 1e-5


def test_a_forged_measurement_of_another_history_does_not_end_a_pause(procs, tmp_path):
    """Real processes (shard 0, a worker) against a client holding the evaluator's credential:
    it joins as the job's evaluator and reports the version training paused at. With a log hash
    of another history the report is set aside (acknowledged, counted): the pause holds and the
    accuracy is not recorded. The same report with this history's hash ends the pause."""
    from ps_worker.client import ShardClients
    from tests.cluster_util import start_servers, start_workers, status

    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 12, "target_accuracy": None},
        "cluster": {"num_shards": 1, "num_workers": 1},
        "evaluator": {"enabled": True, "pause_training": True, "every_iterations": 5, "pause_timeout_s": 60},
        "transport": {"timeout_s": 120}})
    run_dir = tmp_path / "run"
    (endpoint,) = start_servers(procs, cfg_path, 1, run_dir)
    forger = ShardClients(zmq.Context.instance(), endpoint, timeout_s=30, connect_timeout_s=30,
                          security=cfg.security, role="evaluator")
    try:
        forger.join("forged-evaluator", cfg.job_digest(), "cpu")
        start_workers(procs, cfg_path, endpoint, 1, run_dir)

        def paused_at(version: int, timeout_s: float = 60.0) -> P.Status:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                st = status(endpoint)
                assert st.version <= version, f"training went past the pause at {version}: {st}"
                if st.started and st.version == version:   # the pause at 0 begins with the job
                    return st
                time.sleep(0.05)
            raise AssertionError(f"never reached version {version}")

        start = paused_at(0)                             # the first measured version
        report = P.EvalReport(version=0, accuracy=0.1, log_hash=start.log_hash, token=forger.token)
        assert isinstance(forger.send_to_coordinator(report, P.Ack), P.Ack)
        honest = paused_at(5)
        report = P.EvalReport(version=5, accuracy=0.25, log_hash="f" * 16, token=forger.token)
        assert isinstance(forger.send_to_coordinator(report, P.Ack), P.Ack)
        time.sleep(1.0)                                  # 1 s: dozens of iterations, were it not held
        st = status(endpoint)
        assert st.version == 5 and st.last_accuracy == 0.1, st
        report = P.EvalReport(version=5, accuracy=0.25, log_hash=honest.log_hash, token=forger.token)
        assert isinstance(forger.send_to_coordinator(report, P.Ack), P.Ack)
        at_10 = paused_at(10)
        assert at_10.last_accuracy == 0.25, at_10
        report = P.EvalReport(version=10, accuracy=0.3, log_hash=at_10.log_hash, token=forger.token)
        assert isinstance(forger.send_to_coordinator(report, P.Ack), P.Ack)
        deadline = time.monotonic() + 60
        while not ((st := status(endpoint)).stop and st.version == 12) and time.monotonic() < deadline:
            time.sleep(0.05)
        report = P.EvalReport(version=12, accuracy=0.3, log_hash=st.log_hash, final=True, token=forger.token)
        assert forger.send_to_coordinator(report, P.Ack).what == "eval_final_done"
    finally:
        forger.close()
    wait_exit(procs.children, timeout_s=60)
    counters = [r for r in _lines(run_dir / "metrics" / "coordinator.jsonl") if r.get("event") == "counters"]
    assert counters[-1]["counters"].get("eval.other_history") == 1, counters
