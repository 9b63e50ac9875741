"""The I/O side of scenarios: real CPU burners and the driver thread that starts them.
(The driver's schedule, emulated slowdowns and delays are in tests/unit/test_contention_schedule.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ps_common.scenario import WorkerScenario
from ps_worker.contention import BURNER_TAG, ContentionDriver, CpuBurners, kill_pid
from ps_worker.scenario_runtime import ScenarioRuntime
from tests.cluster_util import read_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


def cpu_share(pid: int, window_s: float = 0.5) -> tuple[float, float]:
    """(fraction of one core the process used, host CPU busy %) over the window."""
    p = psutil.Process(pid)
    psutil.cpu_percent(None)
    t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
    time.sleep(window_s)
    share = (sum(p.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
    return share, psutil.cpu_percent(None)


def burns(pid: int) -> bool:
    """More than half a core; or, when others load the (shared) host, at least half of what a
    plain ``while True: pass`` spinner gets beside it at the same time.

    An idle or sleeping process scores ~0 either way, so a burner that does not burn fails.
    """
    seen = []
    for _ in range(2):
        share, host = cpu_share(pid)
        seen.append((round(share, 2), host))
        if share > 0.5:
            return True
    ref = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        p, r = psutil.Process(pid), psutil.Process(ref.pid)
        c0, r0, t0 = sum(p.cpu_times()[:2]), sum(r.cpu_times()[:2]), time.monotonic()
        time.sleep(1.0)
        dt = time.monotonic() - t0
        share, ref_share = (sum(p.cpu_times()[:2]) - c0) / dt, (sum(r.cpu_times()[:2]) - r0) / dt
    finally:
        ref.kill()
        ref.wait(timeout=10)
    if ref_share < 0.02:
        pytest.skip(f"host too loaded to measure CPU shares (reference spinner got {ref_share:.3f})")
    if share >= 0.5 * ref_share:
        return True
    pytest.fail(f"burner {pid} does not burn CPU: (share of a core, host busy %) = {seen}; "
                f"beside a reference spinner: {share:.2f} vs {ref_share:.2f}")


def test_burner_burns_cpu_and_set_count_converges():
    burners = CpuBurners()
    try:
        assert burners.set_count(1) == 1 and burners.count == 1
        (pid,) = burners.pids
        deadline = time.monotonic() + 5  # right after the spawn the command line can read empty
        while not psutil.Process(pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert BURNER_TAG in " ".join(psutil.Process(pid).cmdline())
        assert burns(pid)
        burners.set_count(2)
        assert burners.count == 2 and pid in burners.pids
        burners.set_count(0)
        assert burners.count == 0 and gone(pid)
        # A burner killed from outside is replaced on the next set_count.
        burners.set_count(1)
        (pid2,) = burners.pids
        kill_pid(pid2)
        assert wait_gone(pid2, 3.0) or psutil.Process(pid2).status() == psutil.STATUS_ZOMBIE
        burners.set_count(1)
        assert burners.count == 1 and burners.pids != [pid2]
        pids = burners.pids
    finally:
        burners.close()
        burners.close()  # idempotent
    assert all(wait_gone(p, 3.0) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        burners.set_count(1)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_burner_affinity():
    cpu = sorted(os.sched_getaffinity(0))[0]
    with CpuBurners(cpus=[cpu]) as burners:
        burners.set_count(1)
        assert os.sched_getaffinity(burners.pids[0]) == {cpu}


def test_burners_die_with_a_sigkilled_parent():
    code = textwrap.dedent("""
        import sys, time
        from ps_worker.contention import CpuBurners
        b = CpuBurners()
        b.set_count(1)
        print(b.pids[0], flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    burner = None
    try:
        line = read_line(child.stdout, 30.0)
        assert line.strip(), "child printed no burner pid"
        burner = int(line)
        assert not gone(burner)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
        assert wait_gone(burner, 3.0), "burner outlived its SIGKILLed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if burner is not None:
            kill_pid(burner)


def test_driver_thread_runs_real_burners():
    spec = {"cpu_load": [{"start_s": 0.0, "stop_s": 0.8, "processes": 1}]}
    r = ScenarioRuntime(WorkerScenario.model_validate(spec), 0)
    d = ContentionDriver(r, interval_s=0.05)
    try:
        d.start()
        assert d.burners.count == 1
        pid = d.burners.pids[0]
        deadline = time.monotonic() + 5.0
        while d.burners.count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.burners.count == 0 and d.elapsed() >= 0.8
        assert wait_gone(pid, 3.0)
    finally:
        d.stop()
