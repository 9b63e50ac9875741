"""Background refits in the helper process (a real child, ``python -c ...``): it gives the
synchronous forecasts once its fits have landed, a slow fit in it never blocks a decision, it
goes away with its owner, and its death falls back to a thread.
(Batched predictors, thread refits and staggering are in tests/unit/test_predictors_batch.py.)"""

from __future__ import annotations

import functools
import gc
import os
import time
from pathlib import Path

import psutil
import pytest

from batchsize_manager import BatchSizeManager
from batchsize_manager.simulation import SimulatedWorker, Simulation
from predictors.arima import BatchARIMA
from predictors.refit import ProcessRefits, ThreadRefits
from tests.unit.test_predictors_batch import ALL, REFIT_CASES, YS, K, assert_background_equals_sync, fresh


@pytest.mark.parametrize("cls,kw", REFIT_CASES)
def test_helper_process_refits_equal_sync_once_landed(cls, kw):
    assert_background_equals_sync(cls, kw, "process")


def wait_for_file(path: str) -> None:
    """Process-mode hook: hold the fit until ``path`` exists (the only sleep is here)."""
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)


def test_a_slow_fit_in_the_helper_process_does_not_block(tmp_path: Path):
    flag = tmp_path / "go"
    m = BatchSizeManager("lbbsp-cpu", 256, policy_args={
        "predictor": "arima", "refit": "background", "predictor_args": {"refit_every": 5}})
    pred = m.policy.predictor
    assert isinstance(pred.executor, ProcessRefits) and psutil.pid_exists(pred.executor.pid)
    pred.fit_hook = functools.partial(wait_for_file, str(flag))
    sim = Simulation(m, [SimulatedWorker(1000.0 * (1 + i), 0.002, noise=0.02, seed=i) for i in range(4)])
    try:
        for _ in range(40):
            rec = sim.step()
            assert sum(rec.sizes.values()) == 256
        assert pred.submitted_jobs >= 1 and pred.landed_fits == 0 and pred.in_flight >= 1
        assert pred.in_flight <= pred.max_jobs
        flag.touch()
        assert pred.drain(60) and pred.landed_fits > 0
    finally:
        flag.touch()
        m.close()


def test_helper_process_goes_away_with_its_owner():
    def helpers() -> set[int]:
        return {c.pid for c in psutil.Process().children() if c.is_running()
                and c.status() != psutil.STATUS_ZOMBIE}

    before = helpers()
    m = BatchSizeManager("lbbsp-cpu", 64, policy_args={"predictor": "narx"})
    pid = m.policy.predictor.executor.pid
    assert pid in helpers() - before
    m.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    m = BatchSizeManager("lbbsp-cpu", 64, policy_args={"predictor": "arima"})
    pid = m.policy.predictor.executor.pid
    del m
    gc.collect()
    assert helpers() <= before


def test_helper_death_falls_back_to_a_thread():
    p = fresh(BatchARIMA(refit_every=6, refit="process"))
    try:
        for t in range(20):
            p.update(ALL, YS[:, t])
        assert p.drain(60)
        psutil.Process(p.executor.pid).kill()
        psutil.Process(p.executor.pid).wait(10)
        for t in range(20, 60):
            p.update(ALL, YS[:, t])
        assert p.drain(60)
        assert isinstance(p.executor._fallback, ThreadRefits) and p.landed_fits >= 2 * K
    finally:
        p.close()
