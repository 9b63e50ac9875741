"""The PyTorch DDP plug-in: weighted hook, one-global-order sampler, balancer, example script.

The core claim: DDP + ``weighted_allreduce_hook`` + ``LBBSPSampler`` with uneven, changing
per-rank batch sizes gives exactly the updates of single-process SGD with the global batch,
while DDP's default hook (mean over ranks) does not. Checked with 2 and 3 gloo ranks on CPU,
spawned once per world size (the rank bodies do all checks and save what they saw).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from batchsize_manager.allocation import proportional_split
from batchsize_manager.integrations.torch_ddp import (
    DDPBatchBalancer,
    LBBSPSampler,
    WeightedHookState,
    weighted_allreduce_hook,
)
from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.policies import BatchPolicy
from ps_common.report import Telemetry
from ps_ml.datasets import load_dataset
from ps_ml.models import build_model
from ps_ml.reference import flat_parameters, global_batch_indices, train_reference

ROOT = Path(__file__).resolve().parents[2]
X = 64
N_TRAIN = 200  # X does not divide it: global batches straddle epochs
DATA_SEED = 5
MODEL_SEED = 1
LR, MOMENTUM = 0.1, 0.9
SGD_STEPS = 6
UNEVEN = {2: [13, 51], 3: [5, 17, 42]}
# Sizes change every iteration (incl. one rank getting a single sample).
SCHEDULE = {
    2: [[13, 51], [40, 24], [1, 63], [32, 32], [50, 14], [7, 57], [30, 34]],
    3: [[5, 17, 42], [30, 4, 30], [1, 1, 62], [21, 22, 21], [40, 20, 4], [9, 50, 5], [2, 60, 2]],
}
SPAWN_TIMEOUT_S = 45.0


# --------------------------------------------------------------------------------------------
# Process plumbing
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, world: int, args: tuple, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """Run ``fn(rank, *args)`` in ``world`` forked processes; kill them all on timeout.

    Forked, not spawned: re-importing torch in every child costs seconds on a loaded machine.
    The parent has not initialised torch.distributed, and each child uses one torch thread.
    """
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))


class _Scripted(BatchPolicy):
    """Returns the next size list of a fixed schedule on every ``assign``."""

    def __init__(self, schedule: Sequence[Sequence[int]]) -> None:
        self.schedule = [list(s) for s in schedule]
        self.calls = 0
        self.observed: list[tuple[int, int, int]] = []

    def observe(self, report: Any) -> None:
        self.observed.append((report.iteration, report.worker_id, report.batch_size))

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: Any = None) -> dict[int, int]:
        sizes = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        return dict(zip(sorted(workers), sizes))


class _FailsSecondTime(BatchPolicy):
    def __init__(self) -> None:
        self.calls = 0

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: Any = None) -> dict[int, int]:
        self.calls += 1
        if self.calls > 1:
            raise ZeroDivisionError("policy exploded")
        return proportional_split({w: 1.0 for w in workers}, global_batch, min_batch)


def _flat_grad(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()


def _model() -> torch.nn.Module:
    return build_model("mlp", seed=MODEL_SEED, num_classes=10)


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Everything the multi-rank tests check, in one process-group lifetime."""
    _init(rank, world, port)
    out: dict[str, Any] = {}
    try:
        data = load_dataset("synthetic", seed=DATA_SEED, synthetic_train=N_TRAIN, synthetic_test=8)
        sampler = LBBSPSampler(data.num_train, X, seed=DATA_SEED)

        # (a) one gradient with uneven sizes: weighted hook (three modes) vs DDP's default.
        sizes = UNEVEN[world]
        x, y = data.train_batch(sampler.rank_indices(0, sizes, rank))
        for name, state in [
            ("known", WeightedHookState(sizes[rank], global_batch=X)),
            ("summed", WeightedHookState(sizes[rank], global_batch=None)),
            ("verified", WeightedHookState(sizes[rank], global_batch=X, verify=True)),
            ("default", None),
        ]:
            ddp = DistributedDataParallel(_model())
            if state is not None:
                ddp.register_comm_hook(state, weighted_allreduce_hook)
            F.cross_entropy(ddp(x), y).backward()
            out[f"grad_{name}"] = _flat_grad(ddp.module)
        if rank == 0:
            ref = _model()
            gx, gy = data.train_batch(global_batch_indices(DATA_SEED, N_TRAIN, X, 0))
            F.cross_entropy(ref(gx), gy).backward()
            out["grad_reference"] = _flat_grad(ref)

        # The verify mode catches ranks that disagree on the sizes.
        bad = WeightedHookState(sizes[rank] + (1 if rank == 0 else 0), global_batch=X, verify=True)
        ddp = DistributedDataParallel(_model())
        ddp.register_comm_hook(bad, weighted_allreduce_hook)
        try:
            F.cross_entropy(ddp(x), y).backward()
            out["verify_error"] = None
        except RuntimeError as exc:
            out["verify_error"] = str(exc)

        # (b) SGD with sizes changing every iteration, through the balancer, small buckets.
        policy = _Scripted(SCHEDULE[world])
        bal = DDPBatchBalancer(X, policy)
        # find_unused_parameters keeps the small buckets every iteration (several hook calls).
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.05, find_unused_parameters=True)
        bal.register_hook(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        used, history, hooks = [], [], []
        for _ in range(SGD_STEPS):
            history.append(bal.sizes)
            idx = bal.batch_indices(sampler)
            used.append(idx)
            assert len(idx) == bal.my_batch_size == bal.hook_state.batch_size
            xb, yb = data.train_batch(idx)
            calls = bal.hook_state.hook_calls
            with bal.timed_compute():
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(xb), yb).backward()
            hooks.append(bal.hook_state.hook_calls - calls)
            opt.step()
            bal.step()
        out.update(sgd_params=flat_parameters(ddp.module), sgd_sizes=history, sgd_indices=used,
                   sgd_buckets=hooks, sgd_reports=[(r.worker_id, r.iteration, r.batch_size, r.telemetry.compute_s)
                                                   for r in bal.last_reports],
                   sgd_finish=[(r.telemetry.compute_s, r.telemetry.finish_s) for r in bal.last_reports])
        if rank == 0:
            out["sgd_observed"] = list(policy.observed)
        # With fused reports (the default on CPU) a report after the backward is refused: its
        # row already left with the last bucket.
        xb, yb = data.train_batch(bal.batch_indices(sampler))
        with bal.timed_compute():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(xb), yb).backward()
        try:
            bal.report(compute_s=1.0)
            out["late_report_error"] = None
        except RuntimeError as exc:
            out["late_report_error"] = str(exc)
        bal.step()  # every rank, so the collectives stay in step
        out["fused"] = bal.fused
        out["fused_reports"] = [(r.worker_id, r.telemetry.compute_s, r.telemetry.finish_s) for r in bal.last_reports]
        # The same run with the reports gathered on their own (exchange="separate").
        bal = DDPBatchBalancer(X, _Scripted(SCHEDULE[world]), exchange="separate")
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.05, find_unused_parameters=True)
        bal.register_hook(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        for _ in range(SGD_STEPS):
            xb, yb = data.train_batch(bal.batch_indices(sampler))
            with bal.timed_compute():
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(xb), yb).backward()
            opt.step()
            bal.step()
        out["separate_params"] = flat_parameters(ddp.module)
        out["separate_reports"] = [(r.worker_id, r.telemetry.compute_s) for r in bal.last_reports]
        out["separate_cpu"] = [(r.telemetry.cpu_s, r.telemetry.compute_cpu_s) for r in bal.last_reports]
        if rank == 0:
            out["sgd_reference"] = train_reference("mlp", MODEL_SEED, data, DATA_SEED, X, SGD_STEPS,
                                                   lr=LR, momentum=MOMENTUM)

        # (d) the "fixed" policy by name; reported timings reach every rank; sums stay X.
        bal = DDPBatchBalancer(X, "fixed", {"weights": [1, 3]})
        fixed = [bal.sizes]
        for _ in range(3):
            bal.report(compute_s=0.01 * (rank + 1), data_s=0.001)
            fixed.append(bal.step())
        out["fixed_sizes"] = fixed
        out["fixed_reports"] = [(r.worker_id, r.iteration, r.telemetry.compute_s, r.telemetry.data_s)
                                for r in bal.last_reports]

        # A BatchSizeManager instead of a policy (only rank 0's is used).
        manager = BatchSizeManager("fixed", X, policy_args={"weights": [1, 3]}) if rank == 0 else None
        bal = DDPBatchBalancer(X, manager=manager)
        out["manager_sizes"] = [bal.sizes, bal.step()]
        if rank == 0:
            out["manager_decisions"] = manager.decisions

        # lbbsp-cpu reacts to reported timings (rank 1 is 3x slower per sample); the rest of a
        # rank's report travels to the reports.
        per_sample = [3e-3 if r == 1 else 1e-3 for r in range(world)]
        bal = DDPBatchBalancer(X, "lbbsp-cpu")
        lb = [bal.sizes]
        for _ in range(3):
            bal.report(compute_s=bal.my_batch_size * per_sample[rank], telemetry=Telemetry(host_cpu=rank))
            lb.append(bal.step())
        out["lbbsp_sizes"] = lb
        out["lbbsp_telemetry"] = [r.telemetry.host_cpu for r in bal.last_reports]

        # (e) sparse gradients (an Embedding with sparse=True, defined first: DDP's last bucket)
        # under the default exchange, whose reports otherwise ride on the last bucket.
        torch.manual_seed(MODEL_SEED)
        sparse_model = torch.nn.Sequential(torch.nn.Embedding(50, 4, sparse=True), _MeanOver(1),
                                           torch.nn.Linear(4, 3))
        reference = _copy_of(sparse_model)
        gen = torch.Generator().manual_seed(DATA_SEED)
        tokens, labels = torch.randint(0, 50, (X, 5), generator=gen), torch.randint(0, 3, (X,), generator=gen)
        bal = DDPBatchBalancer(X, _Scripted([sizes]))
        ddp = DistributedDataParallel(sparse_model)
        bal.register_hook(ddp)
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])
        F.cross_entropy(ddp(tokens[mine]), labels[mine]).backward()
        bal.step()
        out["sparse_grads"] = [p.grad.to_dense().numpy().copy() for p in sparse_model.parameters()]
        if rank == 0:
            F.cross_entropy(reference(tokens), labels).backward()
            out["sparse_reference"] = [p.grad.to_dense().numpy().copy() for p in reference.parameters()]

        # (f) half precision with global_batch unknown ("summed"): x_i times a gradient of 300
        # passes fp16's 65,504; the bucket is summed in float32.
        half = torch.nn.Linear(4, 1, bias=False).half()
        torch.nn.init.ones_(half.weight)
        ddp = DistributedDataParallel(half)
        ddp.register_comm_hook(WeightedHookState(256, global_batch=None), weighted_allreduce_hook)
        ddp(torch.full((256, 4), 300.0, dtype=torch.float16)).mean().backward()
        out["half_grad"] = half.weight.grad.float().numpy().copy()

        # (g) SyncBatchNorm's backward all-reduces the ranks' unweighted sums: with per-rank
        # mean losses and the weighting hook the layers before it get wrong gradients; with
        # each loss scaled by x_i / X and loss_scaled=True the hook only sums and it is exact.
        # torch's SyncBatchNorm has no CPU kernels, so _CpuSyncBatchNorm does its arithmetic
        # (torch/nn/modules/_functions.py) with gloo collectives; DDP and the hook are real.
        gen = torch.Generator().manual_seed(DATA_SEED)
        feats = torch.randn(X, 4, generator=gen, dtype=torch.float64) * 2 + 1
        labels = torch.randint(0, 3, (X,), generator=gen)
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])
        for scaled in (False, True):
            bal = DDPBatchBalancer(X, _Scripted([sizes]))
            ddp = DistributedDataParallel(_sync_bn_model(_CpuSyncBatchNorm))
            bal.register_hook(ddp, loss_scaled=scaled)
            loss = F.cross_entropy(ddp(feats[mine]), labels[mine])
            (loss * bal.loss_scale if scaled else loss).backward()
            bal.step()
            out[f"sync_bn_grads_{'scaled' if scaled else 'weighted'}"] = _flat_grad(ddp.module)
        if rank == 0:
            ref = _sync_bn_model(torch.nn.BatchNorm1d)
            F.cross_entropy(ref(feats), labels).backward()
            out["sync_bn_reference"] = _flat_grad(ref)

        # Batch norm cannot be made exact by weighting gradients: registering warns.
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDPBatchBalancer(X, _Scripted([sizes])).register_hook(DistributedDataParallel(
                torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))))
        out["bn_warnings"] = [str(w.message) for w in caught]

        # A policy failure on rank 0 surfaces on every rank instead of hanging the others.
        bal = DDPBatchBalancer(X, _FailsSecondTime())
        try:
            bal.step()
            out["policy_error"] = None
        except (RuntimeError, ZeroDivisionError) as exc:
            out["policy_error"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


class _SyncBatchNormFn(torch.autograd.Function):
    """SyncBatchNorm's arithmetic (torch/nn/modules/_functions.py), over gloo: the forward
    gathers every rank's (mean, invstd, count) and normalises with the count-weighted global
    statistics; the backward all-reduces (sum_dy, sum_dy_xmu), unweighted, as torch does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        eps, c = 1e-5, x.shape[1]
        mine = torch.zeros(2 * c + 1, dtype=x.dtype)
        if x.shape[0]:
            mine = torch.cat([x.mean(0), 1.0 / torch.sqrt(x.var(0, unbiased=False) + eps),
                              torch.tensor([float(x.shape[0])], dtype=x.dtype)])
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        allr = torch.stack(rows)
        allr = allr[allr[:, -1] >= 1]
        mean, invstd, count = allr[:, :c], allr[:, c:2 * c], allr[:, -1:]
        n = count.sum()
        gmean = (count * mean).sum(0) / n
        gvar = (count * (1.0 / invstd ** 2 - eps + (mean - gmean) ** 2)).sum(0) / n
        ginv = 1.0 / torch.sqrt(gvar + eps)
        ctx.save_for_backward(x, weight, gmean, ginv, n)
        return (x - gmean) * ginv * weight + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd, n = ctx.saved_tensors
        c = x.shape[1]
        xmu = x - mean
        sums = torch.cat([dy.sum(0), (dy * xmu).sum(0)]) if x.shape[0] else torch.zeros(2 * c, dtype=x.dtype)
        grad_w, grad_b = sums[c:] * invstd, sums[:c].clone()
        dist.all_reduce(sums)
        sum_dy, sum_dy_xmu = sums[:c], sums[c:]
        grad_x = (dy - sum_dy / n - xmu * invstd ** 2 * sum_dy_xmu / n) * invstd * weight
        return grad_x, grad_w, grad_b


class _CpuSyncBatchNorm(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))
        self.bias = torch.nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SyncBatchNormFn.apply(x, self.weight, self.bias)


def _sync_bn_model(norm: Any) -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), norm(5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).double()


class _MeanOver(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(self.dim)


def _copy_of(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"ddp{world}")
    for attempt in range(3):  # the "free" port may be taken by another process meanwhile
        try:
            _spawn(_rank_main, world, (world, _free_port(), str(out_dir)))
            break
        except mp.ProcessRaisedException as exc:
            if attempt == 2 or "EADDRINUSE" not in str(exc):
                raise
    return world, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------------
# Multi-rank tests
# --------------------------------------------------------------------------------------------


def test_weighted_gradient_equals_global_batch_gradient(ranks):
    world, res = ranks
    ref = res[0]["grad_reference"]
    for r in range(world):
        for mode in ("known", "summed", "verified"):
            assert _rel(res[r][f"grad_{mode}"], ref) < 1e-5, (r, mode)
    # DDP's own averaging (by world size) is wrong for uneven batches: the hook matters.
    assert _rel(res[0]["grad_default"], ref) > 1e-2


def test_sparse_gradients_under_the_default_exchange_are_the_global_batchs(ranks):
    """The reports ride on the last bucket only when it is dense: a sparse last bucket (before,
    ``view`` on a sparse tensor raised on every rank) is reduced as it is, the reports gathered."""
    world, res = ranks
    for r in range(world):
        for got, want in zip(res[r]["sparse_grads"], res[0]["sparse_reference"]):
            assert _rel(got, want) < 1e-5


def test_sync_batch_norm_is_exact_with_scaled_losses_and_not_with_weighted_gradients(ranks):
    """Found by a review: SyncBatchNorm's backward sums the ranks' loss gradients unweighted,
    so with per-rank mean losses the weighting hook gets the layers before it wrong (the
    warning said nothing of it). With each loss scaled by x_i / X and ``loss_scaled=True``
    every gradient is the global batch's."""
    world, res = ranks
    ref = res[0]["sync_bn_reference"]
    for r in range(world):
        assert _rel(res[r]["sync_bn_grads_scaled"], ref) < 1e-9, r
        assert _rel(res[r]["sync_bn_grads_weighted"], ref) > 1e-3, r


def test_batch_norm_layers_are_named_in_a_warning(ranks):
    world, res = ranks
    for r in range(world):
        assert any("BatchNorm1d" in m and "not exactly" in m for m in res[r]["bn_warnings"]), res[r]["bn_warnings"]


def test_half_precision_buckets_with_x_unknown_do_not_overflow(ranks):
    world, res = ranks
    for r in range(world):
        np.testing.assert_allclose(res[r]["half_grad"], np.full((1, 4), 300.0), rtol=1e-3)


def test_verify_mode_detects_disagreeing_sizes(ranks):
    world, res = ranks
    for r in range(world):
        assert res[r]["verify_error"] is not None and "disagree" in res[r]["verify_error"]


def test_sgd_with_changing_sizes_matches_single_process(ranks):
    world, res = ranks
    sched = SCHEDULE[world]
    for r in range(world):
        assert [[h[k] for k in range(world)] for h in res[r]["sgd_sizes"]] == sched[:SGD_STEPS]
        np.testing.assert_allclose(res[r]["sgd_params"], res[0]["sgd_reference"], rtol=1e-4, atol=2e-6)
        np.testing.assert_array_equal(res[r]["sgd_params"], res[0]["sgd_params"])
        assert min(res[r]["sgd_buckets"]) > 1  # several buckets per backward
    for t in range(SGD_STEPS):  # the ranks' slices, in rank order, are the global batch
        got = np.concatenate([res[r]["sgd_indices"][t] for r in range(world)])
        np.testing.assert_array_equal(got, global_batch_indices(DATA_SEED, N_TRAIN, X, t))
    observed = res[0]["sgd_observed"]
    assert len(observed) == SGD_STEPS * world
    assert observed[:world] == [(0, r, sched[0][r]) for r in range(world)]
    for r in range(world):
        wid, it, size, compute_s = res[r]["sgd_reports"][r]
        assert (wid, it, size) == (r, SGD_STEPS - 1, sched[SGD_STEPS - 1][r]) and compute_s > 0
        # The finish time (size known -> last bucket ready) holds the compute and the data load.
        compute_s, finish_s = res[r]["sgd_finish"][r]
        assert finish_s is not None and finish_s >= compute_s, res[r]["sgd_finish"]
        # Every rank's report reached every rank with the last bucket, and the reports gathered
        # on their own give the same training.
        assert res[r]["fused"] and "before backward()" in res[r]["late_report_error"]
        assert [w for w, _, _ in res[r]["fused_reports"]] == list(range(world))
        assert all(c > 0 and f is not None and f >= c * (1 - 1e-6) for _, c, f in res[r]["fused_reports"])
        assert res[r]["fused_reports"] == res[0]["fused_reports"]
        assert all(c > 0 for _, c in res[r]["separate_reports"])
        # every rank's CPU since its previous report, and the part in forward and backward
        assert all(cpu > 0 and 0 < work < cpu for cpu, work in res[r]["separate_cpu"]), res[r]["separate_cpu"]
        np.testing.assert_allclose(res[r]["separate_params"], res[r]["sgd_params"], rtol=1e-5, atol=1e-7)


def test_balancer_fixed_policy_sizes(ranks):
    world, res = ranks
    weights = {0: 1.0, 1: 3.0, **{r: 1.0 for r in range(2, world)}}
    expected = proportional_split(weights, X, 1)
    if world == 2:
        assert expected == {0: 16, 1: 48}
    for r in range(world):
        assert res[r]["fixed_sizes"] == [expected] * 4
        assert all(sum(s.values()) == X for s in res[r]["fixed_sizes"])
        assert res[r]["fixed_reports"] == [(k, 2, pytest.approx(0.01 * (k + 1)), pytest.approx(0.001))
                                           for k in range(world)]
        assert "ZeroDivisionError" in res[r]["policy_error"] or "failed on rank 0" in res[r]["policy_error"]
    assert res[0]["policy_error"].startswith("ZeroDivisionError")


def test_balancer_with_manager_and_lbbsp_cpu(ranks):
    world, res = ranks
    fixed = proportional_split({0: 1.0, 1: 3.0, **{r: 1.0 for r in range(2, world)}}, X, 1)
    balanced = proportional_split({r: 1 / 3 if r == 1 else 1.0 for r in range(world)}, X, 1)
    for r in range(world):
        assert res[r]["manager_sizes"] == [fixed, fixed]
        lb = res[r]["lbbsp_sizes"]
        assert lb[0] == proportional_split({k: 1.0 for k in range(world)}, X, 1)  # cold start
        assert lb[-1] == balanced and all(sum(s.values()) == X for s in lb)
        assert res[r]["lbbsp_telemetry"] == list(range(world))
    assert res[0]["manager_decisions"] == 2


# --------------------------------------------------------------------------------------------
# In a fresh interpreter (the sampler and the balancer's own checks: tests/unit/test_ddp_sampler.py)
# --------------------------------------------------------------------------------------------


def test_integrations_package_does_not_import_torch():
    code = ("import sys, batchsize_manager, batchsize_manager.integrations as i; "
            "assert 'torch' not in sys.modules; assert 'zmq' not in sys.modules; "
            "assert 'LBBSPSampler' in i.__all__")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def run_example(*args: str, timeout_s: float = 60) -> str:
    """``examples/ddp_lbbsp.py ARGS`` to the end; its output. Fails the test on a non-zero exit
    or a timeout (then the launcher and everything it started are killed)."""
    cmd = [sys.executable, str(ROOT / "examples" / "ddp_lbbsp.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, the ranks and any service it started
        output, _ = proc.communicate(timeout=10)
        pytest.fail(f"example timed out:\n{output}")
    assert proc.returncode == 0, output
    return output


def test_example_script_runs_with_nproc():
    output = run_example("--nproc", "2", "--policy", "fixed", "--weights", "1,3", "--iterations", "4",
                         "--print-every", "2", "--global-batch", "32", "--model", "mlp",
                         "--slowdown", "1,2", "--verify")
    assert "sizes [8, 24]" in output, output
    assert "mean iteration" in output and "final sizes [8, 24]" in output, output
