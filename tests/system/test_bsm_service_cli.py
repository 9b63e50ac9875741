"""``ps-bsm`` as its own process: it prints the endpoint it bound, serves clients, and stops
cleanly on SIGTERM. (The service in a thread, its errors and CURVE: tests/integration/test_bsm_service.py.)"""

from __future__ import annotations

import os
import random
import signal

import pytest

from ps_common.report import Telemetry
from ps_server.bsm_client import BatchSizeClient, RemoteError
from tests.integration.test_bsm_service import X, run_iterations
from tests.report_util import edge_report


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


def _refused(code: str, call, *args, **kw) -> None:
    with pytest.raises(RemoteError) as e:
        call(*args, **kw)
    assert e.value.code == code, (call, args, kw, e.value)


@pytest.mark.timeout(30)
def test_tokens_keep_foreign_and_stale_clients_out(procs):
    """Clients choose worker ids, so a join's token proves the worker: a client that did not
    join an id, or whose join a restart under that id has voided, changes nothing."""
    child = procs.start("ps-bsm", "ps_server.bsm_service",
                        ["--policy", "lbbsp-cpu", "--global-batch", str(X),
                         "--policy-args", '{"predictor": "ema"}', "--port", "0"])
    endpoint = procs.wait_endpoint(child, 15)
    tel = Telemetry(compute_s=0.1, iteration_s=0.12)
    with BatchSizeClient(endpoint, timeout_s=5) as first, BatchSizeClient(endpoint, timeout_s=5) as forger, \
            BatchSizeClient(endpoint, timeout_s=5) as restarted:
        first.join(0)
        first.join(1)
        _refused("bad_token", forger.report, 0, 0, 64, tel)                      # no token
        _refused("bad_token", forger.report, 0, 0, 64, tel, token=first.tokens[1])  # another's
        _refused("bad_token", forger.report, 0, 0, 64, tel, token="0" * 32)
        _refused("bad_token", forger.leave, 1)
        st = first.stats()
        assert st["live"] == [0, 1] and st["reports"] == 0
        first.report(0, 0, 64, tel)
        first.report(1, 0, 64, tel)

        restarted.join(0)                  # worker 0's process came back: the old token is void
        _refused("bad_token", first.report, 0, 1, 64, tel)
        _refused("bad_token", first.leave, 0)
        restarted.report(0, 1, 64, tel)
        first.report(1, 1, 64, tel)        # worker 1 is untouched
        st = first.stats()
        assert st["live"] == [0, 1] and st["reports"] == 4 and st["rejoins"] == 1

        restarted.leave(0)
        _refused("unknown_worker", first.report, 0, 2, 64, tel)
        assert first.assign() == {1: X}
    os.killpg(child.proc.pid, signal.SIGTERM)
    assert child.proc.wait(timeout=5) == 0, child.tail()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy,args", [("lbbsp-gpu", "{}"), ("lbbsp-cpu", '{"predictor": "ema"}')])
def test_reports_at_the_edges_of_their_ranges_do_not_stop_the_service(procs, policy, args):
    """Whatever a worker may send within the wire's checks (0, the smallest float, the upper
    bound, None), ps-bsm keeps answering with valid splits of X, 40 workers read as rows.
    (A headroom of 1e9 MiB over 5e-324 MiB per sample overflowed the memory cap's estimate
    before it was bounded: every assign was then refused with an internal error.)"""
    n, x_total = 40, 40 * 64
    child = procs.start("ps-bsm", "ps_server.bsm_service",
                        ["--policy", policy, "--global-batch", str(x_total), "--policy-args", args, "--port", "0"])
    endpoint = procs.wait_endpoint(child, 15)
    rng = random.Random(7)
    with BatchSizeClient(endpoint, timeout_s=10) as c:
        for w in range(n):
            c.join(w)
        for it in range(12):
            sizes = c.assign()
            assert sorted(sizes) == list(range(n)), (it, sizes)
            assert sum(sizes.values()) == x_total and min(sizes.values()) >= 1, (it, sizes)
            for w, x in sizes.items():
                c.report(w, it, x, edge_report(rng, w, it, x).telemetry)
        sizes = c.assign()
        assert sum(sizes.values()) == x_total
        st = c.stats()
        assert st["reports"] == 12 * n and st["ignored_reports"] == 0 and st["decisions"] == 13
    assert child.proc.poll() is None, child.tail()
    os.killpg(child.proc.pid, signal.SIGTERM)
    assert child.proc.wait(timeout=5) == 0, child.tail()
