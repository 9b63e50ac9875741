"""Room for the members, against real shards: what a client holding a worker's credential can
ask for is bounded so that the members' own requests always fit, and the run goes on to its end.

Joins past what the global batch can feed are refused with ``job_full``; names and reasons
longer than 256 characters are refused or cut.

A worker credential is enough to join, and every member must get at least ``min_batch``
samples of X, so X / min_batch members is the most any split can include. Before joins were
checked against it, the member past that bound was admitted and shard 0 died with a traceback
at the next plan (no split exists), taking the job with it.

Pulls without a worker id (anyone with a credential may send them: observers, the evaluator)
have their own bound, apart from the members' (per worker id). Before, one total bounded both,
and a flood of pulls that never come due filled it: every member's push-and-pull was refused.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from ps_common.transport import Connection, RemoteError
from ps_worker.client import ShardClients
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

SEED = 5
N_TRAIN = 256
X = 4


def _job(name: str, num_workers: int) -> dict:
    """One shard, an MLP on synthetic data, X = 4 for 30 iterations."""
    return {
        "run": {"name": name, "seed": SEED},
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": N_TRAIN, "synthetic_test": 64},
        "training": {"global_batch": X, "max_iterations": 30},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": {"num_shards": 1, "num_workers": num_workers},
        "evaluator": {"enabled": False},
    }


@pytest.mark.timeout(240)
def test_a_join_past_x_over_min_batch_is_refused_and_the_run_goes_on(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, _job("admission", num_workers=2))
    run = tmp_path / "run"
    (ep,), honest = start_job(procs, cfg_path, 1, 1, run, start=start_indexed_workers)
    extra = [ShardClients(zmq.Context.instance(), ep, timeout_s=30, connect_timeout_s=30,
                          security=cfg.security) for _ in range(3)]
    try:
        with joined_member(cfg, ep) as m:              # the job starts: the honest worker and m
            ids = []
            for k, c in enumerate(extra[:2]):          # members 3 and 4 of X = 4: admitted
                ids.append((c, c.join(f"extra-{k}", cfg.job_digest(), "cpu").worker_id))
            with pytest.raises(RemoteError) as err:    # member 5: no split could give it a sample
                extra[2].join("extra-2", cfg.job_digest(), "cpu")
            assert err.value.code == "job_full", err.value
            with pytest.raises(RemoteError) as err:    # a live worker's name, with a probe to cap it
                extra[2].join("worker-0", cfg.job_digest(), "cpu", memory_fits=1, memory_fails=2)
            assert err.value.code == "name_in_use", err.value
            with pytest.raises(RemoteError) as err:    # names go into logs, records, checkpoints
                extra[2].join("n" * 257, cfg.job_digest(), "cpu")
            assert err.value.code == "bad_join", err.value
            for c, wid in ids:                         # so do reasons: kept to their first 256
                c.send_to_coordinator(P.Leave(worker_id=wid, token=c.token, reason="r" * 100_000), P.Ack)
            # m's push completes iteration 0; the next plan is made over the members left.
            grads = np.zeros_like(m.params)
            res = m.client.push_pull(grads, m.params, worker_id=m.worker_id, assignment=m.assignment,
                                     loss=0.0, telemetry={})
            assert res.version == m.assignment.iteration + 1
    finally:
        for c in extra:
            c.close()
    wait_exit(honest, timeout_s=180)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    _, version = consistent_end(run, 1)
    assert version == 30
    events = list(read_jsonl(run / "metrics" / "coordinator.jsonl"))
    removed = [r["reason"] for r in events if r.get("event") == "worker_removed"]
    assert sorted(map(len, removed))[-2:] == [len("left ()") + 256] * 2
    recs = [r for r in events if "event" not in r]
    sums = [sum(r["batch_sizes"].values()) for r in sorted(recs, key=lambda r: r["version"])]
    assert max(sums) == X and sums[-1] == X, "an iteration a member left commits fewer, never more"
    committed_batches(recs, SEED, N_TRAIN)


@pytest.mark.timeout(240)
def test_a_flood_of_pulls_without_a_worker_id_leaves_the_members_room(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {**_job("pull-flood", num_workers=1),
                                            "transport": {"max_pending_pulls": 8, "max_pending_pulls_per_peer": 4}})
    run = tmp_path / "run"
    (ep,) = start_servers(procs, cfg_path, 1, run)
    flood = [Connection(zmq.Context.instance(), ep, role="worker", timeout_s=10, security=cfg.security)
             for _ in range(3)]
    try:
        for conn in flood[:2]:                       # 8 pulls for a version that never comes
            for _ in range(4):
                conn.send(P.Pull(worker_id=-1, min_version=2**62))
        time.sleep(1.0)                              # they arrive (on other connections) first
        with pytest.raises(RemoteError) as err:      # the ninth: refused
            flood[2].request(P.Pull(worker_id=-1, min_version=2**62), P.Params)
        assert err.value.code == "too_many_pulls", err.value
        honest = start_indexed_workers(procs, cfg_path, ep, 1, run)
        wait_exit(honest, timeout_s=180)             # every push-and-pull of the member fits
    finally:
        for conn in flood:
            conn.close()
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    _, version = consistent_end(run, 1)
    assert version == 30
