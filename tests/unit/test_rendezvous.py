"""Shard 0's endpoint handed over through a file (``file:PATH``): read once written, whole, and a
clear error naming the file when nothing or something else came."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ps_common.errors import UsageError
from ps_common.rendezvous import EndpointNotWritten, endpoint_file, resolve_endpoint, write_endpoint


def test_an_endpoint_is_itself():
    assert resolve_endpoint("tcp://127.0.0.1:5555", 0.0) == "tcp://127.0.0.1:5555"
    assert endpoint_file("ipc:///tmp/x") is None


def test_the_endpoint_written_later_is_read(tmp_path):
    path = tmp_path / "coordinator.endpoint"
    timer = threading.Timer(0.3, write_endpoint, (path, "tcp://10.0.0.7:4242"))
    timer.start()
    try:
        t0 = time.monotonic()
        assert resolve_endpoint(f"file:{path}", 10.0) == "tcp://10.0.0.7:4242"
        assert 0.25 < time.monotonic() - t0 < 5.0
    finally:
        timer.cancel()
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.endpoint"]   # no temporary left


def test_nothing_written_in_time_names_the_file(tmp_path):
    path = tmp_path / "never"
    t0 = time.monotonic()
    with pytest.raises(EndpointNotWritten, match=str(path)):
        resolve_endpoint(f"file:{path}", 0.3)
    assert time.monotonic() - t0 < 3.0
    path.write_text("")                      # empty: not written yet, as good as absent
    with pytest.raises(EndpointNotWritten):
        resolve_endpoint(f"file:{path}", 0.1)


@pytest.mark.parametrize("text", ["localhost:5555", "tcp://a:1 tcp://b:2", "http://x:1"])
def test_what_is_not_an_endpoint_is_refused(tmp_path, text):
    path = tmp_path / "coordinator.endpoint"
    path.write_text(text + "\n")
    with pytest.raises(UsageError, match="not an endpoint"):
        resolve_endpoint(f"file:{path}", 5.0)


def test_file_needs_a_path():
    with pytest.raises(UsageError, match="needs a path"):
        resolve_endpoint("file:", 1.0)


def test_a_worker_whose_shard_0_never_writes_exits_with_the_reason(tmp_path):
    """The real CLI: it starts up, waits transport.connect_timeout_s for the file, then exits 2
    naming it (not a traceback, not a hang)."""
    path = tmp_path / "coordinator.endpoint"
    proc = subprocess.run(
        [sys.executable, "-m", "ps_worker.cli", "--config", "configs/quick_synthetic.yaml", "--server", f"file:{path}",
         "--set", "transport.connect_timeout_s=0.5", "--secret-file", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"shard 0 wrote no endpoint into {path}" in proc.stderr, proc.stderr[-2000:]
