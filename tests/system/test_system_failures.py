"""Failures with real processes: a worker SIGKILLed mid-run, a worker joining mid-run, a stall of
the coordinator longer than the heartbeat timeout, a shard killed and restarted from its
checkpoint in every sync mode. Every run must end with all shards at the same version with the
same history."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from ps_ml.datasets import load_dataset, sample_order
from ps_ml.reference import train_reference
from tests.cluster_util import (
    consistent_end,
    operator_request,
    start_job,
    start_servers,
    start_workers,
    status,
    wait_exit,
    write_config,
)

pytestmark = pytest.mark.system


def job(**over):
    base = {
        "run": {"name": "failures", "seed": 2},
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": 600, "synthetic_test": 300},
        "training": {"global_batch": 60, "max_iterations": 80, "finish_timeout_s": 10},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": {"num_shards": 2, "num_workers": 3},
        "evaluator": {"enabled": False},
        "heartbeat": {"interval_s": 0.2, "timeout_s": 2.0},
    }
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def wait_version(ep, version, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if status(ep).version >= version:
            return
        time.sleep(0.05)
    raise AssertionError(f"version {version} not reached")


def coordinator_records(run_dir):
    """Commit records and events; commits undone by a rollback are left out."""
    updates, events = [], []
    for r in read_jsonl(run_dir / "metrics" / "coordinator.jsonl"):
        if "event" in r:
            events.append(r)
            if r["event"] == "rollback":
                updates = [u for u in updates if u["version"] <= r["version"]]
        else:
            updates.append(r)
    return updates, events


def assert_exactly_once_per_epoch(updates, seed, n, unfinished: int = 0):
    """No sample applied twice in an epoch, and every epoch before the last complete.

    ``unfinished``: async modes stop with assignments still out (cut, not yet applied), whose
    samples are never applied although later ones are; at most that many may be missing.
    """
    seen: dict[int, list[int]] = {}
    for r in updates:
        for w in r["accepted"]:
            for e, a, b in r["ranges"][str(w)]:
                seen.setdefault(e, []).extend(sample_order(seed, e, n)[a:b].tolist())
    for e, ids in seen.items():
        assert len(ids) == len(set(ids)), f"epoch {e}: a sample was applied twice"
    last_full = max(seen) - 1
    missing = sum(n - len(set(seen.get(e, []))) for e in range(last_full + 1))
    assert missing <= unfinished, f"{missing} samples missing from full epochs (at most {unfinished} allowed)"


def shards_exit(procs, timeout_s=60):
    wait_exit([c for c in procs.children if c.role.startswith("shard") and c.proc.poll() != -9], timeout_s)


def accuracy_of(params, seed=2):
    from ps_ml.models import FlatParameters, build_model
    from ps_worker.evaluator import evaluate

    model = build_model("mlp", seed=seed)
    FlatParameters(model).load_(params)
    acc, _ = evaluate(model, load_dataset("synthetic", seed=seed, synthetic_train=600, synthetic_test=300))
    return acc


@pytest.mark.parametrize("sync, policy", [("bsp", "uniform"), ("ssp", "uniform"), ("bsp", "lbbsp-cpu")],
                         ids=["bsp", "ssp", "lbbsp"])
def test_worker_sigkill_is_detected_and_training_continues(procs, tmp_path, sync, policy):
    cfg_path, cfg = write_config(tmp_path, job(mode={"sync": sync, "batch_policy": policy},
                                               training={"max_iterations": 200}))
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 3, run)
    wait_version(eps[0], 15)
    victim = workers[1]
    killed_at = time.time()
    os.kill(victim.proc.pid, signal.SIGKILL)
    wait_exit([workers[0], workers[2]], timeout_s=180)
    shards_exit(procs)
    params, version = consistent_end(run, 2)
    updates, events = coordinator_records(run)
    lost = [e for e in events if e["event"] == "worker_removed" and e["reason"].startswith("lost")]
    assert len(lost) == 1
    detect_s = lost[0]["wall_time"] - killed_at
    assert detect_s < cfg.heartbeat.timeout_s + 1.5, f"loss detected after {detect_s:.2f}s"
    print(f"loss of a worker ({sync}/{policy}) detected after {detect_s:.2f}s")
    assert len(lost[0]["live"]) == 2
    # The survivors went on without a pause: nobody waited out a timeout and joined again.
    for ch in (workers[0], workers[2]):
        assert "joining again" not in ch.tail(200), f"{ch.role} stalled and rejoined:\n{ch.tail()}"
    gaps = sorted(r["duration"] for r in updates)
    assert gaps[-1] < cfg.heartbeat.timeout_s + 2.0, f"a {gaps[-1]:.1f} s stall between two updates"
    if sync == "bsp":
        # The in-flight iteration completes without the lost worker (its share is re-served);
        # every later one splits the whole global batch over the two survivors.
        after = [r for r in updates if r["wall_time"] > lost[0]["wall_time"]][1:]
        assert after, "no iteration after the loss"
        assert all(len(r["batch_sizes"]) == 2 and sum(r["batch_sizes"].values()) == 60 for r in after)
        assert_exactly_once_per_epoch(updates, 2, 600)
    acc = accuracy_of(params)
    print(f"final accuracy {acc:.3f}")
    assert acc >= 0.9


def test_worker_joins_mid_run_and_gets_a_share(procs, tmp_path):
    # No stop rule but a cap: the test ends the run once the joiner has trained 10 iterations
    # (a new worker process needs a few seconds to start: torch import).
    j = job(cluster={"num_workers": 2})
    j["training"] = {"global_batch": 60, "max_seconds": 120, "finish_timeout_s": 10}
    cfg_path, cfg = write_config(tmp_path, j)
    run = tmp_path / "run"
    eps, first = start_job(procs, cfg_path, 2, 2, run)
    wait_version(eps[0], 10)
    late = procs.start("worker-late", "ps_worker.cli", ["--config", str(cfg_path), "--server", eps[0],
                                                         "--run-dir", str(run), "--name", "late"])
    _wait_in_log(late, "joined at version", 60)
    wait_version(eps[0], status(eps[0]).version + 10)
    operator_request(eps[0], P.Shutdown(reason="the test is done"), P.Ack)
    wait_exit(first + [late], timeout_s=180)
    shards_exit(procs)
    consistent_end(run, 2)
    updates, _ = coordinator_records(run)
    assert len(updates[0]["batch_sizes"]) == 2
    three = [r for r in updates if len(r["batch_sizes"]) == 3]
    assert three, "the joiner never got a share of the global batch"
    assert all(sum(r["batch_sizes"].values()) == 60 for r in updates)
    assert_exactly_once_per_epoch(updates, 2, 600)


@pytest.mark.timeout(150)
def test_a_worker_restarted_at_once_under_its_name_joins_when_its_old_membership_is_lost(procs, tmp_path):
    """A worker's name keys what was learned about its memory, so no two live members share one
    (``name_in_use``). A worker SIGKILLed and started again at once, under its name, is refused
    while its old membership lives (heartbeat timeout 8 s here, longer than the new process
    takes to start), waits, joins once the old one is declared lost, and the run ends."""
    cfg_path, cfg = write_config(tmp_path, job(cluster={"num_workers": 2},   # max_seconds: a cap
                                               training={"max_iterations": 1_000_000, "max_seconds": 120},
                                               heartbeat={"interval_s": 0.2, "timeout_s": 8.0}))
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 2, run)
    wait_version(eps[0], 10)
    os.kill(workers[1].proc.pid, signal.SIGKILL)
    workers[1].proc.wait(timeout=10)
    again = procs.start("worker-1b", "ps_worker.cli", ["--config", str(cfg_path), "--server", eps[0],
                                                       "--run-dir", str(run), "--name", "worker-1"])
    _wait_in_log(again, "joined at version", 60)
    wait_version(eps[0], status(eps[0]).version + 10)
    operator_request(eps[0], P.Shutdown(reason="the test is done"), P.Ack)
    wait_exit([workers[0], again], timeout_s=120)
    shards_exit(procs)
    assert "name_in_use" in again.log_path.read_text(), again.tail()
    consistent_end(run, 2)
    updates, events = coordinator_records(run)
    joins = [e["worker"] for e in events if e["event"] == "worker_joined" and e["name"] == "worker-1"]
    assert len(joins) == 2, joins
    assert any(joins[1] in r["accepted"] for r in updates), "the restarted worker never trained"
    assert_exactly_once_per_epoch(updates, 2, 600)


def test_a_worker_that_joins_again_replaces_itself(procs, tmp_path):
    """Two worker processes of a three-worker job wait so long for the start that their pulls time
    out and they join again: each still counts once, so the job does not start until a third
    process joins, and then runs with three.

    A pull can time out just as the third process's join starts the job (seen in CI, 1 ms
    apart): that worker joins once more after the start and replaces itself mid-run, so a few
    early commits may accept two pushes; never more than three members, and the run ends
    with all three."""
    cfg_path, cfg = write_config(tmp_path, job(transport={"timeout_s": 1.5, "connect_timeout_s": 60},
                                               training={"max_iterations": 80}))
    run = tmp_path / "run"
    eps, first = start_job(procs, cfg_path, 2, 2, run)
    deadline = time.monotonic() + 60
    while "joining again" not in "".join(c.tail() for c in first):
        assert time.monotonic() < deadline, "the workers never joined again"
        time.sleep(0.2)
    time.sleep(2.0)
    st = status(eps[0])
    assert st.workers == 2 and not st.started, f"rejoins counted twice: {st.workers} members"
    third = procs.start("worker-2", "ps_worker.cli", ["--config", str(cfg_path), "--server", eps[0],
                                                      "--run-dir", str(run), "--name", "worker-2"])
    wait_exit(first + [third], timeout_s=120)
    shards_exit(procs)
    _, version = consistent_end(run, 2)
    updates, _ = coordinator_records(run)
    assert version == 80
    assert max(len(r["accepted"]) for r in updates) == 3
    assert all(len(r["accepted"]) == 3 for r in updates[-20:]), [r["accepted"] for r in updates]
    shard0_log = next(c for c in procs.children if c.role == "shard-0").tail(200)
    live = [int(n) for n in re.findall(r"(\d+) live", shard0_log)]
    assert live and max(live) == 3, shard0_log


def test_coordinator_stall_longer_than_the_heartbeat_timeout_loses_no_worker(procs, tmp_path):
    """Shard 0's loop sleeps 3x the heartbeat timeout (a refit burst, a slow disk): the
    heartbeats queued meanwhile are read before anyone is judged, so nobody is declared lost."""
    cfg_path, cfg = write_config(tmp_path, job(heartbeat={"interval_s": 0.2, "timeout_s": 1.5}))
    run = tmp_path / "run"
    stall = {"LBBSP_FAULTS": json.dumps({"coordinator_stall": {"version": 20, "seconds": 4.5}})}
    eps, workers = start_job(procs, cfg_path, 2, 3, run, env=stall)
    wait_exit(workers, timeout_s=180)
    shards_exit(procs)
    _, version = consistent_end(run, 2)
    assert version == 80
    updates, events = coordinator_records(run)
    assert not [e for e in events if e["event"] == "worker_removed"], "a stalled coordinator lost a worker"
    gaps = [b["elapsed"] - a["elapsed"] for a, b in zip(updates, updates[1:])]
    assert max(gaps) >= 4.5, "the stall did not happen"
    assert all(len(r["accepted"]) == 3 for r in updates)
    assert "fault injection: coordinator loop stalls" in next(
        c for c in procs.children if c.role == "shard-0").log_path.read_text()


@pytest.mark.parametrize("sync, shards", [("bsp", 2), ("ssp", 2), ("asp", 2), ("bsp", 3)],
                         ids=["bsp", "ssp", "asp", "bsp-3-shards"])
def test_shard_killed_and_resumed_from_checkpoint(procs, tmp_path, sync, shards):
    """Checkpoints are a consistent cut in every mode (versions are the same commits on every
    shard): a follower killed and restarted with --resume brings every shard back to a common
    checkpoint, and the run ends with one history everywhere. With 3 shards, the follower that
    stayed up is rolled back over its link and must accept the workers that join again (it
    once kept the membership key of before the rollback and refused them all)."""
    cfg_path, cfg = write_config(tmp_path, job(cluster={"num_workers": 2, "num_shards": shards},
                                               checkpoint={"every_iterations": 10},
                                               training={"max_iterations": 60}, mode={"sync": sync}))
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, shards, 2, run)
    wait_version(eps[0], 25)
    k = shards - 1                                           # the victim: the last follower
    victim = next(c for c in procs.children if c.role == f"shard-{k}")
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    ckpts = sorted((run / "checkpoints").glob(f"shard-{k}-v*.npz"))
    assert ckpts, f"shard {k} wrote no checkpoint"
    resumed_version = int(ckpts[-1].stem.split("-v")[1])
    # Equal versions hold equal histories on every shard (the cut is consistent).
    from ps_server.checkpoint import load_checkpoint

    _, m1 = load_checkpoint(ckpts[-1])
    _, m0 = load_checkpoint(run / "checkpoints" / ckpts[-1].name.replace(f"shard-{k}", "shard-0"))
    assert m0["version"] == m1["version"] and m0["log_hash"] == m1["log_hash"]
    t0 = time.monotonic()
    again = procs.start(f"shard-{k}b", "ps_server.cli", ["--config", str(cfg_path), "--run-dir", str(run),
                                                          "--shard", str(k), "--port", "0", "--coordinator", eps[0],
                                                          "--resume"])
    procs.wait_endpoint(again, 60)
    wait_exit(workers, timeout_s=180)
    resume_s = time.monotonic() - t0
    shards_exit(procs)
    params, version = consistent_end(run, shards)
    updates, events = coordinator_records(run)
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert [e["version"] for e in rollbacks] == [resumed_version]
    (counters,) = [e["counters"] for e in events if e["event"] == "counters"]
    # Announcements a follower sent before it applied the Rollback are set aside: one or two in
    # flight at most, not every one after it (commits would then wait for its next ShardSync).
    assert counters.get("have.behind_rollback", 0) <= 2, counters
    restored = [r for r in read_jsonl(run / "metrics" / "shard-0.jsonl") if r.get("event") == "restored"]
    assert restored and restored[-1]["version"] == resumed_version
    if sync == "bsp":
        assert version == 60
        # Deterministic BSP: rolled back to the checkpoint, replaying the same samples in the
        # same order, the run ends exactly where an uninterrupted single process ends.
        data = load_dataset("synthetic", seed=2, synthetic_train=600, synthetic_test=300)
        ref = train_reference("mlp", 2, data, 2, 60, 60, lr=0.05, momentum=0.9)
        assert np.linalg.norm(params - ref) / np.linalg.norm(ref) < 1e-5
    else:
        assert version >= 60 * 2 - 2 and accuracy_of(params) >= 0.8
    from ps_server.coordinator import MAX_OUTSTANDING

    unfinished = 0 if sync == "bsp" else 2 * MAX_OUTSTANDING * 30  # 2 workers, x = 30
    assert_exactly_once_per_epoch(updates, 2, 600, unfinished)
    print(f"{sync}: resume took {resume_s:.2f}s after restart")


@pytest.mark.timeout(240)
def test_a_follower_restarted_empty_before_the_first_commit_loses_no_sample(procs, tmp_path):
    """A follower that dies at version 0, before any checkpoint, starts again without --resume
    and registers at the job's version. The gradients the dead process held are gone: shard 0
    stops counting them and removes their workers, who join again. Before, the next commit
    named a gradient the new process never received: it stopped rather than diverge, for good,
    and no restart could register (the job had moved past version 0)."""
    cfg_path, cfg = write_config(tmp_path, job(cluster={"num_workers": 2}, training={"max_iterations": 20},
                                               heartbeat={"interval_s": 0.2, "timeout_s": 8.0}))
    run = tmp_path / "run"
    eps = start_servers(procs, cfg_path, 2, run)
    # worker-1 pushes iteration 0 to shard 0 only and dies; worker-0's gradient is whole on
    # both shards, and iteration 0 waits for worker-1 to be declared lost (8 s).
    fault = {"LBBSP_FAULTS": json.dumps({"kill_in_push": {"worker": "worker-1", "iteration": 0,
                                                          "shards": [0], "delay_s": 0.2}})}
    workers = start_workers(procs, cfg_path, eps[0], 2, run, env=fault)
    assert workers[1].proc.wait(timeout=60) == -signal.SIGKILL
    time.sleep(0.5)
    assert status(eps[0]).version == 0
    shard1 = next(c for c in procs.children if c.role == "shard-1")
    os.kill(shard1.proc.pid, signal.SIGKILL)
    shard1.proc.wait(timeout=10)
    again = procs.start("shard-1b", "ps_server.cli", ["--config", str(cfg_path), "--run-dir", str(run),
                                                       "--shard", "1", "--port", "0", "--coordinator", eps[0]])
    procs.wait_endpoint(again, 60)
    wait_exit(workers[:1], timeout_s=180)
    shards_exit(procs)
    params, version = consistent_end(run, 2)
    assert version == 20
    updates, events = coordinator_records(run)
    removed = [e for e in events if e["event"] == "worker_removed"]
    assert any("started again empty" in e["reason"] for e in removed), removed
    assert_exactly_once_per_epoch(updates, 2, 600, 0)


def _wait_in_log(child, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in child.log_path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{child.role} never logged {text!r}")


def _shard_0_killed_past_25(procs, tmp_path):
    """A 2-shard BSP job of 60 iterations, checkpoints every 10, 2 workers; shard 0 stalls at
    version 25 or just past it and is killed there (it resumes from its newest checkpoint, which
    the follower, still running, is past). Its config, run directory, endpoints, workers and the
    follower."""
    cfg_path, _ = write_config(tmp_path, job(cluster={"num_workers": 2}, checkpoint={"every_iterations": 10},
                                             training={"max_iterations": 60}))
    run = tmp_path / "run"
    stall = {"LBBSP_FAULTS": json.dumps({"coordinator_stall": {"version": 25, "seconds": 60}})}
    eps, workers = start_job(procs, cfg_path, 2, 2, run, env=stall)
    shard0, shard1 = (next(c for c in procs.children if c.role == f"shard-{k}") for k in (0, 1))
    _wait_in_log(shard0, "coordinator loop stalls", 120)
    os.kill(shard0.proc.pid, signal.SIGKILL)
    shard0.proc.wait(timeout=10)
    return cfg_path, run, eps, workers, shard1


@pytest.mark.timeout(300)
def test_a_follower_that_misses_shard_0s_rollback_registers_again_and_follows(procs, tmp_path):
    """Shard 0 is killed and started again with --resume at its address; its Rollback request
    to the follower fails (the follower is stopped for it). The follower's link reconnects by
    itself and shard 0 answers it ``unregistered``: it registers again, is rolled back to shard
    0's checkpoint, and the run ends as one uninterrupted process would. Before, the follower
    only logged the refusal, and shard 0 waited for it (and so admitted no worker) for good."""
    cfg_path, run, eps, workers, shard1 = _shard_0_killed_past_25(procs, tmp_path)
    os.kill(shard1.proc.pid, signal.SIGSTOP)           # it cannot answer the Rollback request
    try:
        again = procs.start("shard-0b", "ps_server.cli", ["--config", str(cfg_path), "--run-dir", str(run),
                                                           "--shard", "0", "--port", eps[0].rsplit(":", 1)[1],
                                                           "--resume"])
        _wait_in_log(again, "not told to roll back", 60)
        time.sleep(1.0)      # logged before the request's socket closes: its message goes with it
    finally:
        os.kill(shard1.proc.pid, signal.SIGCONT)
    wait_exit(workers, timeout_s=240)
    shards_exit(procs)
    params, version = consistent_end(run, 2)
    assert version == 60
    assert "registering again" in shard1.log_path.read_text(errors="replace")
    data = load_dataset("synthetic", seed=2, synthetic_train=600, synthetic_test=300)
    ref = train_reference("mlp", 2, data, 2, 60, 60, lr=0.05, momentum=0.9)
    assert np.linalg.norm(params - ref) / np.linalg.norm(ref) < 1e-5, "one history, as one process"


@pytest.mark.timeout(300)
def test_a_live_follower_sent_to_a_checkpoint_of_another_history_registers_again_and_follows(procs, tmp_path):
    """Shard 0 is killed past version 25 and started again with --resume: it goes back to its
    newest checkpoint, V, and tells the follower, which kept running, to do the same. The
    follower's file at V holds another history (written here by hand, as a follower that missed
    an earlier Rollback would hold). It does not restore it. A follower past V registers again as
    resumed with its checkpoints, shard 0 takes the job back to V - 10, which both hold of one
    history, and the run ends as one uninterrupted process would. Before, the follower stopped
    (exit code 3) and the job waited for an operator's --resume.

    Where shard 0 stalled right at a checkpoint's version (25 "or just past it" can be 30), the
    follower is at exactly V of shard 0's history: it goes back from memory, writes its file at V
    again with shard 0's history, and the job needs no second rollback."""
    from ps_server.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint

    cfg_path, run, eps, workers, shard1 = _shard_0_killed_past_25(procs, tmp_path)
    newest = list_checkpoints(run / "checkpoints", 0)[-1][0]
    assert newest >= 20, f"shard 0's newest checkpoint is at {newest}: nothing older to go back to"
    arrays, meta = load_checkpoint(checkpoint_path(run / "checkpoints", 1, newest))
    save_checkpoint(run / "checkpoints", 1, newest, arrays, {**meta, "log_hash": "another-history"}, keep=0)
    again = procs.start("shard-0b", "ps_server.cli", ["--config", str(cfg_path), "--run-dir", str(run),
                                                       "--shard", "0", "--port", eps[0].rsplit(":", 1)[1],
                                                       "--resume"])
    wait_exit(workers, timeout_s=240)
    shards_exit(procs)
    assert shard1.proc.returncode == 0 and again.proc.returncode == 0, shard1.tail()
    params, version = consistent_end(run, 2)
    assert version == 60
    records = list(read_jsonl(run / "metrics" / "shard-1.jsonl"))
    first_restore = next(i for i, r in enumerate(records) if r.get("event") == "restored")
    follower_at = max(r["version"] for r in records[:first_restore] if "event" not in r)   # when shard 0 died
    restored = [(r["version"], r["path"] == "memory") for r in records if r.get("event") == "restored"]
    _, events = coordinator_records(run)
    rollbacks = [e["version"] for e in events if e["event"] == "rollback"]
    log_text = shard1.log_path.read_text(errors="replace")
    print(f"\nshard 0 went back to {newest}; the follower was at {follower_at}; it restored {restored}")
    if follower_at > newest:
        assert "registering again as resumed" in log_text
        assert restored == [(newest - 10, False)], f"the follower restored {restored}, not only {newest - 10}"
        assert rollbacks == [newest - 10]
    else:
        assert follower_at == newest and "went back from memory" in log_text
        assert restored == [(newest, True)] and rollbacks == [], (restored, rollbacks)
        assert "registering again as resumed" not in log_text
    data = load_dataset("synthetic", seed=2, synthetic_train=600, synthetic_test=300)
    ref = train_reference("mlp", 2, data, 2, 60, 60, lr=0.05, momentum=0.9)
    assert np.linalg.norm(params - ref) / np.linalg.norm(ref) < 1e-5, "one history, as one process"
