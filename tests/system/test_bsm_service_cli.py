"""``ps-bsm`` as its own process: it prints the endpoint it bound, serves clients, and stops
cleanly on SIGTERM. (The service in a thread, its errors and CURVE: tests/integration/test_bsm_service.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from ps_server.bsm_client import BatchSizeClient
from tests.integration.test_bsm_service import X, run_iterations


@pytest.mark.timeout(30)
def test_cli_serves_and_stops_on_sigterm(procs):
    child = procs.start("ps-bsm", "ps_server.bsm_service",
                        ["--policy", "lbbsp-cpu", "--global-batch", str(X),
                         "--policy-args", '{"predictor": "ema"}', "--port", "0"])
    endpoint = procs.wait_endpoint(child, 15)
    assert endpoint.startswith("tcp://127.0.0.1:")
    with BatchSizeClient(endpoint, timeout_s=5) as c:
        for w in range(3):
            c.join(w)
        sizes = run_iterations(c, 4)
        assert sorted(sizes) == [0, 1, 2] and sum(sizes.values()) == X
        assert sizes[2] < sizes[0] and sizes[2] < sizes[1]
    os.killpg(child.proc.pid, signal.SIGTERM)
    assert child.proc.wait(timeout=5) == 0, child.tail()
    assert "ps-bsm stopping" in child.tail(), child.tail()
