"""The stop flag that signal handlers set never waits on a lock.

A shard that got SIGTERM twice (its launcher's SIGKILL: the parent-death signal, then the
parent watchdog) deadlocked inside ``threading.Event.set``: the second handler ran in the same
thread while the first held the Event's lock. ``StopFlag.from_signal`` stores a number only.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from ps_common.cli_util import StopFlag


def test_a_signal_sets_the_flag_while_the_event_lock_is_held():
    flag = StopFlag()
    with flag._event._cond:  # what the interrupted first handler held
        done = threading.Event()

        def request() -> None:
            flag.from_signal(signal.SIGTERM)
            done.set()

        t = threading.Thread(target=request, daemon=True)
        t.start()
        assert done.wait(2.0), "from_signal waited for the Event's lock"
    assert flag.is_set() and flag.signal == signal.SIGTERM


def test_installed_handlers_set_the_flag_for_each_signal_without_stopping_the_process():
    flag = StopFlag()
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        flag.install((signal.SIGUSR2,))
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 2.0
        while not flag.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.signal == signal.SIGUSR2
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_set_from_another_thread_is_seen():
    flag = StopFlag()
    assert not flag.is_set()
    t = threading.Thread(target=flag.set)
    t.start()
    t.join(timeout=5)
    assert not t.is_alive() and flag.is_set() and flag.signal is None
