"""Roles forked from the fork server (ps_launcher.fork_server) with real processes: what a role
sees is what ``python -m`` gives it, the launcher learns every exit status and signal, roles
whose start-up settings differ are started with exec, and no role or server outlives a
launcher that was SIGKILLed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ps_common.cli_util import PARENT_ENV
from ps_launcher.forked_process import UNKNOWN_EXIT, ForkedProcess, ForkServer
from ps_launcher.processes import Child, ProcessGroup

pytestmark = pytest.mark.timeout(120)

PROBE = "tests.fork_probe"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the tests that do not end theirs (each start costs ~2.5 s of CPU)."""
    s = ForkServer(tmp_path_factory.mktemp("fork-server") / "fork-server.log", os.environ)
    yield s
    s.close()


@pytest.fixture
def group(tmp_path, server):
    g = ProcessGroup(tmp_path / "logs", fork=True, shared_server=server)
    yield g
    g.stop_all(grace_s=3.0)


@pytest.fixture
def own_group(tmp_path):
    """A group with a server of its own, for the tests that kill it."""
    g = ProcessGroup(tmp_path / "own-logs", fork=True)
    yield g
    g.stop_all(grace_s=3.0)


def probe_output(child: Child, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in child.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                return json.loads(line)
        time.sleep(0.02)
    raise AssertionError(f"{child.role} printed nothing:\n{child.tail()}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_role_sees_what_python_dash_m_would_give_it(group, server):
    c = group.start("probe", PROBE, ["--code", "3"], env={"PROBE": "seen"})
    assert isinstance(c.proc, ForkedProcess)
    assert c.proc.wait(30) == 3
    out = probe_output(c)
    assert out["torch_loaded"], "the role did not come from the server's imports"
    assert out["argv"] == ["--code", "3"]
    assert out["probe"] == "seen"
    assert out["pid"] == c.proc.pid
    assert out["pgid"] == c.proc.pid, "each role leads a process group of its own (stop_all uses killpg)"
    assert out["sid"] == os.getsid(0), "roles stay in the launcher's session (SCHED_IDLE, see ProcessGroup.start)"
    assert out["ppid"] == server.proc.pid
    assert out["wait_policy"] == "PASSIVE", "the policy libgomp was loaded with is in the role's environment"


def test_a_role_module_runs_as_main_without_a_warning(group):
    c = group.start("cli", "ps_worker.cli", ["--help"])
    assert isinstance(c.proc, ForkedProcess)
    assert c.proc.wait(30) == 0
    text = c.log_path.read_text()
    assert "usage:" in text and "Warning" not in text, text


def test_the_working_directory_and_module_path_follow_the_request(group, tmp_path):
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "probe_here.py").write_text(textwrap.dedent("""
        import json, os, sys
        print(json.dumps({"cwd": os.getcwd(), "path0": sys.path[0], "main": __name__}), flush=True)
    """))
    c = group.start("here", "probe_here", [], cwd=here)
    assert isinstance(c.proc, ForkedProcess)
    assert c.proc.wait(30) == 0, c.tail()
    assert probe_output(c) == {"cwd": str(here), "path0": str(here), "main": "__main__"}


def test_forked_roles_draw_their_own_random_numbers(group):
    a, b = (group.start(f"r{i}", PROBE, []) for i in range(2))
    assert a.proc.wait(30) == 0 and b.proc.wait(30) == 0
    assert probe_output(a)["random"] != probe_output(b)["random"]


def test_signals_reach_the_role_and_its_status_says_which(group):
    c = group.start("sleeper", PROBE, ["--sleep", "60"])
    probe_output(c)
    assert c.proc.poll() is None
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(10) == -signal.SIGTERM
    c.proc.send_signal(signal.SIGKILL)  # after its exit: nothing is signalled, nothing raised
    with pytest.raises(subprocess.TimeoutExpired):
        group.start("long", PROBE, ["--sleep", "60"]).proc.wait(timeout=0.2)


def test_a_role_with_other_start_up_settings_is_started_with_exec(group):
    c = group.start("hashseed", PROBE, [], env={"PYTHONHASHSEED": "7"})
    assert isinstance(c.proc, subprocess.Popen)
    assert c.proc.wait(30) == 0
    assert not probe_output(c)["torch_loaded"]
    assert isinstance(group.start("same", PROBE, []).proc, ForkedProcess), "the server stays in use"


def test_a_role_given_the_launchers_pid_watches_the_fork_server(group, server):
    c = group.start("watched", PROBE, [], env={PARENT_ENV: str(os.getpid())})
    assert c.proc.wait(30) == 0
    assert probe_output(c)["parent_env"] == str(server.proc.pid)


def test_a_forged_request_without_a_log_is_refused_and_the_server_goes_on(group, server):
    group.start("first", PROBE, []).proc.wait(30)
    with server._lock:
        server._sock.send(json.dumps({"module": PROBE, "args": [], "env": dict(os.environ)}).encode())
        assert "expected one log file descriptor" in server._reply(10.0)["error"]
        r, w = os.pipe()
        try:     # well-formed JSON, one descriptor, but no working directory's type it can use
            socket.send_fds(server._sock, [json.dumps({"module": PROBE, "args": [], "env": {},
                                                       "cwd": 7}).encode()], [w])
            assert "a request needs module" in server._reply(10.0)["error"]
        finally:
            os.close(r)
            os.close(w)
    assert group.start("after", PROBE, ["--code", "4"]).proc.wait(30) == 4


def test_roles_of_a_dead_fork_server_end_with_an_unknown_status_and_new_roles_exec(own_group):
    c = own_group.start("orphan", PROBE, ["--sleep", "60"])
    probe_output(c)
    own_group._server.proc.kill()
    own_group._server.proc.wait(10)
    assert c.proc.poll() is None, "a role without a parent watch outlives its server"
    os.kill(c.proc.pid, signal.SIGKILL)
    assert c.proc.wait(10) == UNKNOWN_EXIT
    later = own_group.start("later", PROBE, [])
    assert isinstance(later.proc, subprocess.Popen)
    assert later.proc.wait(30) == 0


LAUNCHER = """
import os, sys, time
from pathlib import Path
from ps_common.cli_util import PARENT_ENV
from ps_launcher.processes import ProcessGroup
g = ProcessGroup(Path(sys.argv[1]), fork=True)
c = g.start("watched", "tests.fork_probe", ["--sleep", "120", "--watch-parent"], env={PARENT_ENV: str(os.getpid())})
print(c.proc.pid, g._server.proc.pid, type(c.proc).__name__, flush=True)
time.sleep(120)
"""


def test_no_role_or_server_outlives_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs")], stdout=subprocess.PIPE,
                                text=True, cwd=Path(__file__).resolve().parents[2])
    pids: list[int] = []
    try:
        line = launcher.stdout.readline().split()
        assert line[2] == "ForkedProcess", line
        pids = [int(line[0]), int(line[1])]
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), f"left alive: {[p for p in pids if alive(p)]}"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.kill()
        launcher.wait(10)
        shutil.rmtree(tmp_path / "logs", ignore_errors=True)


def test_stop_all_ends_the_server(tmp_path):
    g = ProcessGroup(tmp_path / "logs", fork=True)
    g.start("probe", PROBE, ["--sleep", "60"])
    server = g._server
    g.stop_all(grace_s=3.0)
    assert g.children[0].proc.returncode == -signal.SIGTERM
    assert server.proc.returncode == 0


def test_a_shared_server_outlives_the_groups_that_use_it_and_a_lost_one_is_replaced(tmp_path):
    shared = ForkServer(tmp_path / "shared.log", os.environ)
    try:
        for i in range(2):
            g = ProcessGroup(tmp_path / f"logs{i}", fork=True, shared_server=shared)
            c = g.start("probe", PROBE, [])
            assert c.proc.wait(30) == 0
            assert probe_output(c)["ppid"] == shared.proc.pid
            g.stop_all(grace_s=3.0)
            assert shared.proc.poll() is None and g._server is None, "the group started no server of its own"
        shared.proc.kill()
        shared.proc.wait(10)
        g = ProcessGroup(tmp_path / "logs2", fork=True, shared_server=shared)
        first = g.start("first", PROBE, [])   # the dead server's socket fails the send: exec
        assert isinstance(first.proc, subprocess.Popen) and first.proc.wait(30) == 0
        g.stop_all(grace_s=3.0)
        g = ProcessGroup(tmp_path / "logs3", fork=True, shared_server=shared)
        c = g.start("own", PROBE, [])          # known lost now: the group forks from its own
        assert isinstance(c.proc, ForkedProcess) and c.proc.wait(30) == 0
        assert probe_output(c)["ppid"] == g._server.proc.pid
        g.stop_all(grace_s=3.0)
    finally:
        shared.close()
