"""A process that imports torch and the roles' modules once, then forks each role from itself.

Importing torch and this project costs a fresh Python process about 2.1 s of CPU, most of what a
short role spends (benchmarks/suite_processes.py: 145 processes of the system tests, median
2.7 s of CPU each). A fork of a process that has done those imports starts running the role in
milliseconds. :class:`ps_launcher.forked_process.ForkServer` starts this module and talks to it
over one Unix SEQPACKET socket:

- the server first sends ``{"ready": pid, "threads": n}``, with ``n`` its OS threads after the
  imports: only a single-threaded process may fork (a lock held by another thread stays held
  forever in the child), so the client uses the server only when ``n == 1``;
- a request ``{"module", "args", "env", "cwd", "name"}`` comes with one file descriptor, the
  role's log; the answer is ``{"started": pid}`` or ``{"error": text}``;
- when a child exits, the server reaps it and sends ``{"exited": pid, "code": rc}`` (``rc`` as
  :attr:`subprocess.Popen.returncode` gives it: negative for a signal).

The child is what ``python -m module args`` would be, with these differences, each handled:

- the settings that a process reads as it starts are the server's (``PYTHON*``, the OpenMP and
  allocator variables: :data:`STARTUP_PREFIXES`); the client forks only a child whose
  environment agrees with the server's on them, and starts any other with exec;
- the server sets ``OMP_WAIT_POLICY=PASSIVE`` (ps-server's default, ps_server.threads) before
  torch loads, so a forked worker's OpenMP threads sleep between parallel steps too (a worker
  runs one torch thread by default, where the policy does nothing);
- numpy's global random state is drawn anew (Python's ``random`` reseeds itself at a fork);
- ``LBBSP_PARENT_PID`` naming the launcher is rewritten to the server, which dies with the
  launcher (end of file on its socket, and a parent-death signal), so a role's parent watch
  still ends it when the launcher is gone.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Any, NoReturn

from ps_common.cli_util import PARENT_ENV, PR_SET_NAME, parent_death_signal, prctl  # no torch

#: Environment variables read when a process or a library loads, not later: they must be equal
#: in the server and in a role for the role to be forked rather than started with exec.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMBA_", "LD_", "MALLOC_")

#: What the roles import: loaded once here. Not the command-line modules a role runs as
#: ``__main__``: runpy runs a module afresh as ``__main__`` and warns when it is imported already.
PRELOAD = ("torch", "ps_server.server", "ps_worker.worker", "ps_worker.evaluator")

MAX_PACKET = 1 << 20
#: The process that started the server (as the server loads): the launcher.
_LAUNCHER_PID = os.getppid()


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Send, unless the launcher is gone: then the loop meets the end of its socket and ends."""
    try:
        sock.send(json.dumps(msg).encode())
    except (BrokenPipeError, ConnectionError):
        pass


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _request(data: bytes) -> dict[str, Any]:
    """A request checked before anything is forked for it (ValueError says what is wrong)."""
    try:
        req = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    ok = (isinstance(req, dict) and isinstance(req.get("module"), str) and req["module"]
          and isinstance(req.get("args"), list) and all(isinstance(a, str) for a in req["args"])
          and isinstance(req.get("env"), dict)
          and all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items())
          and isinstance(req.get("cwd"), (str, type(None))))
    if not ok:
        raise ValueError("a request needs module (str), args (list of str), env (str to str) and cwd "
                         "(str or null)")
    return req


def _become(req: dict[str, Any], log_fd: int, sock: socket.socket, pipe: tuple[int, int]) -> None:
    """In the child: turn into ``python -m module args`` (returns when the module has run)."""
    os.setpgid(0, 0)
    sock.close()
    for fd in pipe:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env = dict(req["env"])
    if env.get(PARENT_ENV) == str(_LAUNCHER_PID):
        env[PARENT_ENV] = str(os.getppid())
    os.environ.clear()
    os.environ.update(env)
    if req.get("cwd"):
        os.chdir(req["cwd"])
    sys.path[0] = os.getcwd()
    if "numpy" in sys.modules:  # numpy seeds its global state at its first draw: anew unless
        sys.modules["numpy"].random.seed()  # an import here drew from it, so draw anew in any case
    prctl(PR_SET_NAME, str(req.get("name", ""))[:15].encode())
    sys.argv = [req["module"], *req["args"]]
    gc.enable()
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)



def serve(sock: socket.socket) -> None:
    """Answer requests until the client closes its end; returns in each child after its role."""
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 1)
        except ConnectionError:
            data, fds = b"", []
        if not data:
            return  # the launcher closed its end, or died: the children's own watches end them
        try:
            req = _request(data)
            if len(fds) != 1:
                raise ValueError(f"expected one log file descriptor, got {len(fds)}")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except (ValueError, OSError) as exc:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        if pid == 0:
            _become(req, fds[0], sock, (wake_r, wake_w))
            return
        os.close(fds[0])
        try:
            os.setpgid(pid, pid)  # the child does it too; whichever runs first, the group exists
        except OSError:
            pass  # it has already exec'd or exited: its own setpgid ran
        children.add(pid)
        _send(sock, {"started": pid})


def _settle_thread_pools() -> None:
    """numpy's OpenBLAS starts a thread pool as it loads and shuts it down before each fork (its
    pthread_atfork handler), starting it again on its next use; one fork that exits at once
    leaves this process with the one thread it may fork from."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main() -> NoReturn:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    parent_death_signal()
    if os.getppid() != _LAUNCHER_PID:   # the launcher died before the signal was asked for
        sys.exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    gc.disable()  # Python's advice for a server that forks: no collection between import and fork
    for name in PRELOAD:
        __import__(name)
    _settle_thread_pools()
    gc.freeze()   # the children's collections then skip what was imported here, sparing
    #               the copies on write of its pages: a forked child's exit took 0.65 s, 0.26 s now
    _send(sock, {"ready": os.getpid(), "threads": os_threads(),
                 "cuda": bool(sys.modules["torch"].cuda.is_initialized())})
    serve(sock)
    sys.exit(0)  # in a child: its role returned (a role's own SystemExit passes through here)


if __name__ == "__main__":
    main()
