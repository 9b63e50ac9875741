"""The dmlc environment contract: a job started the way dmlc-submit starts ps-lite jobs.

Every process gets the same command line and its role in ``DMLC_ROLE``; nothing else says which
shard it is or where shard 0 listens. The scheduler is shard 0, the two servers claim follower
indices from it, and the workers join through the scheduler's address, one of them through
``ps-server`` itself (``DMLC_ROLE=worker`` runs a worker).
"""

from __future__ import annotations

import re

import pytest

from ps_common.dmlc import read_dmlc_env
from tests.cluster_util import consistent_end, wait_exit, write_config

pytestmark = pytest.mark.system


def _claims_are_by_name_and_by_shards_only(cfg, root: str, indices: dict[str, int]) -> None:
    """Well-formed ClaimShard messages to the real scheduler: a shard credential naming a live
    server gets that server's index (what the server gets back when it restarts under its
    name); a new name finds no free index; a worker's credential may not claim at all."""
    import zmq

    from ps_common import protocol as P
    from ps_common.transport import Connection, RemoteError

    def claim(role: str, name: str) -> int:
        conn = Connection(zmq.Context.instance(), root, role=role, security=cfg.security, timeout_s=10)
        try:
            reply = conn.request(P.ClaimShard(job_digest=cfg.job_digest(), instance=name), P.ShardClaimed)
        finally:
            conn.close()
        assert isinstance(reply, P.ShardClaimed)
        return reply.shard

    for name, k in indices.items():
        assert claim("shard", name) == k
    with pytest.raises(RemoteError) as no_room:
        claim("shard", "server-new")
    assert no_room.value.code == "no_free_shard"
    with pytest.raises(RemoteError) as forged:
        claim("worker", "server-0")
    assert forged.value.code == "forbidden"


def dmlc(role: str, port: int) -> dict[str, str]:
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2"}


@pytest.mark.timeout(240)
def test_a_job_started_from_dmlc_variables_alone(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 64, "max_iterations": 25, "finish_timeout_s": 10},
        "cluster": {"num_shards": 1, "num_workers": 1},          # the contract's numbers win
        "evaluator": {"enabled": False}})
    run_dir = tmp_path / "run"
    common = ["--config", str(cfg_path), "--run-dir", str(run_dir)]
    # The scheduler binds DMLC_PS_ROOT_PORT; 0 lets the test take a free one and tell the rest.
    scheduler = procs.start("scheduler", "ps_server.cli", common, env=dmlc("scheduler", 0))
    root = procs.wait_endpoint(scheduler, 60)
    port = int(re.search(r":(\d+)$", root).group(1))
    servers = [procs.start(f"server-{i}", "ps_server.cli", [*common, "--name", f"server-{i}"],
                           env=dmlc("server", port)) for i in range(2)]
    indices = {f"server-{i}": int(re.search(r"shard (\d+) listening", (procs.wait_endpoint(ch, 60), ch.tail())[1])
                                      .group(1)) for i, ch in enumerate(servers)}
    job = cfg.with_overrides(read_dmlc_env(dmlc("server", port)).overrides())  # the contract's numbers
    _claims_are_by_name_and_by_shards_only(job, root, indices)
    workers = [procs.start("worker-a", "ps_server.cli", common, env=dmlc("worker", port)),
               procs.start("worker-b", "ps_worker.cli", common, env=dmlc("worker", port))]
    wait_exit(workers, timeout_s=180)
    wait_exit([scheduler, *servers], timeout_s=60)
    for ch in [scheduler, *servers, *workers]:
        assert ch.proc.returncode == 0, ch.tail()
    assert sorted(indices.values()) == [1, 2], "each server claimed its own follower index"
    params, version = consistent_end(run_dir, 3)                # DMLC_NUM_SERVER + 1 shards
    assert version == 25 and params.size > 0
