"""A member's well-formed push with a NaN, an Inf, or finite values whose sum overflows, against
real shards: refused on arrival (``nonfinite``), nothing held, and the run goes on exactly.

The forger joins as a worker (a valid credential and membership token, a real assignment) and
sends each shard its slice at the planned size, so every other check passes and only the
finiteness check (``ps_server.optimizer.all_finite``) stands between the value and the update.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from ps_common.transport import RemoteError
from tests.cluster_util import (
    committed_batches,
    consistent_end,
    joined_member,
    start_job,
    start_servers,
    wait_exit,
    write_config,
)
from tests.system.test_system_memory import start_indexed_workers

pytestmark = pytest.mark.system

SEED = 9
N_TRAIN = 400


def _job(name: str, model: str, iterations: int) -> dict:
    """Two shards, two workers, BSP on synthetic data."""
    return {
        "run": {"name": name, "seed": SEED},
        "model": {"name": model},
        "data": {"dataset": "synthetic", "synthetic_train": N_TRAIN, "synthetic_test": 100},
        "training": {"global_batch": 64, "max_iterations": iterations},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": {"num_shards": 2, "num_workers": 2},
        "evaluator": {"enabled": False},
    }


@pytest.mark.timeout(300)
def test_a_members_nonfinite_pushes_are_refused_and_change_nothing(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, _job("nonfinite", "lenet", 6))
    run = tmp_path / "run"
    eps, honest = start_job(procs, cfg_path, 2, 1, run, start=start_indexed_workers)
    with joined_member(cfg, eps[0]) as m:
        me, wid, token, a = m.client, m.worker_id, m.token, m.assignment
        assert a is not None and a.batch_size > 0
        big = np.finfo(np.float32).max
        for k, (lo, hi) in enumerate(me.ranges):
            for bad in (np.nan, np.inf, -np.inf, "overflow"):
                grads = np.zeros(hi - lo, np.float32)
                if bad == "overflow":
                    grads[:4] = big                      # every value finite, their sum is not
                else:
                    grads[(hi - lo) // 2] = bad
                with pytest.raises(RemoteError) as err:
                    me.conns[k].request(P.Push(worker_id=wid, token=token, iteration=a.iteration,
                                               batch_size=a.batch_size, pull=True, arrays=[grads]), P.Params)
                assert err.value.code == "nonfinite", (k, bad, err.value)
        # Nothing was held: the honest push of the same iteration is accepted and committed.
        grads = np.zeros_like(m.params)
        res = me.push_pull(grads, m.params, worker_id=wid, assignment=a, loss=0.0, telemetry={})
        assert res.version == a.iteration + 1
    wait_exit(honest, timeout_s=240)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    params, version = consistent_end(run, 2)
    assert np.isfinite(params).all()
    recs = [r for r in read_jsonl(run / "metrics" / "coordinator.jsonl") if "event" not in r]
    first = min(recs, key=lambda r: r["version"])
    assert first["batch_sizes"][str(wid)] == a.batch_size and sum(first["batch_sizes"].values()) == 64
    committed_batches(recs, SEED, N_TRAIN)


@pytest.mark.timeout(100)
def test_a_real_workers_nan_in_one_followers_slice_costs_one_rejoin_not_the_transport_timeout(procs, tmp_path):
    """A real worker's gradient with a NaN in shard 1's slice only (``nan_in_push``): shard 1
    refuses it, shard 0 holds its finite slice and waits for a gradient that can never be whole.
    The worker must not wait for shard 0 until the transport timeout (120 s here, longer than
    this test may take: every other worker waits as long under BSP); it joins again at once, its
    samples are served again, and the run ends as single-process SGD over what was committed."""
    from ps_ml.datasets import load_dataset
    from ps_ml.reference import train_reference_batches
    from tests.cluster_util import start_workers

    cfg_path, cfg = write_config(tmp_path, {**_job("nan-in-push", "mlp", 20), "transport": {"timeout_s": 120}})
    run = tmp_path / "run"
    eps = start_servers(procs, cfg_path, 2, run)
    fault = {"LBBSP_FAULTS": '{"nan_in_push": {"worker": "worker-1", "iteration": 4, "shard": 1}}'}
    workers = start_workers(procs, cfg_path, eps[0], 1, run) + \
        [procs.start("worker-1", "ps_worker.cli", ["--config", str(cfg_path), "--server", eps[0], "--run-dir",
                                                   str(run), "--name", "worker-1"], env=fault)]
    wait_exit(workers, timeout_s=80)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=30)
    assert "refused the push: [nonfinite]" in workers[1].log_path.read_text()
    params, version = consistent_end(run, 2)
    assert version == 20 and np.isfinite(params).all()
    recs = [r for r in read_jsonl(run / "metrics" / "coordinator.jsonl") if "event" not in r]
    batches = committed_batches(recs, SEED, N_TRAIN)       # no sample applied twice, none lost
    data = load_dataset("synthetic", seed=SEED, synthetic_train=N_TRAIN, synthetic_test=100)
    ref = train_reference_batches("mlp", SEED, data, batches, lr=0.05, momentum=0.9)
    assert float(np.linalg.norm(params - ref) / np.linalg.norm(ref)) < 1e-5
