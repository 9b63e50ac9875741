"""Start, watch and stop the processes of a local cluster; every child is always reaped."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ps_launcher.forked_process import ForkedProcess, ForkServer, ForkServerError, fork_server_wanted

log = logging.getLogger(__name__)
ENDPOINT_RE = re.compile(r"listening on ((?:tcp|ipc)://\S+)")

#: Popen arguments that make the child lead a new process group in this session
#: (``process_group`` exists from Python 3.11; before it, setpgid in the child).
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp})


@dataclass
class Child:
    role: str
    proc: subprocess.Popen | ForkedProcess
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """The children of one run; ``stop_all`` terminates, then kills what lingers."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    #: Fork roles from a :class:`ForkServer` (started with the first role) rather than exec
    #: each: a role then starts without importing torch and this project again (~2 s of CPU).
    fork: bool = field(default_factory=fork_server_wanted)
    #: A server that outlives this group (the tests' one for the session); without it, or once
    #: it is gone, the group starts its own with its first role and ends it in ``stop_all``.
    shared_server: ForkServer | None = field(default=None, repr=False)
    _server: ForkServer | None = field(default=None, repr=False)

    def start(self, role: str, module: str, args: list[str], env: dict[str, str] | None = None,
              prefix: list[str] | None = None, cwd: Path | None = None) -> Child:
        """Start ``python -m module args`` as the leader of a process group of its own, so
        ``stop_all`` can signal it with everything it forked (``prefix``, such as ``ip netns
        exec NS``, runs it elsewhere; it must exec the command, not fork it).

        Children stay in this session: Linux schedules each session (autogroup) as one entity
        first, and SCHED_IDLE is honoured only among the tasks of one group, so an evaluator in
        a session of its own competes with training as a group, whatever its nice. Measured
        (bench_ddp_vs_ps, LeNet, 5 repeats each, back to back): the evaluator made BSP
        iterations 1.39x slower with every child in a session of its own, 1.22x in this one.

        Without ``prefix``, the role is forked from this group's fork server where its
        start-up settings allow (:mod:`ps_launcher.fork_server`); with exec otherwise."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{role}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "w") as fh:
            proc: subprocess.Popen | ForkedProcess | None = (
                self._forked(role, module, args, full_env, fh.fileno(), cwd) if prefix is None else None)
            if proc is None:
                proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", module, *args], stdout=fh,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                        cwd=cwd, **_OWN_PROCESS_GROUP)
        child = Child(role, proc, log_path)
        self.children.append(child)
        return child

    def _forked(self, role: str, module: str, args: list[str], env: dict[str, str], log_fd: int,
                cwd: Path | None) -> ForkedProcess | None:
        """The role forked from the fork server, or None where it must be started with exec."""
        if not self.fork:
            return None
        try:
            server = self.shared_server
            if server is None or server.lost:
                if self._server is None:
                    self._server = ForkServer(self.log_dir / "fork-server.log", os.environ)
                server = self._server
            if not server.can_fork(env):
                return None
            return server.spawn(module, args, env, log_fd, cwd=cwd, name=role)
        except (ForkServerError, OSError) as exc:
            log.warning("starting roles with exec: %s", exc)
            self.fork = False
            return None

    def wait_endpoint(self, child: Child, timeout_s: float) -> str:
        """The endpoint a ps-server child printed once it had bound its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = ENDPOINT_RE.search(child.log_path.read_text(errors="replace"))
            if m:
                return m.group(1)
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.role} exited with code {child.proc.returncode}:\n{child.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"{child.role} did not report its endpoint within {timeout_s:.0f}s:\n{child.tail()}")

    def failed(self) -> Child | None:
        """A child that exited with an error (Ctrl-C'd children excepted)."""
        for c in self.children:
            rc = c.proc.poll()
            if rc not in (None, 0):
                return c
        return None

    def stop_all(self, grace_s: float = 5.0) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait()
        if self._server is not None:
            self._server.close()
            self._server = None
            self.fork = fork_server_wanted()
