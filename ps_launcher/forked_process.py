"""The launcher's side of :mod:`ps_launcher.fork_server`: start it, fork roles through it, and a
handle for each role that answers like :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``,
``returncode``, ``send_signal``, ``terminate``, ``kill``).

The server is the roles' parent, so only it can reap them; it sends each exit status here. A
handle signals its process through a pidfd, which names that process and no later one with the
same pid.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from ps_launcher.fork_server import MAX_PACKET, STARTUP_PREFIXES

log = logging.getLogger(__name__)

#: Set to 0 to start every role with exec, as before the fork server.
FORK_ENV = "LBBSP_FORK_SERVER"
#: The exit status given to a role whose server died before reporting it (only its parent knew).
UNKNOWN_EXIT = 255
_WAIT_POLICY = "OMP_WAIT_POLICY"


class ForkServerError(RuntimeError):
    """The server could not start a role (the caller starts it with exec instead)."""


def fork_server_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(FORK_ENV, "1").strip() not in ("0", "false", "no", "off")


def fork_server_if_wanted(log_path: Path) -> ForkServer | None:
    """A fork server started with this process's environment, or None where
    ``LBBSP_FORK_SERVER`` turns it off or it cannot start (its roles are then started with exec)."""
    if not fork_server_wanted():
        return None
    try:
        return ForkServer(log_path, os.environ)
    except (ForkServerError, OSError) as exc:
        log.warning("no fork server: %s", exc)
        return None


def startup_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


class ForkServer:
    """One :mod:`ps_launcher.fork_server` process, started with ``env``; thread-safe."""

    def __init__(self, log_path: Path, env: Mapping[str, str], ready_timeout_s: float = 120.0) -> None:
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self._default_policy = _WAIT_POLICY not in self.env
        self.env.setdefault(_WAIT_POLICY, "PASSIVE")   # what the server sets before torch loads
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        with open(log_path, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps_launcher.fork_server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env)
        theirs.close()
        self._sock = ours
        self._lock = threading.RLock()
        self._codes: dict[int, int] = {}
        self.lost = False
        try:
            msg = self._reply(ready_timeout_s, log_path)
        except ForkServerError:
            self.close(timeout_s=1.0)   # a server that is still importing is killed, not left behind
            raise
        self.threads = int(msg.get("threads", 0))
        if self.threads != 1 or msg.get("cuda"):
            self.close()
            raise ForkServerError(f"the fork server has {self.threads} threads after its imports "
                                  f"(CUDA started: {bool(msg.get('cuda'))}): forking it would be unsafe")

    # ----- messages ---------------------------------------------------------------------------
    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """One message, or None after ``timeout_s``; exit notices are recorded, not returned."""
        if self.lost:
            return None
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout_s))
        if not ready:
            return None
        try:
            data = self._sock.recv(MAX_PACKET)
        except OSError:
            data = b""
        if not data:
            self.lost = True
            return None
        msg: dict[str, Any] = json.loads(data)
        if "exited" in msg:
            self._codes[int(msg["exited"])] = int(msg["code"])
            return {}
        return msg

    def _reply(self, timeout_s: float, log_path: Path | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._read(deadline - time.monotonic())
            if msg:
                return msg
            if self.lost or time.monotonic() >= deadline:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
                raise ForkServerError(f"the fork server did not answer within {timeout_s:.0f}s "
                                      f"(exit code {self.proc.poll()}){': ' + tail if tail else ''}")

    def drain(self, timeout_s: float = 0.0) -> None:
        """Record the exit notices that have arrived (waiting up to ``timeout_s`` for one)."""
        with self._lock:
            while self._read(timeout_s) is not None:
                timeout_s = 0.0

    def exit_code(self, pid: int) -> int | None:
        self.drain()
        return self._codes.get(pid)

    # ----- roles ------------------------------------------------------------------------------
    def can_fork(self, env: Mapping[str, str]) -> bool:
        """Whether a role with ``env`` would start the same forked as with exec."""
        wanted = startup_settings(env)
        if self._default_policy:
            wanted.setdefault(_WAIT_POLICY, self.env[_WAIT_POLICY])
        return not self.lost and wanted == startup_settings(self.env)

    def spawn(self, module: str, args: list[str], env: Mapping[str, str], log_fd: int,
              cwd: Path | None = None, name: str = "") -> ForkedProcess:
        """``python -m module args`` forked from the server, writing to ``log_fd``."""
        env = {**env, **startup_settings(self.env)}
        req = {"module": module, "args": args, "env": env, "cwd": str(cwd) if cwd else None, "name": name}
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(req).encode()], [log_fd])
            except OSError as exc:
                self.lost = True
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
            msg = self._reply(30.0)
        if "error" in msg:
            raise ForkServerError(str(msg["error"]))
        return ForkedProcess(self, int(msg["started"]), [module, *args])

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (its children are not signalled); idempotent."""
        with self._lock:
            self._sock.close()
            self.lost = True
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """A role forked by a :class:`ForkServer`, with the parts of Popen's interface we use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._server = server
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it has exited and been reaped already: its code is on its way
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)

    def _gone_without_status(self) -> bool:
        """The server died: whether our process has ended (its status is lost with the server)."""
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(ready)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
            if self.returncode is None and self._server.lost and self._gone_without_status():
                log.warning("role %d ended after its fork server died: its exit status is unknown", self.pid)
                self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            left = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
            if self._server.lost:
                time.sleep(left)
            else:
                self._server.drain(left)

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
