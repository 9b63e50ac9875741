"""Process hygiene: nothing of a run outlives its launcher, and a job ends by itself.

- SIGTERM (what Slurm, Kubernetes and systemd send) or SIGHUP to ``ps-launch`` mid-run: every
  child is stopped; 10 s later no process of the run is left.
- SIGKILL to ``ps-launch`` mid-run (no chance to clean up): the children notice their launcher
  is gone (parent-death signal, watchdog) and end; 10 s later nothing is left.
- Hand-started shards and workers with nobody to send Shutdown: they all exit by themselves
  once the stop rule is reached, the shards after saving the final version.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster_util import consistent_end, start_job, wait_exit, write_config

pytestmark = pytest.mark.system

CONFIG = [
    "--set", "data.dataset=synthetic", "--set", "model.name=mlp", "--set", "training.max_iterations=100000",
    "--set", "training.max_seconds=300", "--set", "cluster.num_shards=2", "--set", "cluster.num_workers=2",
    "--set", "evaluator.every_iterations=200",
]


def launch(tmp_path: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ps_launcher.cli", "configs/quick_synthetic.yaml",
                             "--run-dir", str(run), "--no-progress", *CONFIG],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    coord = run / "metrics" / "coordinator.jsonl"
    while time.monotonic() < deadline:  # training has started: the first commits are logged
        if coord.exists() and sum(1 for line in coord.read_text().splitlines() if '"iteration"' in line) > 20:
            break
        assert proc.poll() is None, proc.communicate(timeout=30)[0].decode()
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the run did not start")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 5, f"expected shards, workers and the evaluator, got {children}"
    return proc, children


def left_alive(procs: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def describe(procs: list[psutil.Process]) -> list[str]:
    """pid, status and command line of each, to tell which role was left behind."""
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[-160:]}")
        except psutil.Error as exc:
            out.append(f"{p.pid} ({exc})")
    return out


def stacks(procs: list[psutil.Process], run: Path) -> str:
    """What the processes left behind are waiting on: SIGUSR1 makes each write every thread's
    stack into its log (faulthandler, see ``setup_logging``)."""
    for p in procs:
        try:
            p.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    time.sleep(1.0)
    tails = []
    for log in sorted((run / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        if "most recent call first" in text:
            tails.append(f"----- {log.name} -----\n" + "\n".join(text.splitlines()[-60:]))
    return "\n".join(tails)


def kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_signal_to_the_launcher_stops_every_child(tmp_path, sig):
    proc, children = launch(tmp_path)
    try:
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        assert rc == 130, f"ps-launch exited {rc}"
        alive = left_alive(children, 10.0)
        assert not alive, f"left running 10 s after {sig.name}: {describe(alive)}\n{stacks(alive, tmp_path / 'run')}"
        out = proc.stdout.read().decode()
        assert "interrupted" in out, out[-2000:]
    finally:
        kill_all(children)
        proc.kill()


@pytest.mark.timeout(240)
def test_a_job_whose_launcher_was_sigkilled_ends_by_itself(tmp_path):
    proc, children = launch(tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=10)
        alive = left_alive(children, 10.0)
        assert not alive, (f"orphans left running 10 s after the launcher was SIGKILLed: {describe(alive)}\n"
                           f"{stacks(alive, tmp_path / 'run')}")
    finally:
        kill_all(children)


@pytest.mark.timeout(180)
def test_hand_started_processes_exit_at_the_stop_rule_without_shutdown(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 32, "max_iterations": 40, "finish_timeout_s": 5},
        "cluster": {"num_shards": 3, "num_workers": 2}, "evaluator": {"enabled": False}})
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 3, 2, run)
    wait_exit(workers, 120)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=30)
    _, version = consistent_end(run, 3)
    assert version == 40


@pytest.mark.timeout(180)
def test_a_worker_told_to_stop_does_not_wait_on_a_silent_coordinator(procs, tmp_path):
    """SIGTERM reaches a worker while shard 0 cannot answer (frozen with SIGSTOP here; gone, when
    a SIGKILLed launcher's children all stop at once): its goodbye is bounded, so it exits within
    a few seconds, not after the 120 s transport timeout. Seen in CI as an orphan 10 s after the
    launcher's SIGKILL."""
    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 32, "max_iterations": 100000},
        "cluster": {"num_shards": 1, "num_workers": 1}, "evaluator": {"enabled": False}})
    assert cfg.transport.timeout_s >= 60
    run = tmp_path / "run"
    (endpoint,), (worker,) = start_job(procs, cfg_path, 1, 1, run)
    shard0 = procs.children[0]
    coord = run / "metrics" / "coordinator.jsonl"
    deadline = time.monotonic() + 90
    while not (coord.exists() and coord.read_text().count('"iteration"') > 5):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    shard0.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        rc = worker.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        shard0.proc.send_signal(signal.SIGCONT)
    assert rc == 130, f"worker exited {rc}:\n{worker.tail()}"
    assert took < 10, f"the worker took {took:.1f}s to stop"
