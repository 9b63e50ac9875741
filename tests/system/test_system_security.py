"""CURVE end to end: allow-listed keys train, each with the role its file name grants; a client
without an allowed key, and a plain (unencrypted) one, cannot join, push, pull or ask for
status; a worker's key cannot stop the job."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.security.keys import generate_keypair
from ps_common.security.settings import init_local_keys
from ps_common.transport import AuthenticationFailed, Connection, RemoteError, TransportTimeout
from tests.cluster_util import consistent_end, start_job, wait_exit, write_config

pytestmark = pytest.mark.system


def test_curve_allows_listed_clients_only(procs, tmp_path):
    sec = init_local_keys(tmp_path / "keys")
    job = {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 32, "max_seconds": 120, "finish_timeout_s": 5},
        "cluster": {"num_shards": 2, "num_workers": 1},
        "evaluator": {"enabled": False}, "security": sec.model_dump(),
    }
    cfg_path, cfg = write_config(tmp_path, job)
    run = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 1, run)

    ctx = zmq.Context.instance()
    ok = Connection(ctx, eps[0], role="operator", timeout_s=10, security=sec)
    try:
        deadline = time.monotonic() + 60
        while not ok.request(P.StatusRequest(), P.Status).started:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # A stranger (a valid key pair, not allowed) and a plain client get nowhere; the
        # stranger learns it at once.
        _, stranger_secret = generate_keypair(tmp_path / "stranger", "worker-stranger")
        stranger = sec.model_copy(update={"client_secret_key": str(stranger_secret)})
        conn = Connection(ctx, eps[0], role="worker", timeout_s=5, security=stranger)
        with pytest.raises(AuthenticationFailed, match="refused the worker credentials"):
            conn.request(P.StatusRequest(), P.Status)
        conn.close()
        for ep in eps:
            for security in (stranger, None):
                # a shard answers an allowed client on loopback within milliseconds: 0.4 s of
                # silence per request is a refusal (16 requests; 1 s each made this test 20 s)
                conn = Connection(ctx, ep, role="worker", timeout_s=0.4, security=security)
                try:
                    for msg in (P.Join(name="x", job_digest=cfg.job_digest()), P.Pull(min_version=0),
                                P.Push(worker_id=0, arrays=[np.zeros(4, np.float32)]), P.StatusRequest()):
                        with pytest.raises(TransportTimeout):
                            conn.request(msg, P.Message)
                finally:
                    conn.close()
        # An allowed worker key is a worker: it may not stop the job.
        as_worker = Connection(ctx, eps[0], role="worker", timeout_s=10, security=sec)
        with pytest.raises(RemoteError) as exc:
            as_worker.request(P.Shutdown(reason="not yours"), P.Ack)
        assert exc.value.code == "forbidden"
        as_worker.close()
        st = ok.request(P.StatusRequest(), P.Status)
        assert not st.stop and st.version > 0
        # The operator's key may end the job: every shard then ends at one final version.
        ok.request(P.Shutdown(reason="test over"), P.Ack)
    finally:
        ok.close()
    wait_exit(workers, timeout_s=120)
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    _, version = consistent_end(run, 2)
    assert version > 0
