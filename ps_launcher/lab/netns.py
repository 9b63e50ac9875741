"""Real links between lab hosts: network namespaces on a bridge, with rate limits and delay.

Why: a slow link delays pushes and pulls in ways an emulated sleep does not (TCP slow start,
queueing behind bulk frames, ZeroMQ's own buffering). Each lab is one bridge namespace
``lbps-<runid>-br`` holding a Linux bridge; each host is a namespace ``lbps-<runid>-<name>``
joined to it by a veth pair, with an address in a private /24 (``10.213.<n>.0/24``).

- Rate: a ``tbf`` qdisc on both ends of the host's link (the host side shapes uploads, the bridge
  side downloads). Changeable at run time.
- Delay: this kernel has no ``netem``, so :mod:`ps_launcher.lab.delay_relay` (a userspace relay
  that holds frames) is spliced into the link when a delay is asked for, and taken out again
  when it is set back to zero. Changeable at run time.

Nothing is made in the caller's namespace, so a lab never clashes with the machine's network;
deleting the namespaces deletes every veth, bridge and TAP. Every namespace is recorded with its
owner's pid (:mod:`ps_launcher.lab.ownership`), and :func:`cleanup_stale` removes the labs of
killed runs. Processes are only ever stopped by pid or process group.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

from . import ownership
from .errors import LabError, LabUnavailable

log = logging.getLogger(__name__)

HOST_IF = "lbps0"  # the host's interface, inside its own namespace
BRIDGE = "lbps-br"  # the bridge, inside the lab's bridge namespace
RELAY_SCRIPT = Path(__file__).with_name("delay_relay.py")
CMD_TIMEOUT_S = 15.0


def _run(argv: Sequence[str], check: bool = True, timeout: float = CMD_TIMEOUT_S) -> str:
    """Run a short command (ip, tc); a failure becomes a LabError naming the command."""
    try:
        cp = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        raise LabUnavailable(f"{argv[0]} is not installed (needed for network labs)") from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` took more than {timeout:g} s") from e
    if check and cp.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed (rc={cp.returncode}): {cp.stderr.strip()}")
    return cp.stdout


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    """Processes living in namespace ``ns``."""
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def _delete_netns(ns: str) -> None:
    """Kill what still runs in ``ns`` (by pid; all of it belongs to the lab) and delete it."""
    for _ in range(3):
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if ns in list_netns():
        _run(["ip", "netns", "delete", ns])


@functools.lru_cache(maxsize=1)
def netns_available() -> str | None:
    """None if labs can be built here, else the reason (not root, no ``ip``/``tc``, ...).

    Probes for real: makes a namespace with a bridge, a veth pair and a ``tbf`` qdisc, then
    removes it. The delay stage needs more (see :func:`delay_available`).
    """
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    ns = f"{ownership.PREFIX}probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", ns])
    except LabError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run(["ip", "-n", ns, "link", "add", "lbps-pb", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "add", "lbps-pa", "type", "veth", "peer", "name", "lbps-pc"])
        _run(["ip", "-n", ns, "link", "set", "lbps-pa", "master", "lbps-pb"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "lbps-pc", "root", "tbf",
              "rate", "10mbit", "burst", "16kb", "latency", "50ms"])  # fmt: skip
    except LabError as e:
        return f"network lab mechanism missing: {e}"
    finally:
        try:
            _run(["ip", "netns", "delete", ns], check=False)
        except LabError:
            pass
    return None


def delay_available() -> str | None:
    """None if the userspace delay stage can run (a TUN device and packet sockets), else why."""
    why = netns_available()
    if why:
        return why
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the delay relay needs TAP devices)"
    return None


def tbf_burst(rate_mbit: float) -> int:
    """The ``tbf`` bucket for ``rate_mbit``, in bytes: at least 4 ms of traffic (timer
    granularity), and 16 KiB."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))


def tbf_args(rate_mbit: float) -> list[str]:
    """``tbf`` parameters for ``rate_mbit``: the bucket of :func:`tbf_burst` and a queue of 50
    ms, enough for one TCP flow to fill the link."""
    burst = tbf_burst(rate_mbit)
    limit = burst + max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.05))
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]


@dataclass
class Host:
    """One lab host: a namespace with one interface on the lab bridge."""

    lab: NetLab
    name: str
    ns: str
    ip: str
    index: int
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _relay: subprocess.Popen | None = field(default=None, repr=False)
    _handle: str = field(default="1:", repr=False)    # of this host's tbf qdiscs (set_rate)

    @property
    def veth_br(self) -> str:
        """The bridge-side end of this host's veth pair (in the bridge namespace)."""
        return f"lbps-v{self.index}"

    @property
    def tap(self) -> str:
        """The delay relay's TAP device (in the bridge namespace) while a delay is set."""
        return f"lbps-d{self.index}"

    def exec(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` in this host, in its own process group (so the starter can stop it and
        its children with :meth:`stop`); the lab stops whatever is left when it closes."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec(argv), **kw)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host to completion (``subprocess.run`` arguments)."""
        return subprocess.run(self.exec(argv), **kw)

    def stop(self, proc: subprocess.Popen, grace_s: float = 2.0) -> int | None:
        """Stop one process started by :meth:`popen`: SIGTERM to its group, SIGKILL after
        ``grace_s``."""
        _stop_group(proc, grace_s)
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.returncode

    def set_rate(self, rate_mbit: float | None) -> None:
        """Limit this host's link to ``rate_mbit`` in each direction; None removes the limit."""
        br = self.lab.bridge_ns
        if rate_mbit is None:
            for ns, dev in ((self.ns, HOST_IF), (br, self.veth_br)):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        else:
            args = tbf_args(rate_mbit)
            # A changed tbf keeps its queue, and it sends a packet only once its bucket holds the
            # packet's length: a queued packet (GSO frames are cut to the old bucket's size)
            # longer than a new, smaller bucket would wait forever, and the link with it (seen
            # lowering 40 to 10 Mbit/s: bucket 20,000 to 16,384 bytes, a worker lost and hung).
            # So a smaller bucket comes with a fresh qdisc; the queue it drops is resent by TCP.
            # The fresh one takes the other handle, which makes the kernel graft it in place of
            # the old in one step: deleting the old first left the link unshaped until the new
            # one came (seen in CI: an upload lowered from 100 to 20 Mbit/s ran at 495).
            fresh = self.rate_mbit is not None and tbf_burst(rate_mbit) < tbf_burst(self.rate_mbit)
            if fresh:
                self._handle = "2:" if self._handle == "1:" else "1:"
            for ns, dev in ((self.ns, HOST_IF), (br, self.veth_br)):
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", self._handle, *args])
        self.rate_mbit = rate_mbit

    def set_delay(self, delay_ms: float | None) -> None:
        """Add ``delay_ms`` of one-way delay in each direction (RTT grows by twice that).

        0 or None takes the relay out of the link again, back to plain veth speed.
        """
        ms = float(delay_ms or 0.0)
        if ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
        if self._relay is not None and self._relay.poll() is not None:
            log.warning("delay relay of %s died (rc=%s); restarting it", self.name,
                        self._relay.returncode)  # fmt: skip
            self._stop_relay()
        if ms == 0:
            self._stop_relay()
        else:
            if self._relay is None:
                self._start_relay(ms)
            self._relay_cmd(f"delay {ms:g}", "ok")
        self.delay_ms = ms

    def relay_stats(self) -> dict[str, int] | None:
        """Frame counters of the delay relay (None when there is none)."""
        if self._relay is None:
            return None
        line = self._relay_cmd("stats", "stats")
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}

    # -- the delay stage -------------------------------------------------------------------
    def _start_relay(self, ms: float) -> None:
        why = delay_available()
        if why:
            raise LabUnavailable(why)
        br = self.lab.bridge_ns
        argv = ["ip", "netns", "exec", br, sys.executable, str(RELAY_SCRIPT),
                "--veth", self.veth_br, "--tap", self.tap, "--delay-ms", f"{ms:g}"]  # fmt: skip
        p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self._relay = p
        try:
            self._relay_read("ready", timeout=10.0)
            # take the veth off the bridge first: both as ports at once would loop frames
            _run(["ip", "-n", br, "link", "set", self.veth_br, "nomaster"])
            _run(["ip", "-n", br, "link", "set", self.tap, "txqueuelen", "1000"])
            _run(["ip", "-n", br, "link", "set", self.tap, "master", BRIDGE, "up"])
        except BaseException:
            self._stop_relay()
            raise
        log.debug("delay relay for %s started (pid %d)", self.name, p.pid)

    def _stop_relay(self) -> None:
        p = self._relay
        if p is None:
            return
        self._relay = None
        br = self.lab.bridge_ns
        errors = []
        for argv in (
            ["ip", "-n", br, "link", "set", self.tap, "nomaster"],
            ["ip", "-n", br, "link", "set", self.veth_br, "master", BRIDGE, "up"],
        ):
            try:
                _run(argv, check=False)
            except LabError as e:
                errors.append(str(e))
        try:
            if p.stdin:
                p.stdin.close()
        except OSError:
            pass
        _stop_group(p, grace_s=2.0)
        for f in (p.stdout, p.stderr):
            if f:
                f.close()
        if errors:
            raise LabError("; ".join(errors))

    def _relay_cmd(self, cmd: str, expect: str) -> str:
        p = self._relay
        assert p is not None and p.stdin is not None
        try:
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
        except OSError as e:
            raise LabError(f"delay relay of {self.name} is gone: {e}") from e
        return self._relay_read(expect, timeout=5.0)

    def _relay_read(self, expect: str, timeout: float) -> str:
        p = self._relay
        assert p is not None and p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if not line.startswith(expect):
            err = ""
            if p.poll() is not None and p.stderr is not None:
                err = p.stderr.read()[-2000:]
            raise LabError(
                f"delay relay of {self.name}: expected {expect!r}, got {line.strip()!r} "
                f"(rc={p.returncode}) {err.strip()}"
            )
        return line.strip()


def _stop_group(p: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of ``p`` (it leads one: start_new_session), then SIGKILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            p.terminate()
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group may outlive its leader
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not exit after SIGKILL", p.pid)


_OPEN_LABS: set[NetLab] = set()  # strong refs: a dropped lab is still closed at exit


@atexit.register
def _close_open_labs() -> None:
    """Close labs still open when the interpreter exits (never a parent's lab in a forked child)."""
    for lab in list(_OPEN_LABS):
        if lab._owner_pid == os.getpid():
            try:
                lab.close()
            except Exception:  # noqa: BLE001 - exiting anyway; cleanup_stale catches the rest
                log.exception("closing lab %s at exit", lab.run_id)


def _pick_subnet(run_id: str) -> int:
    """Third octet of ``10.213.<n>.0/24``: derived from the run id and unused by this machine's
    own routes. (Labs are isolated namespaces, so labs never clash with each other.)"""
    used = set(re.findall(r"10\.213\.(\d+)\.", _run(["ip", "-4", "route", "show", "table", "all"],
                                                     check=False)))  # fmt: skip
    start = zlib.crc32(run_id.encode()) % 250 + 1
    for k in range(250):
        n = (start + k - 1) % 250 + 1
        if str(n) not in used:
            return n
    raise LabError("no free 10.213.<n>.0/24 subnet")


class NetLab:
    """One lab: a bridge namespace and the hosts on it; a context manager that always cleans up.

    >>> with NetLab() as lab:                                   # doctest: +SKIP
    ...     srv = lab.add_host("server")
    ...     w = lab.add_host("worker-1", rate_mbit=100, delay_ms=5)
    ...     p = srv.popen(["ps-server", "--host", srv.ip, ...])
    ...     w.set_rate(20)                                    # link downgraded mid-run
    """

    def __init__(self, run_id: str | None = None, subnet: int | None = None) -> None:
        """``run_id`` defaults to a fresh ``<pid>-<hex>`` per lab; ``subnet`` picks the third
        octet of the lab's ``10.213.<subnet>.0/24``."""
        self.run_id = ownership.check_name(run_id or ownership.new_run_id(), "run id")
        self.bridge_ns = f"{ownership.PREFIX}{self.run_id}-br"
        self._subnet = subnet
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._open = False
        self._owner_pid = os.getpid()

    @property
    def subnet(self) -> str:
        """The lab's network, e.g. ``10.213.17.0/24``."""
        return f"10.213.{self._subnet}.0/24"

    def open(self) -> NetLab:
        """Create the bridge namespace and its bridge."""
        if self._open:
            return self
        why = netns_available()
        if why:
            raise LabUnavailable(why)
        if self._subnet is None:
            self._subnet = _pick_subnet(self.run_id)
        if not 1 <= self._subnet <= 254:
            raise ValueError(f"subnet octet must be 1..254, got {self._subnet}")
        self._open = True
        _OPEN_LABS.add(self)
        try:
            self._add_ns(self.bridge_ns)
            _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge",
                  "stp_state", "0", "forward_delay", "0"])  # fmt: skip
            _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        if ns in list_netns():
            raise LabError(f"namespace {ns} already exists (run id reused?)")
        ownership.register(self.run_id, "netns", ns)
        self._namespaces.append(ns)
        _run(["ip", "netns", "add", ns])
        # quiet links: no IPv6 autoconfiguration chatter in measurements
        _run(["ip", "netns", "exec", ns, "sh", "-c",
              "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], check=False)  # fmt: skip
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def add_host(
        self, name: str, rate_mbit: float | None = None, delay_ms: float | None = None
    ) -> Host:
        """Add host ``name`` (namespace ``lbps-<runid>-<name>``) with an optional rate limit
        (Mbit/s, each direction) and one-way delay (ms, each direction)."""
        if not self._open:
            raise LabError("the lab is not open (use it as a context manager)")
        ownership.check_name(name, "host name")
        if name == "br" or name in self.hosts:
            raise ValueError(f"host name {name!r} is taken")
        index = len(self.hosts) + 1
        if index > 250:
            raise LabError("a lab holds at most 250 hosts")
        ns = f"{ownership.PREFIX}{self.run_id}-{name}"
        host = Host(self, name, ns, f"10.213.{self._subnet}.{index}", index)
        self._add_ns(ns)
        br = self.bridge_ns
        _run(["ip", "-n", br, "link", "add", host.veth_br, "type", "veth",
              "peer", "name", HOST_IF, "netns", ns])  # fmt: skip
        _run(["ip", "-n", br, "link", "set", host.veth_br, "master", BRIDGE, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", HOST_IF])
        _run(["ip", "-n", ns, "link", "set", HOST_IF, "up"])
        self.hosts[name] = host
        if rate_mbit is not None:
            host.set_rate(rate_mbit)
        if delay_ms:
            host.set_delay(delay_ms)
        return host

    def close(self) -> None:
        """Stop every process and relay the lab started, delete all its namespaces (with them
        every veth, bridge and TAP). Safe to call twice; tries everything before reporting."""
        errors: list[str] = []
        for host in self.hosts.values():
            for p in list(host.procs):
                _stop_group(p, grace_s=1.0)
            host.procs.clear()
            try:
                host._stop_relay()
            except LabError as e:
                errors.append(str(e))
        for ns in reversed(self._namespaces):
            try:
                _delete_netns(ns)
                ownership.unregister(self.run_id, "netns", ns)
            except LabError as e:
                errors.append(str(e))
        self._namespaces.clear()
        self.hosts.clear()
        self._open = False
        _OPEN_LABS.discard(self)
        if errors:
            raise LabError("lab cleanup incomplete: " + "; ".join(errors))

    def __enter__(self) -> NetLab:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        except LabError:
            if et is None:
                raise
            log.exception("cleanup after an error failed")

    def __repr__(self) -> str:
        return f"NetLab({self.run_id!r}, subnet={self.subnet}, hosts={list(self.hosts)})"


def cleanup_stale(prefix: str = ownership.PREFIX) -> list[str]:
    """Delete ``prefix`` namespaces whose owning process is dead (a killed run), with whatever
    still runs in them; returns their names. Namespaces of live or unknown owners are kept."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    removed: list[str] = []
    for ns in list_netns():
        if not ns.startswith(prefix):
            continue
        rid = ownership.run_id_of(ns, prefix)
        if rid is None and ns.startswith(f"{ownership.PREFIX}probe-"):
            pid = ns.split("-")[2]
            rid = f"{pid}-0000" if pid.isdigit() else None
        if rid is None or ownership.owner_alive(rid) is not False:
            continue
        try:
            _delete_netns(ns)
        except LabError as e:
            log.warning("stale namespace %s: %s", ns, e)
            continue
        ownership.unregister(rid, "netns", ns)
        removed.append(ns)
    ownership.prune_records()
    return removed
