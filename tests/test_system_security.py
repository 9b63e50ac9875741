"""CURVE end to end: an allow-listed worker trains; a client without an allowed key cannot join,
push or pull, and a plain (unencrypted) client gets nowhere either."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.security import generate_keypair, init_local_keys
from ps_common.transport import Connection, TransportTimeout
from tests.cluster_util import start_servers, start_workers, wait_exit, write_config

pytestmark = pytest.mark.system


def test_curve_allows_listed_clients_only(procs, tmp_path):
    sec = init_local_keys(tmp_path / "keys")
    job = {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 32, "max_iterations": 30}, "cluster": {"num_shards": 2, "num_workers": 1},
        "evaluator": {"enabled": False}, "security": sec.model_dump(),
    }
    cfg_path, cfg = write_config(tmp_path, job)
    eps = start_servers(procs, cfg_path, 2, tmp_path / "run")
    wait_exit(start_workers(procs, cfg_path, eps[0], 1, tmp_path / "run"), timeout_s=120)

    ctx = zmq.Context.instance()
    # A stranger: a valid key pair that is not in the allow-list.
    _, stranger_secret = generate_keypair(tmp_path / "stranger", "stranger")
    stranger = sec.model_copy(update={"client_secret_key": str(stranger_secret)})
    for ep in eps:
        for who, security in (("stranger", stranger), ("plain", None)):
            conn = Connection(ctx, ep, timeout_s=1.5, security=security)
            try:
                for msg in (P.Join(name=who, job_digest=cfg.job_digest()), P.Pull(worker_id=0, min_version=0),
                            P.Push(worker_id=0, arrays=[np.zeros(4, np.float32)]), P.StatusRequest()):
                    with pytest.raises(TransportTimeout):
                        conn.request(msg, P.Message)
            finally:
                conn.close()
    # The allowed key still works against the same servers.
    ok = Connection(ctx, eps[0], timeout_s=10, security=sec)
    try:
        st = ok.request(P.StatusRequest(), P.Status)
        assert st.stop and st.version == 30
    finally:
        ok.close()
