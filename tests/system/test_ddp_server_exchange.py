"""DDP ranks exchanging their gradients through a real ``ps-bsm --world-size N`` process.

The claim: with ``DDPBatchBalancer(exchange="servers")`` the buckets never meet an all-reduce,
the service's policy moves the split, and the run is still exactly single-process SGD with the
global batch. Then well-formed forgeries against the real service, a rank that never sends
(the others are told, not hung), the operator role refused under CURVE, and the example script.
(The rule message by message: tests/unit/test_exchange.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zmq
from torch.nn.parallel import DistributedDataParallel

from batchsize_manager.integrations.torch_ddp import DDPBatchBalancer, LBBSPSampler
from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_common.transport import Connection, RemoteError
from ps_ml.datasets import load_dataset
from ps_ml.reference import flat_parameters, global_batch_indices, train_reference
from tests.integration.test_bsm_service import curve_service
from tests.system.test_ddp_plugin import (
    DATA_SEED,
    LR,
    MODEL_SEED,
    MOMENTUM,
    N_TRAIN,
    ROOT,
    X,
    _free_port,
    _init,
    _model,
    _spawn,
    run_example,
)

STEPS = 8
PER_SAMPLE_S = [1e-3, 3e-3, 1e-3]   # rank 1 reports itself 3x slower per sample


def _start_service(procs, world: int, *extra: str) -> str:
    child = procs.start("ps-bsm", "ps_server.bsm_service",
                        ["--world-size", str(world), "--policy", "lbbsp-cpu", "--global-batch", str(X),
                         "--policy-args", '{"predictor": "last"}', "--port", "0", *extra])
    return procs.wait_endpoint(child, 15)


def _rank_main(rank: int, world: int, port: int, endpoint: str, out_dir: str) -> None:
    _init(rank, world, port)
    out: dict[str, Any] = {}
    try:
        data = load_dataset("synthetic", seed=DATA_SEED, synthetic_train=N_TRAIN, synthetic_test=8)
        sampler = LBBSPSampler(data.num_train, X, seed=DATA_SEED)
        bal = DDPBatchBalancer(X, exchange="servers", endpoint=endpoint, timeout_s=20)
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.05, find_unused_parameters=True)
        bal.register_hook(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        sizes, used, buckets, reports = [], [], [], []
        for _ in range(STEPS):
            sizes.append([bal.sizes[r] for r in range(world)])
            idx = bal.batch_indices(sampler)
            used.append(idx)
            xb, yb = data.train_batch(idx)
            sent = bal.server.buckets_sent
            bal.report(compute_s=bal.my_batch_size * PER_SAMPLE_S[rank],
                       telemetry=Telemetry(host_cpu=float(rank)))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(xb), yb).backward()
            buckets.append(bal.server.buckets_sent - sent)
            opt.step()
            bal.step()
            reports.append([(r.worker_id, r.batch_size, r.telemetry.compute_s, r.telemetry.host_cpu)
                            for r in bal.last_reports])
        out.update(params=flat_parameters(ddp.module), sizes=sizes, used=used, buckets=buckets,
                   reports=reports)
        if rank == 0:
            out["reference"] = train_reference("mlp", MODEL_SEED, data, DATA_SEED, X, STEPS,
                                               lr=LR, momentum=MOMENTUM)
        bal.close()
        dist.barrier()
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddp_through_the_service_equals_single_process_sgd(procs, tmp_path):
    world = 3
    endpoint = _start_service(procs, world)
    _spawn(_rank_main, world, (world, _free_port(), endpoint, str(tmp_path)), timeout_s=90)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in range(world):
        np.testing.assert_array_equal(res[r]["params"], res[0]["params"])  # same bytes everywhere
        np.testing.assert_allclose(res[r]["params"], res[0]["reference"], rtol=1e-4, atol=2e-6)
        assert res[r]["sizes"] == res[0]["sizes"] and min(res[r]["buckets"]) > 1
        assert res[r]["reports"] == res[0]["reports"]
    sizes = res[0]["sizes"]
    assert all(sum(s) == X for s in sizes)
    assert sizes[0] == [22, 21, 21]                      # cold start: uniform
    assert sizes[-1][1] < sizes[-1][0] / 2               # then the slow rank gets less
    for t in range(STEPS):  # the ranks' slices, in rank order, are the global batch
        got = np.concatenate([res[r]["used"][t] for r in range(world)])
        np.testing.assert_array_equal(got, global_batch_indices(DATA_SEED, N_TRAIN, X, t))
    last = res[0]["reports"][-1]
    assert [(w, b, h) for w, b, _, h in last] == [(r, sizes[-1][r], float(r)) for r in range(world)]
    assert [c for _, _, c, _ in last] == pytest.approx([sizes[-1][r] * PER_SAMPLE_S[r] for r in range(world)])


def _dying_rank_main(rank: int, world: int, port: int, endpoint: str, out_dir: str) -> None:
    """Rank 1 dies between iterations 2 and 3; rank 0 must be told, not hang."""
    _init(rank, world, port)
    out: dict[str, Any] = {"completed": 0, "error": None}
    try:
        data = load_dataset("synthetic", seed=DATA_SEED, synthetic_train=N_TRAIN, synthetic_test=8)
        sampler = LBBSPSampler(data.num_train, X, seed=DATA_SEED)
        bal = DDPBatchBalancer(X, exchange="servers", endpoint=endpoint, timeout_s=20)
        ddp = DistributedDataParallel(_model())
        bal.register_hook(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        t0 = time.monotonic()
        for it in range(6):
            if rank == 1 and it == 3:
                os._exit(0)  # gone without a word, like a SIGKILL between two iterations
            xb, yb = data.train_batch(bal.batch_indices(sampler))
            opt.zero_grad(set_to_none=True)
            t0 = time.monotonic()
            F.cross_entropy(ddp(xb), yb).backward()
            opt.step()
            bal.step()
            out["completed"] += 1
    except Exception as exc:  # noqa: BLE001 - what rank 0 saw is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["waited_s"] = time.monotonic() - t0
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        os._exit(0)  # the process group lost a member: skip its teardown


@pytest.mark.timeout(90)
def test_a_rank_that_dies_fails_the_others_iteration_instead_of_hanging(procs, tmp_path):
    endpoint = _start_service(procs, 2, "--stale-s", "2")
    _spawn(_dying_rank_main, 2, (2, _free_port(), endpoint, str(tmp_path)), timeout_s=60)
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert out["completed"] == 3, out
    assert out["error"] is not None and "abandoned" in out["error"] and "ranks [1]" in out["error"], out
    assert 1.5 < out["waited_s"] < 15, out   # the service's --stale-s, not the rank's 20 s timeout


def _push(conn: Connection, rank: int, token: str, grad: np.ndarray, *, iteration: int = 0,
          batch_size: int, bucket: int = 0) -> None:
    conn.send(P.ExchangePush(worker_id=rank, token=token, iteration=iteration, bucket=bucket, last=True,
                             batch_size=batch_size, telemetry=Telemetry(compute_s=0.01), arrays=[grad]))


def _refused(conn: Connection) -> str:
    with pytest.raises(RemoteError) as err:
        conn.recv(timeout_s=5)
    return err.value.code


@pytest.mark.timeout(60)
def test_forged_exchange_messages_against_the_real_service(procs):
    endpoint = _start_service(procs, 2, "--stale-s", "1")
    ctx = zmq.Context.instance()
    a, b, forger = (Connection(ctx, endpoint, role="worker", timeout_s=5) for _ in range(3))
    try:
        plan_a = a.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan)
        plan_b = b.request(P.ExchangeOpen(worker_id=1, iteration=0), P.ExchangePlan)
        assert plan_a.batch_sizes == plan_b.batch_sizes == [32, 32]
        g = np.ones(4, np.float32)
        # Well-formed pushes without the rank's token or for another iteration: refused to the
        # sender, nothing changes.
        for kwargs, code in [
            (dict(rank=1, token="f" * 32, batch_size=32), "unauthorized"),          # no token
            (dict(rank=1, token=plan_a.token, batch_size=32), "unauthorized"),      # another's
            (dict(rank=1, token=plan_b.token, batch_size=32, iteration=1), "not_planned"),
            (dict(rank=5, token=plan_b.token, batch_size=32), "unknown_worker"),
        ]:
            _push(forger, grad=g, **kwargs)
            assert _refused(forger) == code, kwargs
        forger.send(P.BsmJoin(worker_id=3))          # membership is the fixed world
        assert _refused(forger) == "not_supported"
        # A push with the rank's token that breaks the rule fails the iteration for every rank at
        # once: a second copy, a size other than planned (here from a forger holding rank 1's
        # token: it can make the job fail loudly, never have its gradient summed), a NaN.
        _push(a, 0, plan_a.token, g, batch_size=32)
        _push(a, 0, plan_a.token, g, batch_size=32)
        assert [_refused(a), _refused(a)] == ["duplicate", "iteration_failed"]
        _push(b, 1, plan_b.token, g, batch_size=32)
        assert _refused(b) == "iteration_failed"
        for bad, code in [(dict(grad=g, batch_size=33), "bad_batch"),
                          (dict(grad=np.full(4, np.nan, np.float32), batch_size=32), "non_finite")]:
            plan_a = a.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan)
            plan_b = b.request(P.ExchangeOpen(worker_id=1, iteration=0), P.ExchangePlan)
            _push(a, 0, plan_a.token, g, batch_size=32)
            _push(forger, 1, plan_b.token, **bad)
            assert _refused(forger) == code
            assert _refused(a) == "iteration_failed"
        # A restart opens iteration 0 again; rank 1 never sends: rank 0 is told, not hung.
        plan_a = a.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan)
        _push(a, 0, plan_a.token, g, batch_size=32)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            a.recv(timeout_s=10)
        assert err.value.code == "iteration_failed" and "abandoned" in str(err.value)
        assert time.monotonic() - t0 < 5
        # And then a whole iteration goes through: the weighted mean, the next split.
        plan_a = a.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan)
        plan_b = b.request(P.ExchangeOpen(worker_id=1, iteration=0), P.ExchangePlan)
        _push(a, 0, plan_a.token, np.full(4, 1.0, np.float32), batch_size=32)
        _push(b, 1, plan_b.token, np.full(4, 3.0, np.float32), batch_size=32)
        for conn in (a, b):
            res = conn.recv(timeout_s=5)
            assert isinstance(res, P.ExchangeResult) and res.next_batch_sizes == [32, 32]
            np.testing.assert_array_equal(res.arrays[0], np.full(4, 2.0, np.float32))
        # torchrun restarts every rank seconds after a crash: rank 0 of the dead incarnation has
        # iteration 1's bucket in when the new ranks open iteration 0. The open iteration is
        # abandoned at once (not after --stale-s), and the new ranks exchange from scratch.
        _push(a, 0, plan_a.token, np.full(4, 100.0, np.float32), iteration=1, batch_size=32)
        a2, b2 = (Connection(ctx, endpoint, role="worker", timeout_s=5) for _ in range(2))
        try:
            new_a = a2.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan)
            with pytest.raises(RemoteError) as err:
                a.recv(timeout_s=5)
            assert err.value.code == "iteration_failed" and "restarted job" in str(err.value)
            new_b = b2.request(P.ExchangeOpen(worker_id=1, iteration=0), P.ExchangePlan)
            x0, x1 = new_b.batch_sizes
            _push(a2, 0, new_a.token, np.full(4, 1.0, np.float32), batch_size=x0)
            _push(b2, 1, new_b.token, np.full(4, 5.0, np.float32), batch_size=x1)
            want = np.float32((x0 * 1.0 + x1 * 5.0) / (x0 + x1))    # the dead rank's 100s nowhere
            for conn in (a2, b2):
                res = conn.recv(timeout_s=5)
                np.testing.assert_allclose(res.arrays[0], np.full(4, want, np.float32), rtol=1e-6)
            # Jobs that name themselves (the DDP balancer's rank 0 draws the id): job "j1"'s rank
            # 0 has a bucket in when a forger with the worker credential opens as rank 1 under
            # job "j2". Rank 1 has not opened in j1, so only the job id tells a restart from
            # j1's own rank 1 coming late: j1's iteration is abandoned, its token void, and
            # nothing it sent is summed with what j2's ranks send.
            j1 = a2.request(P.ExchangeOpen(worker_id=0, iteration=1, job="j1"), P.ExchangePlan)
            _push(a2, 0, j1.token, np.full(4, 100.0, np.float32), iteration=1, batch_size=j1.batch_sizes[0])
            j2 = forger.request(P.ExchangeOpen(worker_id=1, iteration=1, job="j2"), P.ExchangePlan)
            with pytest.raises(RemoteError) as err:
                a2.recv(timeout_s=5)
            assert err.value.code == "iteration_failed"
            _push(a2, 0, j1.token, np.full(4, 100.0, np.float32), iteration=1, batch_size=j1.batch_sizes[0])
            assert _refused(a2) == "unauthorized", "the old job's token is void"
            j2a = a.request(P.ExchangeOpen(worker_id=0, iteration=1, job="j2"), P.ExchangePlan)
            z0, z1 = j2a.batch_sizes
            _push(a, 0, j2a.token, np.full(4, 2.0, np.float32), iteration=1, batch_size=z0)
            _push(forger, 1, j2.token, np.full(4, 4.0, np.float32), iteration=1, batch_size=z1)
            want = np.float32((z0 * 2.0 + z1 * 4.0) / (z0 + z1))
            for conn in (a, forger):
                res = conn.recv(timeout_s=5)
                np.testing.assert_allclose(res.arrays[0], np.full(4, want, np.float32), rtol=1e-6)
        finally:
            a2.close()
            b2.close()
    finally:
        for c in (a, b, forger):
            c.close()


@pytest.mark.timeout(20)
def test_under_curve_only_workers_may_exchange(tmp_path):
    with curve_service(tmp_path / "keys", world_size=2) as (svc, sec, ctx):
        op = Connection(ctx, svc.endpoint, role="operator", timeout_s=5, security=sec)
        worker = Connection(ctx, svc.endpoint, role="worker", timeout_s=5, security=sec)
        try:
            op.send(P.ExchangeOpen(worker_id=0, iteration=0))
            assert _refused(op) == "forbidden"
            assert worker.request(P.ExchangeOpen(worker_id=0, iteration=0), P.ExchangePlan).batch_sizes == [256, 256]
            assert op.request(P.BsmStats(), P.BsmStatsReply).requests == 3
        finally:
            op.close()
            worker.close()


def test_example_script_exchanges_through_a_service_it_starts():
    output = run_example("--nproc", "2", "--exchange", "servers", "--policy", "fixed", "--weights", "1,3",
                         "--iterations", "4", "--print-every", "2", "--global-batch", "32", "--model", "mlp")
    assert "exchange through tcp://" in output and "final sizes [8, 24]" in output, output
    assert "4 iterations completed, 0 failed" in output, output


def test_example_script_plain_ddp_baseline():
    """``--exchange plain``: DDP without the plug-in (the benchmarks' baseline), rows at the end."""
    output = run_example("--nproc", "2", "--exchange", "plain", "--iterations", "4", "--print-every", "2",
                         "--global-batch", "33", "--model", "mlp")
    assert "even split [17, 16]" in output and output.count("tick ") == 3, output
    rows = [line for line in output.splitlines() if line.startswith("it ")]
    assert len(rows) == 3 and all("compute ms [" in r and r.count(",") >= 1 for r in rows), output
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "ddp_lbbsp.py"), "--nproc", "2",
                          "--exchange", "plain", "--policy", "lbbsp-cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--exchange plain is DDP without the plug-in" in bad.stderr


def test_the_service_does_not_import_torch():
    """ps-bsm serves frameworks that may not have torch; its exchange sums with numpy."""
    code = "import sys, ps_server.bsm_service; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)
