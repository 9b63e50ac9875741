"""Network labs on the real kernel: hosts in namespaces talk TCP and ZeroMQ, tbf limits both
directions, the userspace relay adds delay (changeable at run time), and nothing is left behind
(after close, after a raise, after the owner was SIGKILLed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ps_launcher.lab import probe
from ps_launcher.lab.netns import Host, NetLab, cleanup_stale, delay_available, netns_available
from tests.cluster_util import read_line

_WHY = netns_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"network labs unavailable: {_WHY}")
_NO_DELAY = delay_available()
PROBE = probe.__file__
ROOT = Path(__file__).resolve().parents[2]
PORT = 5701


def start_server(host: Host, port: int = PORT) -> subprocess.Popen:
    p = host.popen([sys.executable, PROBE, "serve", "--port", str(port)],
                   stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert read_line(p.stdout, 10.0).strip() == "listening", "probe server did not start"
    return p


def client(host: Host, *args: str, timeout: float = 30.0) -> dict:
    cp = host.run([sys.executable, PROBE, *args], capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def rtt_ms(host: Host, server: Host, count: int = 15) -> float:
    return client(host, "rtt", server.ip, "--port", str(PORT), "--count", str(count))[
        "rtt_ms_median"
    ]


def mbit(host: Host, server: Host, direction: str, nbytes: int) -> float:
    out = client(host, "bulk", server.ip, "--port", str(PORT), "--direction", direction,
                 "--bytes", str(nbytes))  # fmt: skip
    return out["mbit_s"]


def lbps_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    return [line for line in out.splitlines() if "lbps-" in line]


def lab_namespaces(run_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if f"lbps-{run_id}-" in line]


@pytest.fixture
def lab():
    with NetLab() as lab:
        yield lab
    assert lab_namespaces(lab.run_id) == []


@pytest.mark.timeout(40)
def test_two_hosts_talk_tcp_and_zeromq(lab):
    a, b = lab.add_host("a"), lab.add_host("b")
    assert a.ns == f"lbps-{lab.run_id}-a" and a.ip != b.ip
    assert a.ip.startswith("10.213.") and b.ip.startswith("10.213.")
    start_server(a)
    assert rtt_ms(b, a, count=5) < 5.0

    rep = a.popen([sys.executable, "-c",
                   "import zmq,sys\n"
                   "s=zmq.Context().socket(zmq.ROUTER); s.setsockopt(zmq.RCVTIMEO, 10000)\n"
                   "s.bind('tcp://0.0.0.0:5702')\n"
                   "print('bound', flush=True)\n"
                   "for _ in range(3):\n"
                   "    ident, msg = s.recv_multipart()\n"
                   "    s.send_multipart([ident, b'echo:' + msg])\n"],
                  stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert read_line(rep.stdout, 10.0).strip() == "bound"
    code = (
        "import zmq\n"
        "s=zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)\n"
        "s.setsockopt(zmq.RCVTIMEO, 5000)\n"
        f"s.connect('tcp://{a.ip}:5702')\n"
        "for i in range(3):\n"
        "    s.send(b'hi%d' % i); print(s.recv().decode())\n"
    )
    cp = b.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["echo:hi0", "echo:hi1", "echo:hi2"]
    assert rep.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_rate_limit_applies_both_directions_and_changes(lab):
    server = lab.add_host("server")
    slow = lab.add_host("slow", rate_mbit=20)
    fast = lab.add_host("fast")
    start_server(server)
    up, down = mbit(slow, server, "up", 3 << 20), mbit(slow, server, "down", 3 << 20)
    assert 10.0 <= up <= 24.0, f"upload at 20 Mbit/s measured {up:.1f}"
    assert 10.0 <= down <= 24.0, f"download at 20 Mbit/s measured {down:.1f}"
    free = mbit(fast, server, "up", 20 << 20)
    assert free > 100.0, f"an unshaped host should be far faster, got {free:.1f} Mbit/s"

    slow.set_rate(50)  # a link upgraded mid-run
    up50 = mbit(slow, server, "up", 4 << 20)
    assert 25.0 <= up50 <= 60.0, f"upload at 50 Mbit/s measured {up50:.1f}"
    slow.set_rate(None)
    assert mbit(slow, server, "down", 20 << 20) > 100.0


@pytest.mark.timeout(60)
def test_lowering_the_rate_under_load_leaves_the_link_working(lab):
    """A changed tbf keeps its queue and sends a packet only once its bucket holds it: packets
    queued under a large bucket (100 Mbit/s: 50,000 bytes) would never leave a small one (20
    Mbit/s: 16,384), and the link would be dead for good. Lowered mid-transfer, in both
    directions, the transfers finish at about the new rate."""
    server = lab.add_host("server")
    slow = lab.add_host("slow", rate_mbit=100)
    start_server(server)
    for direction in ("down", "up"):
        slow.set_rate(100)
        nbytes = 6 << 20
        p = slow.popen([sys.executable, PROBE, "bulk", server.ip, "--port", str(PORT),
                        "--direction", direction, "--bytes", str(nbytes)],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(0.15)                                   # the queue is full of large frames
        slow.set_rate(20)
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            slow.stop(p)
            pytest.fail(f"{direction}: the transfer stalled after the rate was lowered")
        assert p.returncode == 0, direction
        got = json.loads(out)["mbit_s"]
        assert 15.0 <= got <= 60.0, f"{direction}: {got:.1f} Mbit/s"


@pytest.mark.timeout(60)
@pytest.mark.skipif(_NO_DELAY is not None, reason=f"delay relay unavailable: {_NO_DELAY}")
def test_relay_delay_adds_rtt_and_can_be_removed(lab):
    server = lab.add_host("server")
    far = lab.add_host("far", delay_ms=20)
    start_server(server)
    base = rtt_ms(lab.add_host("near"), server)
    delayed = rtt_ms(far, server)
    assert 25.0 <= delayed - base <= 55.0, f"delay 20 ms gave RTT {delayed:.1f} (base {base:.2f})"

    far.set_delay(5)
    assert 5.0 <= rtt_ms(far, server) <= 20.0
    stats = far.relay_stats()
    assert stats is not None and stats["up"] > 0 and stats["down"] > 0

    relay_pid = far._relay.pid
    far.set_delay(0)
    assert far.relay_stats() is None and not psutil.pid_exists(relay_pid)
    assert rtt_ms(far, server) < 5.0

    # delay and rate together, and ZeroMQ through the relay
    far.set_delay(10)
    far.set_rate(20)
    assert 10.0 <= mbit(far, server, "up", 2 << 20) <= 24.0
    code = (
        "import zmq, time\n"
        "c=zmq.Context(); r=c.socket(zmq.REP); r.bind('tcp://0.0.0.0:5703')\n"
        "q=c.socket(zmq.REQ); q.setsockopt(zmq.RCVTIMEO, 5000)\n"
        "print('bound', flush=True)\n"
        "r.setsockopt(zmq.RCVTIMEO, 10000); r.send(r.recv())\n"
    )
    rep = server.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert read_line(rep.stdout, 10.0).strip() == "bound"
    req = (
        "import zmq, time\n"
        "q=zmq.Context().socket(zmq.REQ); q.setsockopt(zmq.RCVTIMEO, 5000)\n"
        f"q.connect('tcp://{server.ip}:5703'); t=time.perf_counter(); q.send(b'x'); q.recv()\n"
        "print((time.perf_counter()-t)*1000)\n"
    )
    cp = far.run([sys.executable, "-c", req], capture_output=True, text=True, timeout=20)
    assert cp.returncode == 0, cp.stderr
    # connect handshake + ZMTP greeting + request: several round trips of >= 20 ms
    assert float(cp.stdout) >= 20.0


@pytest.mark.timeout(40)
def test_close_removes_everything_also_after_raise():
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab() as lab:
            h = lab.add_host("h1", rate_mbit=10)
            lab.add_host("h2", delay_ms=5 if _NO_DELAY is None else None)
            sleeper = h.popen(["sleep", "300"])
            stopped = h.popen(["sleep", "300"])
            assert h.stop(stopped) == -signal.SIGTERM and stopped not in h.procs
            relay = lab.hosts["h2"]._relay
            assert len(lab_namespaces(lab.run_id)) == 3
            raise RuntimeError("boom")
    assert lab_namespaces(lab.run_id) == []
    assert lbps_links() == []
    assert sleeper.poll() is not None, "processes started in a host are stopped"
    if relay is not None:
        assert relay.poll() is not None
    lab.close()  # idempotent


OWNER = """
import subprocess, sys, time
from ps_launcher.lab.netns import NetLab
lab = NetLab().open()
a = lab.add_host("a", rate_mbit=10)
b = lab.add_host("b", delay_ms=DELAY)
p = a.popen(["sleep", "600"])
print(lab.run_id, p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(40)
def test_cleanup_stale_removes_lab_of_killed_owner():
    code = OWNER.replace("DELAY", "3" if _NO_DELAY is None else "None")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env, start_new_session=True)  # fmt: skip
    try:
        with NetLab() as mine:  # a live owner's lab must survive
            line = read_line(owner.stdout, 20.0).split()
            assert line, "owner did not start"
            run_id, inner_pid = line[0], int(line[1])
            assert len(lab_namespaces(run_id)) == 3
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=10)
            assert len(lab_namespaces(run_id)) == 3, "a SIGKILLed owner leaves its lab behind"

            removed = cleanup_stale()
            # (other runs' stale leftovers may go too; ours must all be there)
            assert {f"lbps-{run_id}-{n}" for n in ("br", "a", "b")} <= set(removed)
            assert lab_namespaces(run_id) == []
            assert len(lab_namespaces(mine.run_id)) == 1
            assert not psutil.pid_exists(inner_pid) or psutil.Process(inner_pid).status() in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            )
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
        owner.stdout.close()
    assert lbps_links() == []


@pytest.mark.timeout(40)
def test_lab_left_open_is_closed_at_interpreter_exit():
    code = (
        "from ps_launcher.lab.netns import NetLab\n"
        "lab = NetLab().open(); lab.add_host('a'); lab.add_host('b', rate_mbit=5)\n"
        "print(lab.run_id, flush=True)\n"
        "del lab\n"  # dropped without close(): the exit hook still removes it
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=30)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    assert lab_namespaces(cp.stdout.strip()) == []
