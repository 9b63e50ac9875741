"""Where model refits run: inline (``sync``), on a thread, or in a helper process.

A refit is a pure function ``fn(payload) -> result`` of numpy arrays (a NARX training, a batch of
statsmodels ARIMA fits). The predictor submits it with a tag, keeps forecasting with its current
weights, and swaps the new ones in (on its own thread, at its next update or predict) once
:meth:`RefitExecutor.results` hands them back. Nothing here blocks the caller except ``sync``, which
runs the job inside ``submit`` and exists for tests and replays that must be deterministic.

Why a process is the default background: the coordinator calls the predictors inside its message
loop. A refit thread shares the GIL with that loop; statsmodels fits and small numpy steps are
mostly Python, so each time the loop wakes up from a socket poll, or a numpy call in the loop
releases the GIL, the loop may wait up to the interpreter's switch interval (5 ms) for the refit
thread to let go (seen in ``benchmarks/bench_manager.py`` as 4-5 ms decision spikes). A helper
process has its own interpreter, and the caller's side has no thread at all: a job is pickled
(protocol 5: arrays travel as raw out-of-band buffers, not copied into the pickle) into an
outgoing queue that non-blocking writes drain a little at every ``submit``/``results``, and
results are read from a non-blocking pipe. The helper runs at a lower priority (nice +10) with
one BLAS thread. It is our own child, started as ``python -c
'...predictors.refit._child_main()'``; it exits when its stdin closes (the parent closed it or
died), and the pipes only ever carry what the parent itself pickled.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any, Callable

from ps_common.timeouts import DEFAULT_TIMEOUTS

log = logging.getLogger(__name__)

REFIT_MODES = ("sync", "thread", "process", "background")
_CHILD_CMD = "from predictors.refit import _child_main; raise SystemExit(_child_main())"
_HEADER = struct.Struct("<QQQ")         # job id, pickle length, number of out-of-band buffers
_LEN = struct.Struct("<Q")


def _frame(job_id: int, obj: Any) -> list[Any]:
    """Chunks of one frame: header, buffer lengths, the pickle, then the arrays' own memory
    (pickle protocol 5 out-of-band buffers: numpy arrays are not copied into the pickle)."""
    bufs: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    head = _HEADER.pack(job_id, len(data), len(raws)) + b"".join(_LEN.pack(r.nbytes) for r in raws)
    return [memoryview(head), memoryview(data), *raws]


def _parse_frame(buf: bytearray, pos: int) -> tuple[int, int, Any] | None:
    """(new position, job id, object) of a complete frame at ``pos`` of ``buf``, or None."""
    end = len(buf)
    if end - pos < _HEADER.size:
        return None
    job_id, size, nbuf = _HEADER.unpack_from(buf, pos)
    p = pos + _HEADER.size
    if end - p < _LEN.size * nbuf:
        return None
    lens = [_LEN.unpack_from(buf, p + i * _LEN.size)[0] for i in range(nbuf)]
    p += _LEN.size * nbuf
    if end - p < size + sum(lens):
        return None
    data = bytes(buf[p:p + size])
    p += size
    bufs = []
    for n in lens:
        bufs.append(bytes(buf[p:p + n]))
        p += n
    return p, job_id, pickle.loads(data, buffers=bufs)


def _read_frame(read: Callable[[int], bytes | None]) -> tuple[int, bytes, list[bytes]] | None:
    """(job id, pickle, buffers) of the next frame from a blocking reader; None at EOF."""
    head = read(_HEADER.size)
    if head is None:
        return None
    job_id, size, nbuf = _HEADER.unpack(head)
    lens = read(_LEN.size * nbuf) if nbuf else b""
    if lens is None:
        return None
    data = read(size)
    if data is None:
        return None
    bufs = []
    for i in range(nbuf):
        b = read(_LEN.unpack_from(lens, i * _LEN.size)[0])
        if b is None:
            return None
        bufs.append(b)
    return job_id, data, bufs


class RefitExecutor:
    """Runs refit jobs; results come back through :meth:`results` (never blocking)."""

    kind = "?"

    def submit(self, fn: Callable[[Any], Any], payload: Any, tag: Any) -> None:
        raise NotImplementedError

    def results(self) -> list[tuple[Any, Any, BaseException | None]]:
        """Finished jobs since the last call: (tag, result or None, error or None)."""
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is in flight (tests, checkpoints); False on timeout."""
        return True

    def close(self) -> None:
        """Stop accepting jobs and release the thread or process (pending results are dropped)."""


class SyncRefits(RefitExecutor):
    """Run every job inside ``submit``: deterministic, and the caller pays the full fit time."""

    kind = "sync"

    def __init__(self) -> None:
        self._done: list[tuple[Any, Any, BaseException | None]] = []

    def submit(self, fn: Callable[[Any], Any], payload: Any, tag: Any) -> None:
        try:
            self._done.append((tag, fn(payload), None))
        except Exception as exc:  # noqa: BLE001 - a failed refit must not stop training
            log.warning("refit failed: %r", exc)
            self._done.append((tag, None, exc))

    def results(self) -> list[tuple[Any, Any, BaseException | None]]:
        out, self._done = self._done, []
        return out


class _Inbox:
    """Thread-safe results deque plus an in-flight count with a condition to wait on."""

    def __init__(self) -> None:
        self.done: collections.deque[tuple[Any, Any, BaseException | None]] = collections.deque()
        self.cond = threading.Condition()
        self.pending = 0

    def sent(self) -> None:
        with self.cond:
            self.pending += 1

    def put(self, item: tuple[Any, Any, BaseException | None]) -> None:
        self.done.append(item)
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    def drain(self) -> list[tuple[Any, Any, BaseException | None]]:
        out = []
        pop = self.done.popleft
        while self.done:
            out.append(pop())
        return out

    def wait(self, timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.pending <= 0, timeout)


def _thread_loop(jobs: queue.SimpleQueue, inbox: _Inbox) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        fn, payload, tag = item
        try:
            inbox.put((tag, fn(payload), None))
        except Exception as exc:  # noqa: BLE001
            log.warning("background refit failed: %r", exc)
            inbox.put((tag, None, exc))


class ThreadRefits(RefitExecutor):
    """One daemon thread runs the jobs in order. Shares the GIL with the caller (see module doc)."""

    kind = "thread"

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox = _Inbox()
        self._thread = threading.Thread(target=_thread_loop, args=(self._jobs, self._inbox),
                                        name="refit", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def submit(self, fn: Callable[[Any], Any], payload: Any, tag: Any) -> None:
        self._inbox.sent()
        self._jobs.put((fn, payload, tag))

    def results(self) -> list[tuple[Any, Any, BaseException | None]]:
        return self._inbox.drain() if self._inbox.done else []

    @property
    def in_flight(self) -> int:
        return self._inbox.pending

    def wait(self, timeout: float | None = None) -> bool:
        return self._inbox.wait(timeout)

    def close(self) -> None:
        self._finalizer()
        self._thread.join(timeout=DEFAULT_TIMEOUTS.refit_stop_s)


# ------------------------------------------------------------------------------ helper process
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if here not in paths:
        paths.insert(0, here)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def _read_exact(f: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _stop_process(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):            # EOF on its stdin: the helper exits
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=DEFAULT_TIMEOUTS.refit_stop_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=DEFAULT_TIMEOUTS.refit_stop_s)


class ProcessRefits(RefitExecutor):
    """Jobs run in one helper process (:func:`_child_main`); see the module docstring.

    No thread in the caller's process: jobs are pickled into an outgoing buffer and the pipes are
    non-blocking, so :meth:`submit` and :meth:`results` only write what the pipe accepts and read
    what has arrived (a few µs when idle); the caller never waits for the GIL or for the helper.
    ``fn`` and ``payload`` must pickle (module-level functions, numpy arrays). If the helper cannot
    start or dies, the executor falls back to a thread, with a warning.
    """

    kind = "process"

    def __init__(self) -> None:
        self._tags: dict[int, Any] = {}
        self._done: list[tuple[Any, Any, BaseException | None]] = []
        self._next_id = 0
        self._out: collections.deque[memoryview] = collections.deque()
        self._in = bytearray()
        self._dead = False
        self._fallback: ThreadRefits | None = None
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CMD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=_child_env(), close_fds=True, bufsize=0)
        except OSError as exc:
            log.warning("cannot start the refit process (%s); refitting on a thread", exc)
            self._proc = None
            self._fallback = ThreadRefits()
            return
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._wfd = self._proc.stdin.fileno()
        self._rfd = self._proc.stdout.fileno()
        os.set_blocking(self._wfd, False)
        os.set_blocking(self._rfd, False)
        try:                                           # a bigger pipe: fewer partial writes
            import fcntl

            fcntl.fcntl(self._wfd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except (OSError, ImportError, ValueError):
            pass
        self._finalizer = weakref.finalize(self, _stop_process, self._proc)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def submit(self, fn: Callable[[Any], Any], payload: Any, tag: Any) -> None:
        if self._fallback is None and self._dead:
            log.warning("the refit process exited (code %s); refitting on a thread from now on",
                        self._proc.poll() if self._proc else None)
            self._fallback = ThreadRefits()
        if self._fallback is not None:
            self._fallback.submit(fn, payload, tag)
            return
        job_id = self._next_id
        self._next_id += 1
        try:
            chunks = _frame(job_id, (fn, payload))
        except Exception as exc:  # noqa: BLE001 - e.g. a hook that does not pickle
            self._done.append((tag, None, exc))
            return
        self._tags[job_id] = tag
        self._out.extend(chunks)
        self._pump()

    def _pump(self) -> None:
        """Write what the pipe accepts, read what has arrived, parse finished jobs."""
        if self._dead or self._proc is None:
            return
        out = self._out
        try:
            while out:
                n = os.writev(self._wfd, list(out)[:64])
                while n > 0:
                    first = out[0]
                    if n >= first.nbytes:
                        n -= first.nbytes
                        out.popleft()
                    else:
                        out[0] = first[n:]
                        n = 0
        except BlockingIOError:
            pass
        except OSError as exc:                         # broken pipe: the helper is gone
            self._die(exc)
            return
        while True:
            try:
                chunk = os.read(self._rfd, 1 << 20)
            except BlockingIOError:
                break
            except OSError as exc:
                self._die(exc)
                return
            if not chunk:
                self._die(RuntimeError("refit process exited"))
                return
            self._in += chunk
        buf = self._in
        pos = 0
        while True:
            frame = _parse_frame(buf, pos)
            if frame is None:
                break
            pos, job_id, (result, err) = frame
            tag = self._tags.pop(job_id, None)
            self._done.append((tag, result, RuntimeError(err) if err is not None else None))
        if pos:
            del buf[:pos]

    def _die(self, exc: BaseException) -> None:
        self._dead = True
        for job_id in list(self._tags):
            self._done.append((self._tags.pop(job_id), None, RuntimeError(f"refit process: {exc}")))

    def results(self) -> list[tuple[Any, Any, BaseException | None]]:
        if self._tags or self._out:
            self._pump()
        out, self._done = self._done, []
        if self._fallback is not None:
            out += self._fallback.results()
        return out

    @property
    def in_flight(self) -> int:
        return len(self._tags) + (self._fallback.in_flight if self._fallback else 0)

    def wait(self, timeout: float | None = None) -> bool:
        import select
        import time

        end = None if timeout is None else time.monotonic() + timeout
        while self._tags and not self._dead and self._proc is not None:
            self._pump()
            if not self._tags or self._dead:
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            wl = [self._wfd] if self._out else []
            select.select([self._rfd], wl, [], 0.05 if left is None else min(left, 0.05))
        if self._fallback is not None:
            return self._fallback.wait(timeout)
        return True

    def close(self) -> None:
        if self._proc is not None:
            self._finalizer()
        if self._fallback is not None:
            self._fallback.close()


def make_executor(mode: str) -> RefitExecutor:
    """``sync``, ``thread``, ``process``, or ``background`` (= ``process``)."""
    if mode == "sync":
        return SyncRefits()
    if mode == "thread":
        return ThreadRefits()
    if mode in ("process", "background"):
        return ProcessRefits()
    raise ValueError(f"refit must be one of {', '.join(REFIT_MODES)}, got {mode!r}")


# ------------------------------------------------------------------------------ child side
def _child_main() -> int:
    """Helper process: read (id, fn, payload) frames on stdin, answer (id, result, error) on stdout."""
    try:
        os.nice(10)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                                 # stray prints go to stderr, not into the frames
    inp = sys.stdin.buffer
    while True:
        frame = _read_frame(lambda n: _read_exact(inp, n))
        if frame is None:
            return 0
        job_id, data, bufs = frame
        try:
            fn, payload = pickle.loads(data, buffers=bufs)   # e.g. a hook's module may not import
            msg: tuple[Any, str | None] = (fn(payload), None)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps its weights
            msg = (None, repr(exc))
        try:
            for chunk in _frame(job_id, msg):
                out.write(chunk)
            out.flush()
        except OSError:
            return 0
