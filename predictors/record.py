"""Record a real speed trace: a torch training loop timed while CPU burners come and go beside it.

Predictors have to be judged on real contention, not on a formula we wrote ourselves: this runs a
LeNet-like CNN (random 28x28 inputs, batch 64, one torch thread) and, on a seeded on/off schedule,
starts and stops processes that spin on the CPU. By default the trainer and the burners are pinned
to one core, so the contention is the same on a 2-core laptop and a 64-core server (unpinned
burners on a big host would simply land on idle cores). Whatever else runs on the machine adds
its own, equally real, noise.

Per iteration it records speed = samples / compute seconds and the exogenous inputs a worker
reports (``ps_common.report.EXOG_KEYS``, measured with psutil exactly as the worker does).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from predictors.traces import Trace

log = logging.getLogger(__name__)

Schedule = list[tuple[int, int]]  # (first iteration, number of burners), sorted by iteration


def random_schedule(iterations: int, seed: int = 0, max_burners: int = 2, min_len: int = 20,
                    max_len: int = 60) -> Schedule:
    """Seeded on/off schedule: segments of ``min_len..max_len`` iterations, each with a burner
    count in ``0..max_burners`` different from the previous segment's."""
    if max_burners < 1 or not (1 <= min_len <= max_len):
        raise ValueError("need max_burners >= 1 and 1 <= min_len <= max_len")
    rng = random.Random(seed)
    out: Schedule = []
    it, prev = 0, -1
    while it < iterations:
        n = rng.choice([k for k in range(max_burners + 1) if k != prev])
        out.append((it, n))
        prev = n
        it += rng.randint(min_len, max_len)
    return out


def parse_schedule(text: str) -> Schedule:
    """Parse ``"0:0,50:2,120:1"`` (iteration:burners, iterations increasing)."""
    out: Schedule = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            a, b = part.split(":")
            it, n = int(a), int(b)
        except ValueError:
            raise ValueError(f"bad schedule entry {part!r}; expected ITERATION:BURNERS") from None
        if it < 0 or n < 0 or (out and it <= out[-1][0]):
            raise ValueError(f"bad schedule entry {part!r}: iterations must increase, counts >= 0")
        out.append((it, n))
    if not out:
        raise ValueError("empty schedule")
    return out


def burners_at(schedule: Schedule, iteration: int) -> int:
    """Number of burners the schedule asks for at ``iteration`` (0 before its first entry)."""
    n = 0
    for it, k in schedule:
        if it > iteration:
            break
        n = k
    return n


def _burn() -> None:  # pragma: no cover - runs in a child process
    """Spin forever; the parent terminates us."""
    x = 0
    while True:
        x = (x + 1) & 0xFFFF


class _Burners:
    """Keeps exactly ``n`` spinning processes alive; always stopped by :meth:`stop_all`."""

    def __init__(self) -> None:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        self._ctx: Any = mp.get_context(method)  # fork: a burner starts in ~1 ms, without re-importing torch
        self._procs: list[mp.process.BaseProcess] = []

    def set(self, n: int) -> None:
        while len(self._procs) < n:
            p = self._ctx.Process(target=_burn, daemon=True, name="cpu-burner")
            p.start()
            self._procs.append(p)
        while len(self._procs) > n:
            self._stop(self._procs.pop())

    @staticmethod
    def _stop(p: mp.process.BaseProcess) -> None:
        p.terminate()
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)

    def stop_all(self) -> None:
        while self._procs:
            self._stop(self._procs.pop())


def record_trace(iterations: int = 300, schedule: Schedule | None = None, *, seed: int = 0,
                 batch_size: int = 64, steps_per_iteration: int = 3, pin: bool = True,
                 warmup: int = 5, name: str = "recorded",
                 progress: Callable[[int, float, int], None] | None = None) -> Trace:
    """Run the training loop for ``iterations`` timed iterations under ``schedule``.

    One iteration is ``steps_per_iteration`` SGD steps of ``batch_size`` samples, so that it lasts
    long enough (tens of ms) for the CPU percentages to be more than a few scheduler ticks.
    The torch thread count is set to 1 for the recording and restored afterwards.
    """
    import psutil
    import torch
    import torch.nn.functional as F

    from ps_ml.models import build_model

    if iterations < 1 or batch_size < 1 or steps_per_iteration < 1 or warmup < 0:
        raise ValueError("need iterations >= 1, batch_size >= 1, steps_per_iteration >= 1, warmup >= 0")
    schedule = schedule if schedule is not None else random_schedule(iterations, seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_model("lenet", seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (batch_size,), generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    proc = psutil.Process()
    ncpu = psutil.cpu_count() or 1
    old_threads = torch.get_num_threads()
    old_affinity: set[int] | None = None
    burners = _Burners()
    speeds, exogs = [], []
    try:
        torch.set_num_threads(1)
        if pin and hasattr(os, "sched_setaffinity"):
            old_affinity = os.sched_getaffinity(0)
            core = min(old_affinity)
            os.sched_setaffinity(0, {core})  # burners are forked after this and inherit the core
            log.info("pinned the trainer and its burners to core %d", core)
        for _ in range(warmup):
            step()
        proc.cpu_percent(None)
        psutil.cpu_percent(None)
        for it in range(iterations):
            burners.set(burners_at(schedule, it))
            t0 = time.perf_counter()
            for _ in range(steps_per_iteration):
                step()
            dt = time.perf_counter() - t0
            proc_cpu = float(proc.cpu_percent(None))
            host_cpu = float(psutil.cpu_percent(None))
            mem = float(psutil.virtual_memory().percent)
            speeds.append(batch_size * steps_per_iteration / dt)
            exogs.append([host_cpu, max(0.0, host_cpu - proc_cpu / ncpu), mem])
            if progress is not None:
                progress(it, speeds[-1], burners_at(schedule, it))
    finally:
        burners.stop_all()
        torch.set_num_threads(old_threads)
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
    return Trace(np.array(speeds), np.array(exogs), name=name)


def schedule_to_text(schedule: Sequence[tuple[int, int]]) -> str:
    """Inverse of :func:`parse_schedule`."""
    return ",".join(f"{it}:{n}" for it, n in schedule)
