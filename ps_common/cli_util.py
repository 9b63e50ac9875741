"""Argument, logging and process helpers shared by every command-line tool."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import threading
import time

from ps_common.config import ConfigCheck, JobConfig, load_config

#: Set by ps-launch on its children: the launcher's pid, watched so that no child outlives it.
PARENT_ENV = "LBBSP_PARENT_PID"


def add_common_args(ap: argparse.ArgumentParser, *, config_required: bool = True) -> None:
    ap.add_argument("--config", required=config_required, help="job YAML (see configs/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set training.global_batch=256")
    ap.add_argument("--run-dir", default=None, help="directory for this process's metrics")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace this process's records of an earlier run in --run-dir (refused "
                         "otherwise: two runs' records in one file would be summed as one run)")
    ap.add_argument("--secret-file", default=None,
                    help="the job secret (security.secret_file): a master on shards, a master or "
                         "this role's file elsewhere; make one with `ps-keys secret FILE`")
    ap.add_argument("--log-level", default=os.environ.get("LBBSP_LOG_LEVEL", "INFO"))


def setup_logging(level: str) -> None:
    """Log lines with time and pid; ``kill -USR1 PID`` writes every thread's stack to stderr
    (the role's log under ps-launch), to see where a process that does not stop is waiting."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def load_cli_config(path: str | None, overrides: list[str], secret_file: str | None = None, *,
                    check: ConfigCheck | None = None) -> JobConfig:
    extra = [f"security.secret_file={os.path.abspath(secret_file)}"] if secret_file else []
    return load_config(path, [*overrides, *extra], check=check)


def watch_parent(interval_s: float = 0.5) -> None:
    """Exit (SIGTERM to ourselves) when the launcher that started us dies.

    ps-launch sets ``LBBSP_PARENT_PID``; on Linux the child also asked the kernel for a
    parent-death signal before exec. This thread covers the rest (and other systems): a job
    whose launcher was SIGKILLed ends by itself instead of leaving orphans.
    """
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return
    parent = int(raw)
    parent_death_signal()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                logging.getLogger(__name__).warning("launcher %d is gone: stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(interval_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def prctl(option: int, value: object) -> None:
    """Linux's prctl(2) with one argument (no-op elsewhere, or where it fails)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def parent_death_signal() -> None:
    """Linux: have the kernel send SIGTERM when the parent exits (no-op elsewhere)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class StopFlag:
    """A stop request that a signal handler may set.

    ``threading.Event.set`` takes a lock: a second signal that arrives while the first
    handler holds it runs the handler again in the same thread, which then waits on that
    lock forever (seen: a shard that never exited after its launcher's SIGKILL, because the
    parent-death signal and the parent watchdog sent it SIGTERM twice). ``from_signal`` only
    stores a number; ``set`` (other threads, the loop itself) keeps the Event.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: int | None = None

    def set(self) -> None:
        self._event.set()

    def from_signal(self, signum: int, _frame: object = None) -> None:
        self.signal = signum  # nothing here may take a lock

    def is_set(self) -> bool:
        return self.signal is not None or self._event.is_set()

    def install(self, signals: tuple[signal.Signals, ...]) -> None:
        """Main thread only (Python's rule for signal handlers)."""
        for sig in signals:
            signal.signal(sig, self.from_signal)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP (what Slurm, Kubernetes, systemd and a closed terminal send) become
    KeyboardInterrupt, so the tool's Ctrl-C path stops its children and writes what it has."""
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
