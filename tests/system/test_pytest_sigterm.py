"""A SIGTERM to pytest (a ``timeout`` or a CI runner giving up) must still kill what the tests
started: the ``procs`` fixture's children live in process groups of their own, which a signal to
pytest alone never reaches, so ``tests/conftest.py`` turns the signal into an interrupt whose
teardowns run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INNER = '''
import time


def test_a_child_beside_a_long_wait(procs):
    child = procs.start("sleeper", "http.server", ["--bind", "127.0.0.1", "0"])
    open({pidfile!r}, "w").write(str(child.proc.pid))
    time.sleep(120)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigterm_to_pytest_still_kills_what_the_tests_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_inner.py").write_text(INNER.format(pidfile=str(pidfile)))
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                              str(tmp_path / "test_inner.py")], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):
            assert inner.poll() is None and time.monotonic() < deadline, "the inner test never started its child"
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        assert _alive(pid)
        inner.send_signal(signal.SIGTERM)
        out, _ = inner.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"pytest ended on SIGTERM and left its test's child running:\n{out}"
        assert "KeyboardInterrupt" in out
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
