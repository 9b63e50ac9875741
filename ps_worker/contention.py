"""The I/O side of a heterogeneity scenario: CPU burners, emulated sleeps, communication delay.

:mod:`ps_worker.scenario_runtime` decides (pure functions of iteration and elapsed seconds); this module
carries the decisions out:

* :class:`CpuBurners` runs N CPU-burning processes beside the worker (real co-located load).
  Each burner is ``python -c`` spinning on floats; it exits on its own as soon as its parent is
  gone, so a SIGKILLed worker never leaves burners behind.
* :class:`ContentionDriver` is a daemon thread that keeps the burner count equal to
  ``runtime.cpu_processes(elapsed)``.
* :class:`EmulatedSlowdown` sleeps (f - 1) x the measured compute time after each compute phase.
* :class:`CommDelay` sleeps the emulated per-message delay before a message is sent.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from ps_common.timeouts import DEFAULT_TIMEOUTS

if TYPE_CHECKING:  # keep this module light: burner tests import it in small child processes
    from ps_worker.scenario_runtime import ScenarioRuntime

log = logging.getLogger(__name__)

BURNER_TAG = "lbbsp-cpu-burner"

# Spins on floats; checks every few milliseconds whether the process that started it is still
# its parent (after the parent dies the burner is re-parented, so getppid() changes).
_BURNER_CODE = """
import os, sys
ppid = int(sys.argv[1])
x = 0.5
while os.getppid() == ppid:
    for _ in range(20000):
        x = x * 0.999999 + 0.0000005
"""


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=DEFAULT_TIMEOUTS.burner_kill_s)
        except (subprocess.TimeoutExpired, OSError):  # pragma: no cover - a stuck kill
            log.warning("cpu burner %d did not exit after SIGKILL", p.pid)
    procs.clear()


class CpuBurners:
    """A set of CPU-burning child processes whose size :meth:`set_count` controls.

    ``cpus``: pin every burner to these CPUs (e.g. the worker's own CPU set, so the burners
    compete with the worker and not with its neighbours); default: inherit the parent's
    affinity. Not thread-safe beyond one controlling thread plus :meth:`close`.
    """

    def __init__(self, cpus: Optional[Iterable[int]] = None, *, python: str = sys.executable) -> None:
        self.cpus = None if cpus is None else sorted(set(int(c) for c in cpus))
        if self.cpus is not None and not self.cpus:
            raise ValueError("cpus must name at least one CPU")
        self.python = python
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        # Kill them at interpreter exit even if close() was never called.
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def _spawn(self) -> subprocess.Popen:
        p = subprocess.Popen(
            [self.python, "-I", "-S", "-c", _BURNER_CODE, str(os.getpid()), BURNER_TAG],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True)
        if self.cpus is not None and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(p.pid, self.cpus)
            except ProcessLookupError:  # pragma: no cover - it already died
                pass
            except OSError:
                p.kill()
                p.wait()
                raise
        return p

    def set_count(self, n: int) -> int:
        """Start or stop burners until exactly ``n`` run; returns ``n``."""
        if n < 0:
            raise ValueError(f"burner count must be >= 0, got {n}")
        with self._lock:
            if self._closed:
                raise RuntimeError("CpuBurners is closed")
            # Forget burners that died on their own (killed from outside), so they are replaced.
            self._procs[:] = [p for p in self._procs if p.poll() is None]
            while len(self._procs) < n:
                self._procs.append(self._spawn())
            if len(self._procs) > n:
                extra = self._procs[n:]
                del self._procs[n:]
                _kill_all(extra)
            return n

    @property
    def count(self) -> int:
        """Burners alive now."""
        with self._lock:
            return sum(1 for p in self._procs if p.poll() is None)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs if p.poll() is None]

    def close(self) -> None:
        """Kill every burner; idempotent."""
        with self._lock:
            self._closed = True
            _kill_all(self._procs)

    def __enter__(self) -> "CpuBurners":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ContentionDriver:
    """Keeps the burner count at ``runtime.cpu_processes(elapsed)`` from a daemon thread.

    ``elapsed`` is ``clock() - origin``; :meth:`start` takes the origin (default: now) so the
    worker can share one time origin between real load and emulated slowdowns. When the
    runtime has no real load no thread and no process is started.
    """

    def __init__(self, runtime: "ScenarioRuntime", clock: Callable[[], float] = time.monotonic, *,
                 interval_s: float = 0.2, burners: Optional[CpuBurners] = None,
                 cpus: Optional[Iterable[int]] = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.runtime = runtime
        self.clock = clock
        self.interval_s = interval_s
        self._burners = burners
        self._cpus = cpus
        self._origin: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.target = 0  # the last count asked for
        self.errors = 0

    @property
    def burners(self) -> CpuBurners:
        if self._burners is None:
            self._burners = CpuBurners(self._cpus)
        return self._burners

    @property
    def started(self) -> bool:
        return self._origin is not None

    @property
    def origin(self) -> float:
        if self._origin is None:
            raise RuntimeError("ContentionDriver not started")
        return self._origin

    def elapsed(self) -> float:
        return self.clock() - self.origin

    def tick(self) -> int:
        """One update (the thread calls this every ``interval_s``); returns the target count."""
        self.target = self.runtime.cpu_processes(self.elapsed())
        self.burners.set_count(self.target)
        return self.target

    def start(self, origin: Optional[float] = None) -> "ContentionDriver":
        if self._origin is not None:
            raise RuntimeError("ContentionDriver already started")
        self._origin = self.clock() if origin is None else origin
        if self.runtime.has_real_load:
            self.tick()
            self._thread = threading.Thread(target=self._run, name="contention", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # keep the load going; the next tick retries
                self.errors += 1
                if self.errors <= 3:
                    log.warning("contention update failed: %s", exc)

    def stop(self) -> None:
        """Stop the thread and kill every burner; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DEFAULT_TIMEOUTS.contention_stop_s)
            self._thread = None
        if self._burners is not None:
            self._burners.close()

    def __enter__(self) -> "ContentionDriver":
        if self._origin is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmulatedSlowdown:
    """Sleeps (f - 1) x compute after each compute phase, f = ``runtime.slowdown(...)``.

    The worker counts the returned seconds inside its compute phase (so samples/s and the
    batch-size manager see the slowdown) and reports them as emulated.
    """

    def __init__(self, runtime: "ScenarioRuntime", *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.runtime = runtime
        self.sleep = sleep
        self.clock = clock
        self.last_factor = 1.0
        self.total_s = 0.0

    def after_compute(self, iteration: int, elapsed_s: float, compute_s: float) -> float:
        """Sleep for this iteration's emulated share; returns the seconds actually slept."""
        f = self.runtime.slowdown(iteration, elapsed_s)
        self.last_factor = f
        extra = (f - 1.0) * max(compute_s, 0.0)
        if extra <= 0.0:
            return 0.0
        t0 = self.clock()
        self.sleep(extra)
        slept = self.clock() - t0
        self.total_s += slept
        return slept


class CommDelay:
    """Emulated slower network: ``delay(nbytes)`` sleeps ``runtime.message_delay_s(nbytes)``
    before a message is sent and returns the seconds slept (0 without a delay)."""

    def __init__(self, runtime: "ScenarioRuntime", *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.runtime = runtime
        self.sleep = sleep
        self.total_s = 0.0
        self.active = runtime.comm_delay_s > 0 or runtime.message_delay_s(1) > 0

    def __call__(self, nbytes: int = 0) -> float:
        if not self.active:
            return 0.0
        d = self.runtime.message_delay_s(nbytes)
        if d > 0:
            self.sleep(d)
            self.total_s += d
        return d


def kill_pid(pid: int) -> None:
    """Best-effort SIGKILL of one pid (tests use it to clean up a burner they know)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
