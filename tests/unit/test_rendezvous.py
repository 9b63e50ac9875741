"""Shard 0's endpoint handed over through a file (``file:PATH``): read once written, whole, and a
clear error naming the file when nothing or something else came."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ps_common.errors import UsageError
from ps_common.rendezvous import EndpointNotWritten, endpoint_file, remove_endpoint, resolve_endpoint, write_endpoint


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


def test_a_new_endpoint_replaces_the_file_not_its_contents(tmp_path):
    """Written by a rename: a reader holds the old file or the new one, never a half-written one."""
    path = tmp_path / "coordinator.endpoint"
    write_endpoint(path, "tcp://127.0.0.1:1")
    with open(path) as old:
        write_endpoint(path, "tcp://127.0.0.1:2")
        assert old.read() == "tcp://127.0.0.1:1\n"       # the open file was not rewritten in place
    assert resolve_endpoint(f"file:{path}", 1.0) == "tcp://127.0.0.1:2"


def test_shard_0_removes_only_its_own_endpoint(tmp_path):
    path = tmp_path / "coordinator.endpoint"
    write_endpoint(path, "tcp://127.0.0.1:2")
    remove_endpoint(path, "tcp://127.0.0.1:1")            # an earlier shard 0 ending late
    assert path.exists()
    remove_endpoint(path, "tcp://127.0.0.1:2")
    assert not path.exists()
    remove_endpoint(path, "tcp://127.0.0.1:2")            # gone already: nothing to do


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


def test_a_worker_waits_after_its_start_up_and_exits_with_the_reason(tmp_path):
    """The real CLI: it imports torch first (the point: that overlaps shard 0's start-up), then
    waits transport.connect_timeout_s for the file, then exits 2 naming it (not a traceback,
    not a hang)."""
    path = tmp_path / "coordinator.endpoint"
    code = ("import sys; from ps_worker import cli; "
            f"rc = cli.main(['--config', 'configs/quick_synthetic.yaml', '--server', 'file:{path}', "
            f"'--set', 'transport.connect_timeout_s=0.5', '--secret-file', '{tmp_path / 's'}']); "
            "print('torch imported before the wait:', 'torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"shard 0 wrote no endpoint into {path} within 0.5 s" in proc.stderr, proc.stderr[-2000:]
    assert "torch imported before the wait: True" in proc.stdout, proc.stdout
