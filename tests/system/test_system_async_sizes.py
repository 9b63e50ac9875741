"""Async mode against real shards: a member pushes its gradient to the follower at a size nobody
assigned, then at the assigned size to shard 0, while the honest worker's commits carry the drop
of the first. Both shards must apply the same commits, the member's assigned gradient included.

Followers do not know async assignments (only the coordinator does), so they hold any size
within bounds and report it; the coordinator drops what it never assigned. That drop named only
(worker, iteration), so it also took the assigned gradient shard 0 held under the same key, and
the commit naming it later failed on shard 0 after the follower had applied it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from tests.cluster_util import (
    consistent_end,
    joined_member,
    operator_request,
    start_servers,
    wait_exit,
    write_config,
)
from tests.system.test_system_failures import wait_version

pytestmark = pytest.mark.system


@pytest.mark.timeout(120)
def test_a_push_at_an_unassigned_size_is_dropped_without_the_assigned_one(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {
        "run": {"name": "async-sizes", "seed": 3},
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 16, "max_iterations": 1000, "finish_timeout_s": 5},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "mode": {"sync": "asp"},
        "cluster": {"num_shards": 2, "num_workers": 1},   # starts with the first member
        "evaluator": {"enabled": False},
    })
    run = tmp_path / "run"
    eps = start_servers(procs, cfg_path, 2, run)
    # Two hand-driven members, so that commits happen exactly when the test says.
    with joined_member(cfg, eps[0], name="honest") as b, joined_member(cfg, eps[0], name="odd") as m:
        me, wid, token, a = m.client, m.worker_id, m.token, m.assignment
        assert a is not None and a.batch_size >= 2

        def push(k: int, x: int) -> None:
            lo, hi = me.ranges[k]
            me.conns[k].send(P.Push(worker_id=wid, token=token, iteration=a.iteration, batch_size=x,
                                    loss=0.0, pull=False, arrays=[np.zeros(hi - lo, np.float32)]))

        push(1, a.batch_size - 1)     # held by the follower and reported: never assigned, drop queued
        time.sleep(0.5)
        push(0, a.batch_size)   # the assigned size, held by shard 0
        time.sleep(0.5)
        # The honest member's commit (version 1) carries the drop to both shards.
        res = b.client.push_pull(np.zeros_like(b.params), b.params, worker_id=b.worker_id,
                                 assignment=b.assignment, loss=0.0, telemetry={})
        assert res.version >= 1
        push(1, a.batch_size)         # the follower's copy was dropped: this one is held
        wait_version(eps[0], 2, timeout_s=30)   # and completes the odd member's gradient
    operator_request(eps[0], P.Shutdown(reason="the test is done"), P.Ack)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    params, version = consistent_end(run, 2)   # both shards: the same version and history
    assert version == 2
    recs = list(read_jsonl(run / "metrics" / "coordinator.jsonl"))
    (counters,) = [r["counters"] for r in recs if r.get("event") == "counters"]
    assert counters.get("have.unexpected", 0) == 1, counters
    mine = [r for r in recs if "event" not in r and str(wid) in r["batch_sizes"]]
    assert [r["batch_sizes"][str(wid)] for r in mine] == [a.batch_size], "applied once, at its size"
