"""LB-BSP for PyTorch DistributedDataParallel (gloo or NCCL).

DDP averages gradients over ranks, which is the global-batch gradient only when every rank has
the same batch. LB-BSP gives rank ``i`` its own batch size ``x_i`` (with ``sum x_i = X`` fixed)
so fast ranks do more work and nobody waits; then the mean over ranks is wrong and the update
must weight each rank's gradient by its share: ``g = sum_i x_i g_i / X``, where ``g_i`` is the
gradient of rank ``i``'s *mean* loss over its ``x_i`` samples. Three pieces make DDP do that:

* :func:`weighted_allreduce_hook` with a :class:`WeightedHookState`: a DDP communication hook
  that all-reduces ``(x_i / X) g_i`` instead of ``g_i / world_size``.
* :class:`LBBSPSampler`: one global sample order (the same stream as
  ``ps_ml.reference.global_batch_indices``), iteration ``t`` takes the next ``X`` samples
  and rank ``r`` the contiguous slice ``[sum_{j<r} x_j, sum_{j<=r} x_j)``, so every sample is
  used exactly once per epoch whatever the sizes, and the run equals single-process SGD.
* :class:`DDPBatchBalancer` (alias ``LBBSPHelper``): per iteration every rank's compute time
  reaches rank 0 (with the last gradient bucket on CPU), a
  :class:`~batchsize_manager.policies.BatchPolicy` decides the next sizes there, and a
  broadcast hands them to every rank's hook state. With ``exchange="servers"`` the buckets,
  the reports and the decision go through a ``ps-bsm --world-size N`` service instead
  (:mod:`~batchsize_manager.integrations.ddp_server_exchange`), with no collective at all.

Usage::

    bal = DDPBatchBalancer(global_batch=512, policy="lbbsp-cpu")  # after init_process_group
    ddp = DistributedDataParallel(model)
    bal.register_hook(ddp)
    sampler = LBBSPSampler(len(dataset), 512, seed=0)
    for _ in range(iterations):
        x, y = load(sampler.rank_indices(bal.iteration, bal.sizes, bal.rank))
        with bal.timed_compute():
            loss = F.cross_entropy(ddp(x), y)  # mean over this rank's x_i samples
            opt.zero_grad(); loss.backward()
        opt.step()
        bal.step()  # all ranks: timings -> rank 0's policy -> next sizes

Notes: each rank's loss must be the mean over its own ``x_i`` samples (with ``no_sync``
gradient accumulation, weight each micro-batch's mean loss by ``micro_size / x_i``). Every rank
runs a forward and backward through the DDP model every iteration, one given ``x_i = 0``
samples too (over an empty batch; the hook sends zeros): the collectives must stay in step. The
result equals single-process SGD for models without batch-coupled layers; with batch norm each
rank normalises over its own share and DDP broadcasts rank 0's running statistics, so uneven
shares are not exact there (:meth:`DDPBatchBalancer.register_hook` warns). ``SyncBatchNorm``
normalises over the global batch, but its backward sums the ranks' loss gradients unweighted,
which with per-rank mean losses weights them wrongly: register with ``loss_scaled=True`` and
multiply each rank's mean loss by :attr:`DDPBatchBalancer.loss_scale` (``x_i / X``), so every
rank back-propagates its part of the global mean loss and the hook only sums. Data
loading is by index (``rank_indices``) because the batch size changes between iterations; a
``DataLoader`` works with ``batch_sampler`` yielding those lists and ``num_workers=0`` (worker
processes would prefetch batches before the next sizes are known).

Nothing here initialises ``torch.distributed`` or needs ZeroMQ (``exchange="servers"`` imports it
when used); importing it is side-effect free.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations at runtime and
# rejects string annotations ("bucket annotation should be dist.GradBucket").

import dataclasses
import math
import secrets
import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from batchsize_manager.allocation import CapsArg
from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.policies import BatchPolicy, get_policy
from batchsize_manager.reports import WorkerReport
from ps_common.cgroup_cpu import CpuQuotaProbe
from ps_common.report import Telemetry

__all__ = [
    "DDPBatchBalancer",
    "LBBSPHelper",
    "LBBSPSampler",
    "WeightedHookState",
    "weighted_allreduce_hook",
]


# --------------------------------------------------------------------------------------------
# Communication hook
# --------------------------------------------------------------------------------------------


@dataclass
class WeightedHookState:
    """State of :func:`weighted_allreduce_hook` for one rank; mutate ``batch_size`` freely.

    ``batch_size`` is this rank's ``x_i`` for the iteration whose backward runs next (the
    balancer updates it in :meth:`DDPBatchBalancer.step`). ``global_batch`` is ``X = sum x_i``,
    known from the assignment, so the hook needs one all-reduce per bucket, like DDP's own.
    With ``global_batch=None`` the sum is all-reduced alongside every bucket instead (an extra
    one-element collective); with ``verify=True`` it is all-reduced too and checked against
    ``global_batch`` (a debug aid that catches ranks disagreeing on the sizes).

    The hook also records when it last saw a bucket (``last_ready_s``, ``perf_counter``; on
    CUDA a ``last_ready_event``): the moment this rank's local backward had produced its last
    gradient bucket, i.e. the end of its own compute before any waiting for other ranks.
    """

    batch_size: int
    global_batch: int | None = None
    process_group: dist.ProcessGroup | None = None
    verify: bool = False
    #: Each rank's loss is already its part of the global mean loss (its mean times x_i / X):
    #: the hook only sums (zeros for a rank without samples). Exact with SyncBatchNorm too.
    loss_scaled: bool = False
    hook_calls: int = 0
    last_ready_s: float = math.nan
    last_ready_event: Any = field(default=None, repr=False)
    #: Set by the balancer: (this rank, world size, a function giving this rank's report row at
    #: the moment its last bucket is ready). The rows then ride with the last bucket's
    #: all-reduce, each rank's in its own slot (zeros elsewhere, so the sum is a gather).
    report_slot: tuple[int, int, Callable[[], list[float]]] | None = field(default=None, repr=False)
    #: The gathered rows (world size x fields) of the last bucket reduced, once it completed.
    reports: torch.Tensor | None = field(default=None, repr=False)
    #: Set by the balancer with ``exchange="servers"``: a
    #: :class:`~batchsize_manager.integrations.ddp_server_exchange.ServerExchange` that sends the
    #: buckets to the service (which weights them) instead of all-reducing them.
    server: Any = field(default=None, repr=False)

    def _mark_ready(self, tensor: torch.Tensor) -> None:
        self.hook_calls += 1
        self.last_ready_s = time.perf_counter()
        if tensor.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.last_ready_event = event


def weighted_allreduce_hook(
    state: WeightedHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket becomes ``sum_i x_i g_i / sum_i x_i`` (not ``mean_i g_i``).

    Register with ``ddp_model.register_comm_hook(state, weighted_allreduce_hook)``. Each rank's
    loss must be the mean over its own ``x_i`` samples. With a registered hook DDP does not
    divide by the world size itself, so the weighting here is the only scaling. A rank with
    ``x_i = 0`` contributes zeros (its mean loss over no samples would be NaN).
    """
    tensor = bucket.buffer()
    state._mark_ready(tensor)
    if state.server is not None:
        return _through_server(state, bucket)
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    slot = state.report_slot
    # The reports ride on a dense float bucket; a sparse one (an Embedding with sparse=True) is
    # reduced as it is, and the balancer gathers the reports on their own (every rank has the
    # same buckets, so every rank takes the same branch).
    if (slot is not None and bucket.is_last() and tensor.dtype in (torch.float32, torch.float64)
            and tensor.layout == torch.strided):
        return _with_reports(state, tensor, group, slot)
    known = state.global_batch
    total = torch.tensor([float(state.batch_size)], dtype=torch.float64, device=tensor.device)
    # Scale before the sum (like DDP's pre-division) so fp16 buckets do not overflow. With X
    # unknown the scale is x_i, not x_i / X: a half-precision bucket is then summed in float32
    # (x_i times a gradient easily passes fp16's 65,504) and divided before it is cast back.
    widen = known is None and tensor.dtype in (torch.float16, torch.bfloat16) and tensor.layout == torch.strided
    work = tensor.to(torch.float32) if widen else tensor
    _scale(state, work)
    if known is not None and not state.verify:
        return (
            dist.all_reduce(work, group=group, async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0])
        )

    # The sum of the sizes travels alongside: both collectives are issued in the same order on
    # every rank, and the result is read only when both are done.
    size_fut = dist.all_reduce(total, group=group, async_op=True).get_future()
    grad_fut = dist.all_reduce(work, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        size_done, grad_done = fut.value()
        summed = float(size_done.value()[0].item())
        grad = grad_done.value()[0]
        if known is not None:
            if summed != known:
                raise RuntimeError(
                    f"ranks' batch sizes sum to {summed:g}, but global_batch is {known}: "
                    f"the ranks disagree on the assignment")
            return grad
        if summed <= 0:
            raise RuntimeError("all ranks have batch size 0")
        grad = grad.div_(summed)
        return tensor.copy_(grad) if widen else grad

    return torch.futures.collect_all([size_fut, grad_fut]).then(finish)


def _through_server(state: WeightedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket goes to the exchange service unscaled (it weights by the planned sizes); the
    last one carries this rank's report."""
    last = bucket.is_last()
    telemetry = None
    if last:
        slot = state.report_slot
        telemetry = Telemetry.from_floats(slot[2]()) if slot is not None else Telemetry()
    return state.server.submit(bucket.buffer(), bucket.index(), last, state.batch_size, telemetry)


def _scale(state: WeightedHookState, tensor: torch.Tensor) -> None:
    """``tensor *= x_i / X`` (zeros for a rank without samples; nothing more when the loss was
    scaled already)."""
    x, known = int(state.batch_size), state.global_batch
    if x < 0:
        raise ValueError(f"batch_size must be >= 0, got {x}")
    if known is not None and known <= 0:
        raise ValueError(f"global_batch must be > 0, got {known}")
    if state.loss_scaled and known is None:
        raise ValueError("loss_scaled needs global_batch: the loss scale is x_i / X")
    if x == 0:
        tensor.zero_()
    elif not state.loss_scaled:
        tensor.mul_(x / known if known is not None else float(x))


def _with_reports(state: WeightedHookState, tensor: torch.Tensor, group: Any,
                  slot: tuple[int, int, Callable[[], list[float]]]) -> torch.futures.Future[torch.Tensor]:
    """The last bucket's all-reduce, carrying every rank's report row and its batch size: one
    collective where the balancer would need two more (a gather of the reports, and the size
    sum that ``verify`` or an unknown ``global_batch`` needs). Under a CPU quota every
    collective costs a throttled rank CPU time it does not have (a small gloo all-gather took
    about 1.3 ms of CPU per rank here, as much as the gradients' all-reduce)."""
    rank, world, row_of = slot
    row = row_of()
    width = len(row) + 1
    n = tensor.numel()
    ext = torch.zeros(n + world * width, dtype=tensor.dtype, device=tensor.device)
    ext[:n].copy_(tensor.view(-1))
    _scale(state, ext[:n])
    mine = torch.tensor([*row, float(state.batch_size)], dtype=torch.float64)
    ext[n + rank * width: n + (rank + 1) * width].copy_(mine)  # an absent field (NaN) + 0 stays NaN
    known, check = state.global_batch, state.verify or state.global_batch is None

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        rows = out[n:].view(world, width).to(torch.float64)
        summed = float(rows[:, -1].sum())
        state.reports = rows[:, :-1].cpu()
        grad = out[:n].view_as(tensor)
        if check:
            if known is not None and summed != known:
                raise RuntimeError(f"ranks' batch sizes sum to {summed:g}, but global_batch is {known}: "
                                   f"the ranks disagree on the assignment")
            if known is None:
                if summed <= 0:
                    raise RuntimeError("all ranks have batch size 0")
                grad.div_(summed)
        return grad

    return dist.all_reduce(ext, group=group, async_op=True).get_future().then(finish)


def collectives_device(backend: str, cuda_available: bool) -> str:
    """The device the balancer's small collectives use by default: CUDA only when the group's
    backend handles nothing but CUDA tensors (``nccl``; an unnamed backend on a CUDA machine,
    which torch maps to NCCL alone), else the CPU (``gloo``, ``cpu:gloo,cuda:nccl``)."""
    names = backend.lower()
    if any(k in names for k in ("gloo", "mpi", "cpu:")):
        return "cpu"
    return "cuda" if "nccl" in names or (names == "undefined" and cuda_available) else "cpu"


def batch_norm_warning(norms: Mapping[str, bool], *, loss_scaled: bool, min_batch: int) -> str:
    """What :meth:`DDPBatchBalancer.register_hook` warns about the model's batch-norm layers
    (``{class name: is SyncBatchNorm}``), or "" when training is exact."""
    plain = sorted(n for n, sync in norms.items() if not sync)
    synced = sorted(n for n, sync in norms.items() if sync)
    out = []
    if plain:
        out.append(f"the model has batch-norm layers ({', '.join(plain)}): each rank normalises over "
                   f"its own x_i samples, and DDP broadcasts rank 0's running statistics, so with "
                   f"uneven shares training is not exactly the global batch's (a rank given 0 or 1 "
                   f"samples keeps stale statistics or fails in BatchNorm); min_batch={min_batch}")
    if synced and not loss_scaled:
        out.append(f"{', '.join(synced)} normalises over the global batch, but its backward sums "
                   f"the ranks' loss gradients unweighted: with uneven shares the gradients of the "
                   f"layers before it are wrong unless each rank's mean loss is multiplied by "
                   f"balancer.loss_scale and the hook registered with loss_scaled=True")
    return "; ".join(out)


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


def _default_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch's shuffled order; identical to ``ps_ml.datasets.sample_order``.

    Mirrored rather than imported so this package does not depend on ``ps_common``; the
    tests check that both streams agree.
    """
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64, copy=False)


def _size_list(sizes: Mapping[int, int] | Sequence[int]) -> list[int]:
    """Sizes as a list indexed by rank 0..N-1 (a mapping must have exactly those keys)."""
    if isinstance(sizes, Mapping):
        if set(sizes) != set(range(len(sizes))):
            raise ValueError(f"sizes must be keyed by ranks 0..{len(sizes) - 1}, got {sorted(sizes)}")
        out = [int(sizes[r]) for r in range(len(sizes))]
    else:
        out = [int(s) for s in sizes]
    if not out or any(s < 0 for s in out):
        raise ValueError(f"sizes must be a non-empty list of non-negative ints, got {out}")
    return out


class LBBSPSampler:
    """Per-rank sample indices cut from one global, epoch-shuffled sample stream.

    The stream is ``order(0), order(1), ...`` (each a permutation of ``range(num_samples)``);
    iteration ``t`` takes stream positions ``[t X, (t+1) X)`` (a chunk may straddle two epochs)
    and rank ``r`` the contiguous slice starting at ``sum_{j<r} x_j``. The split depends only
    on ``(iteration, sizes)``: nothing is consumed, so sizes may change every iteration, any
    rank can be asked about any iteration (resume is free), and the concatenation over ranks
    is exactly the single-process global batch of ``ps_ml.reference.global_batch_indices``.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        seed: int = 0,
        order: Callable[[int], np.ndarray] | None = None,
        cache_epochs: int = 2,
    ) -> None:
        """``order(epoch)`` overrides the default shuffle (it must be a permutation)."""
        if num_samples <= 0 or global_batch <= 0 or seed < 0:
            raise ValueError(f"need num_samples > 0, global_batch > 0, seed >= 0; "
                             f"got {num_samples}, {global_batch}, {seed}")
        self.num_samples = int(num_samples)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self._order = order
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_epochs = max(1, int(cache_epochs))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (cached: consecutive iterations reuse it)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        hit = self._cache.get(epoch)
        if hit is not None:
            self._cache.move_to_end(epoch)
            return hit
        perm = (self._order(epoch) if self._order is not None
                else _default_order(self.seed, epoch, self.num_samples))
        perm = np.asarray(perm, dtype=np.int64)
        if perm.shape != (self.num_samples,):
            raise ValueError(f"order({epoch}) must have {self.num_samples} entries, got {perm.shape}")
        perm.setflags(write=False)
        self._cache[epoch] = perm
        while len(self._cache) > self._cache_epochs:
            self._cache.popitem(last=False)
        return perm

    def stream(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at global stream positions ``[start, stop)`` (a fresh array)."""
        if start < 0 or stop < start:
            raise ValueError(f"need 0 <= start <= stop, got {start}, {stop}")
        n = self.num_samples
        if stop == start:
            return np.empty(0, dtype=np.int64)
        pieces = []
        for epoch in range(start // n, (stop - 1) // n + 1):
            base = epoch * n
            lo, hi = max(start, base) - base, min(stop, base + n) - base
            pieces.append(self.epoch_order(epoch)[lo:hi])
        return np.concatenate(pieces)

    def global_indices(self, iteration: int) -> np.ndarray:
        """All ``X`` sample indices of ``iteration``, in rank order."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        start = iteration * self.global_batch
        return self.stream(start, start + self.global_batch)

    def rank_indices(
        self, iteration: int, sizes: Mapping[int, int] | Sequence[int], rank: int
    ) -> np.ndarray:
        """Rank ``rank``'s ``sizes[rank]`` sample indices of ``iteration``."""
        xs = _size_list(sizes)
        if sum(xs) != self.global_batch:
            raise ValueError(f"sizes {xs} sum to {sum(xs)}, not the global batch {self.global_batch}")
        if not 0 <= rank < len(xs):
            raise ValueError(f"rank {rank} out of range for {len(xs)} sizes")
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        start = iteration * self.global_batch + sum(xs[:rank])
        return self.stream(start, start + xs[rank])

    def epoch(self, iteration: int) -> float:
        """Epochs completed before ``iteration`` starts (fractional)."""
        return iteration * self.global_batch / self.num_samples


# --------------------------------------------------------------------------------------------
# Loop helper
# --------------------------------------------------------------------------------------------


@runtime_checkable
class _PolicyLike(Protocol):
    """What the balancer needs from a decision maker (a BatchPolicy or an adapted manager)."""

    def observe(self, report: WorkerReport) -> None: ...

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]: ...


class _ManagerDecider:
    """Adapts a ``BatchSizeManager`` (X, bounds and membership inside) to the policy calls."""

    def __init__(self, manager: BatchSizeManager, world_size: int, global_batch: int) -> None:
        if manager.global_batch != global_batch:
            raise ValueError(f"the manager splits X={manager.global_batch}, the balancer was given {global_batch}")
        self.manager = manager
        self.min_batch = manager.min_batch
        for r in range(world_size):
            manager.join(r)

    def observe(self, report: WorkerReport) -> None:
        self.manager.observe(report)

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        return self.manager.assign()


_FAILED = -1  # broadcast in place of sizes when rank 0's decision raised


class DDPBatchBalancer:
    """Per-iteration LB-BSP coordination for a DDP job: timings in, next batch sizes out.

    Construct on every rank after ``init_process_group`` (all ranks, same arguments). The
    decision runs on rank 0 only (the policy object exists only there, so stateful or
    randomised policies cannot diverge across ranks). Every rank's
    :class:`~ps_common.report.Telemetry` (a float per field) reaches rank 0 with the last
    gradient bucket's all-reduce, each rank's row in a slot of its own (``exchange="fused"``,
    the default on CPU), or by an ``all_gather`` in :meth:`step` (``"separate"``, the default on
    CUDA, and whenever no bucket was reduced in the iteration); the sizes go back by one
    ``broadcast`` (one int per rank). Under CPU quotas each collective costs a throttled rank
    CPU time: fused, a step costs the broadcast and the policy's decision on rank 0 while the
    others wait. With fused reports, :meth:`report` must come before ``backward()``, and the
    reported ``iteration_s`` is the previous iteration's.

    ``policy`` is a registered policy name (built with ``get_policy(policy, **policy_args)``)
    or a ready ``BatchPolicy``; ``manager`` is a configured
    :class:`~batchsize_manager.manager.BatchSizeManager` (its X must equal ``global_batch``; its
    bounds, memory caps and validation then apply) and wins over ``policy``. Only rank 0's
    argument is used, so other ranks may pass ``None``. Worker ids are the ranks of
    ``process_group``. If the decision raises on rank 0, every rank raises. ``device`` holds
    the small collectives' tensors (default: the current CUDA device under NCCL, else CPU).

    ``exchange="servers"`` with ``endpoint`` (a ``ps-bsm --world-size N`` service) replaces all
    of that: the buckets go to the service, which sums them weighted by the sizes it planned,
    decides the next split with its own policy, and returns both (``policy`` and the other
    decision arguments are then not used; ``security``: the ranks' CURVE settings;
    ``timeout_s``: how long a rank waits for an answer, longer than the service's
    ``--stale-s`` so that a lost rank is reported by the service). No collective runs per
    iteration; under CPU quotas and on slow links that is what makes it faster
    (``benchmarks/bench_lab_ddp.py``). Each iteration needs one backward through the DDP model.

    Compute time (what LB-BSP's policies need: how long this rank takes for its own batch) is
    measured by :meth:`timed_compute`, which stops the clock when the registered hook saw this
    rank's last gradient bucket. That matters: in DDP the end of ``backward()`` waits for the
    all-reduce, so a fast rank's raw forward+backward time would include waiting for the
    straggler and every rank would look equally slow. Alternatively :meth:`report` the
    numbers yourself.
    """

    def __init__(
        self,
        global_batch: int,
        policy: str | BatchPolicy | _PolicyLike = "uniform",
        policy_args: Mapping[str, Any] | None = None,
        *,
        manager: BatchSizeManager | None = None,
        process_group: dist.ProcessGroup | None = None,
        min_batch: int = 1,
        device: torch.device | str | None = None,
        verify: bool = False,
        exchange: str = "auto",
        endpoint: str | None = None,
        security: Any = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DDPBatchBalancer needs torch.distributed to be initialised first")
        self.group = process_group
        self.rank: int = dist.get_rank(process_group)
        self.world_size: int = dist.get_world_size(process_group)
        self.global_batch = int(global_batch)
        self.min_batch = int(min_batch)
        if self.min_batch < 0 or self.global_batch < max(1, self.min_batch * self.world_size):
            raise ValueError(f"global batch {global_batch} cannot give {self.world_size} ranks "
                             f"at least {min_batch} samples each")
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        if device is None:
            device = collectives_device(str(dist.get_backend(process_group)), torch.cuda.is_available())
        self.device = torch.device(device)
        #: Where this rank computes, as :meth:`register_hook` finds the model's parameters: a
        #: CUDA rank's spans are timed with CUDA events whatever device the collectives use
        #: (before, only a backend named "nccl" did that, so "gloo" or "cpu:gloo,cuda:nccl"
        #: with a CUDA model timed kernel launches on the CPU clock).
        self.compute_device = self.device
        self.iteration = 0
        self.hook_state = WeightedHookState(batch_size=0, global_batch=self.global_batch,
                                            process_group=process_group, verify=verify)
        if exchange not in ("auto", "fused", "separate", "servers"):
            raise ValueError(f"exchange must be 'auto', 'fused', 'separate' or 'servers', got {exchange!r}")
        self._exchange = exchange
        if exchange in ("fused", "servers") and self.device.type == "cuda":
            raise ValueError(f"exchange={exchange!r} needs CPU timing (on CUDA the compute time is "
                             f"known only once the GPU is done; use 'separate')")
        if (exchange == "servers") != (endpoint is not None):
            raise ValueError("exchange='servers' needs the endpoint of a `ps-bsm --world-size N` "
                             "service, and an endpoint is only used with exchange='servers'")
        if exchange == "servers" and (manager is not None or policy_args):
            raise ValueError("with exchange='servers' the service's policy decides "
                             "(ps-bsm --policy/--policy-args); pass neither manager nor policy_args")
        #: Do the reports ride with the last gradient bucket (no all-gather of their own)?
        self.fused = exchange in ("fused", "servers") or (exchange == "auto" and self.device.type != "cuda")
        #: With exchange="servers": this rank's link to the service (gradients, reports, splits).
        self.server: Any = None
        if self.fused:
            self.hook_state.report_slot = (self.rank, self.world_size, self._row_at_last_bucket)
        self._prev_iteration_s = 0.0  # none before the first
        # What a CPU quota rations, measured by this rank (see _mine): its CPU cgroup's quota and
        # the process CPU clock when its previous report left (None: no report yet).
        self._quota_probe = CpuQuotaProbe()
        self._cpu_at_report: float | None = None
        #: Every rank's reports of the last finished iteration (the same on all ranks).
        self.last_reports: list[WorkerReport] = []

        self._floor = self.min_batch  # the smallest size rank 0 accepts from the decider
        self._decider: _PolicyLike | None = None
        self._setup_error: BaseException | None = None
        if endpoint is not None:
            from batchsize_manager.integrations.ddp_server_exchange import ServerExchange

            self.server = ServerExchange(endpoint, self.rank, timeout_s=timeout_s, security=security,
                                         job=self._job_id())
            self._sizes: list[int] = self._check(dict(enumerate(self.server.open(0))))
            self.hook_state.server = self.server
        else:
            if self.rank == 0:
                try:
                    self._decider = self._make_decider(policy, policy_args, manager)
                except Exception as exc:  # re-raised after telling the other ranks
                    self._setup_error = exc
            self._sizes = self._decide([])
        self.hook_state.batch_size = self._sizes[self.rank]
        self._reset_timers()

    # ---- construction ----------------------------------------------------------------------

    def _make_decider(self, policy: Any, policy_args: Mapping[str, Any] | None,
                      manager: BatchSizeManager | None) -> _PolicyLike:
        """The rank-0 decision maker, with every rank joined as a worker."""
        chosen = manager if manager is not None else policy
        if policy_args and not isinstance(chosen, str):
            raise ValueError("policy_args only apply to a policy given by name")
        if isinstance(chosen, BatchSizeManager):
            decider: Any = _ManagerDecider(chosen, self.world_size, self.global_batch)
            self._floor = decider.min_batch
            return decider
        if isinstance(chosen, str):
            decider = get_policy(chosen, **dict(policy_args or {}))
        elif isinstance(chosen, _PolicyLike):
            decider = chosen
        else:
            raise TypeError(f"{type(chosen).__name__} has no observe()/assign(); "
                            f"pass a policy name, a BatchPolicy or a BatchSizeManager")
        join = getattr(decider, "join", None)
        if callable(join):
            for r in range(self.world_size):
                join(r)
        return decider

    # ---- what the loop reads ---------------------------------------------------------------

    @property
    def sizes(self) -> dict[int, int]:
        """``{rank: x_rank}`` for the current iteration (a copy); sums to ``global_batch``."""
        return dict(enumerate(self._sizes))

    @property
    def my_batch_size(self) -> int:
        """This rank's ``x_i`` for the current iteration."""
        return self._sizes[self.rank]

    @property
    def my_offset(self) -> int:
        """Where this rank's slice starts inside the iteration's global batch."""
        return sum(self._sizes[: self.rank])

    def batch_indices(self, sampler: LBBSPSampler) -> np.ndarray:
        """This rank's sample indices for the current iteration."""
        return sampler.rank_indices(self.iteration, self._sizes, self.rank)

    @property
    def loss_scale(self) -> float:
        """``x_i / X`` for this rank and iteration: with ``register_hook(..., loss_scaled=True)``
        multiply this rank's mean loss by it before ``backward()``."""
        return self.my_batch_size / self.global_batch

    def register_hook(self, ddp_model: torch.nn.parallel.DistributedDataParallel, *,
                      loss_scaled: bool = False) -> None:
        """Install :func:`weighted_allreduce_hook` with this balancer's state on ``ddp_model``.

        ``loss_scaled=True``: every rank multiplies its mean loss by :attr:`loss_scale` and the
        hook only sums; needed for exactness with ``SyncBatchNorm``, whose backward couples the
        ranks. Warns about batch-norm layers the weighting cannot make exact. A model on CUDA
        is timed with CUDA events, whatever the collectives' device, and if any rank's is, every
        rank gathers its reports on their own (one small all-reduce here agrees on it). Every
        rank must call it."""
        if loss_scaled and self._exchange == "servers":
            raise ValueError("loss_scaled=True does not go with exchange='servers' (the service "
                             "weights the buckets by the planned sizes itself)")
        on_cuda = next((p.device for p in ddp_model.parameters() if p.is_cuda), None)
        # Whether the reports ride with the last bucket must be the same on every rank (the
        # collectives differ otherwise): one rank on CUDA turns it off on all of them. (fused is
        # the same on every rank here: it follows the configuration and the collectives' device.)
        if self.fused and self._any_rank(on_cuda is not None):
            if self._exchange != "auto":
                raise ValueError(f"exchange={self._exchange!r} needs CPU timing, and a rank's model is "
                                 f"on CUDA (there the compute time is known only once the GPU is done; "
                                 f"use 'separate')")
            self.fused = False
            self.hook_state.report_slot = None
        self.compute_device = on_cuda if on_cuda is not None else self.compute_device
        self.hook_state.loss_scaled = bool(loss_scaled)
        ddp_model.register_comm_hook(self.hook_state, weighted_allreduce_hook)
        text = batch_norm_warning({type(m).__name__: isinstance(m, torch.nn.SyncBatchNorm)
                                   for m in ddp_model.modules()
                                   if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)},
                                  loss_scaled=bool(loss_scaled), min_batch=self.min_batch)
        if text:
            warnings.warn(text, stacklevel=2)

    # ---- timing ----------------------------------------------------------------------------

    def _reset_timers(self) -> None:
        self._iter_start = time.perf_counter()
        self._compute_s = 0.0
        self._data_s = 0.0
        self._cuda_spans: list[tuple[Any, Any]] = []
        self._reported_compute: float | None = None
        self._reported_data: float | None = None
        self._telemetry = Telemetry()
        self._ready_s = math.nan  # when this rank's last gradient bucket was ready (CPU clock)
        self._span_start = math.nan  # the open timed_compute block's start
        self._work_cpu_s = 0.0  # process CPU seconds in timed_data and closed timed_compute blocks
        self._span_cpu_start = math.nan  # the process CPU clock when the open block began
        self._sent = False  # this iteration's report left with the last bucket (fused)

    @contextmanager
    def timed_compute(self) -> Iterator[None]:
        """Time this rank's forward+backward (may be used several times per iteration).

        The span ends when the hook saw the last gradient bucket inside the block (the end of
        local compute), or at the block's end if no bucket was reduced in it. On CUDA the span
        is measured with events, so asynchronous kernels are counted.
        """
        calls = self.hook_state.hook_calls
        start_event = None
        if self.compute_device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        t0 = self._span_start = time.perf_counter()
        self._span_cpu_start = time.process_time()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            if math.isfinite(self._span_cpu_start):  # not when the report left inside the block
                self._work_cpu_s += time.process_time() - self._span_cpu_start
            self._span_start = self._span_cpu_start = math.nan
            fired = self.hook_state.hook_calls != calls
            if start_event is not None:
                end_event = self.hook_state.last_ready_event if fired else None
                if end_event is None:
                    end_event = torch.cuda.Event(enable_timing=True)
                    end_event.record()
                self._cuda_spans.append((start_event, end_event))
            else:
                end = self.hook_state.last_ready_s if fired else t1
                self._compute_s += max(0.0, min(end, t1) - t0)
                self._ready_s = min(end, t1)

    @contextmanager
    def timed_data(self) -> Iterator[None]:
        """Time this rank's data loading (reported as ``Telemetry.data_s``)."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._data_s += time.perf_counter() - t0
            self._work_cpu_s += time.process_time() - cpu0

    def report(self, compute_s: float | None = None, data_s: float | None = None,
               telemetry: Telemetry | None = None) -> None:
        """Override this iteration's measured compute and/or data time (seconds).

        ``telemetry``: this rank's other measurements of the iteration (e.g. ``host_cpu`` for
        the NARX predictor, or ``oom=True`` after an out-of-memory), which reach the policy's
        reports; its ``compute_s``, ``data_s``, ``iteration_s`` and ``finish_s`` are the
        balancer's own (measured, or given here as ``compute_s`` and ``data_s``).
        """
        if self._sent:
            raise RuntimeError("report() after this iteration's backward: its report already left "
                               "with the last gradient bucket; call report() before backward(), or "
                               "construct the balancer with exchange='separate'")
        if telemetry is not None:
            self._telemetry = telemetry
        if compute_s is not None:
            if not math.isfinite(compute_s) or compute_s < 0:
                raise ValueError(f"compute_s must be finite and >= 0, got {compute_s}")
            self._reported_compute = float(compute_s)
        if data_s is not None:
            if not math.isfinite(data_s) or data_s < 0:
                raise ValueError(f"data_s must be finite and >= 0, got {data_s}")
            self._reported_data = float(data_s)

    def _mine(self, compute_s: float, iteration_s: float, finish_s: float) -> Telemetry:
        """This rank's report (once per iteration): its timings, and what a CPU quota rations:
        the quota in force, the process CPU since the previous report, and the part of it in
        data loading, forward and backward (an open compute block counts up to now)."""
        data_s = self._reported_data if self._reported_data is not None else self._data_s
        cpu = time.process_time()
        work_cpu = self._work_cpu_s
        if math.isfinite(self._span_cpu_start):
            work_cpu += cpu - self._span_cpu_start
            self._span_cpu_start = math.nan
        self._work_cpu_s = 0.0
        cpu_s = None if self._cpu_at_report is None else cpu - self._cpu_at_report
        self._cpu_at_report = cpu
        quota, throttled = self._quota_probe.read()
        return dataclasses.replace(self._telemetry, compute_s=compute_s, iteration_s=iteration_s,
                                   data_s=data_s, finish_s=finish_s if finish_s > 0 else None,
                                   cpu_quota=quota, throttled_s=throttled, cpu_s=cpu_s,
                                   compute_cpu_s=work_cpu)

    def _row_at_last_bucket(self) -> list[float]:
        """This rank's report at the moment its last gradient bucket is ready (fused exchange):
        compute up to now, its finish time, and the previous iteration's length (this one's is
        not over; the servers' workers report it one iteration late too)."""
        now = time.perf_counter()
        self._sent = True
        if self._reported_compute is not None:
            compute, finish = self._reported_compute, math.nan
        else:
            open_span = now - self._span_start if math.isfinite(self._span_start) else 0.0
            compute, finish = self._compute_s + max(0.0, open_span), now - self._iter_start
        return self._mine(compute, self._prev_iteration_s, finish).to_floats()

    def _measured_compute(self) -> float:
        if self._reported_compute is not None:
            return self._reported_compute
        total = self._compute_s
        for start, end in self._cuda_spans:
            end.synchronize()
            total += max(0.0, start.elapsed_time(end) / 1e3)
        return total

    # ---- the per-iteration exchange --------------------------------------------------------

    def step(self) -> dict[int, int]:
        """Finish the iteration on every rank: gather timings, decide on rank 0, broadcast.

        Call once per iteration on all ranks, after the backward (usually after
        ``optimizer.step()``). Returns the sizes of the next iteration, which also become
        :attr:`sizes` and the hook's ``batch_size``.
        """
        iteration_s = time.perf_counter() - self._iter_start
        srv = self.server
        if srv is not None:  # the service decided when every rank's last bucket reached it
            if srv.next_sizes is None:
                raise RuntimeError(f"exchange='servers': no gradient bucket of iteration {self.iteration} "
                                   f"went through the service; each iteration needs one backward "
                                   f"through the DDP model (accumulate micro-batches under no_sync())")
            telemetry = list(srv.reports)
        else:
            telemetry = [Telemetry.from_floats(row) for row in self._gathered_rows(iteration_s)]
        self._prev_iteration_s = iteration_s
        self.last_reports = [
            WorkerReport(worker_id=r, iteration=self.iteration, batch_size=self._sizes[r], telemetry=tel)
            for r, tel in enumerate(telemetry)
        ]
        if srv is not None:
            self._sizes = self._check(dict(enumerate(srv.next_sizes)))
            srv.advance()
        else:
            self._sizes = self._decide(self.last_reports)
        self.hook_state.batch_size = self._sizes[self.rank]
        self.iteration += 1
        self._reset_timers()
        return self.sizes

    def _gathered_rows(self, iteration_s: float) -> list[list[float]]:
        """Every rank's report row, from the last bucket's all-reduce or an all-gather."""
        fused, self.hook_state.reports = self.hook_state.reports, None
        if fused is not None and self._sent:
            # Every rank's report came with the last bucket (the backward waited for it): a
            # collective only when a bucket was reduced, so every rank takes the same branch.
            return fused.tolist()
        compute_s = self._measured_compute()
        # What the all-reduce waits for, like the servers' finish time: from the moment every
        # rank knew its size (the end of the last step) to this rank's last gradient bucket,
        # data loading and CPU-quota stalls included. Measured, so not with reported timings.
        finish_s = (self._ready_s - self._iter_start
                    if self._reported_compute is None and math.isfinite(self._ready_s) else math.nan)
        mine = self._mine(compute_s, iteration_s, finish_s)
        local = torch.tensor(mine.to_floats(), dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu().tolist()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (one small all-reduce; every rank must call it)."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _job_id(self) -> str:
        """A number rank 0 draws and every rank of this start of the job gets (one broadcast):
        the exchange service tells a restarted job from this one by it, whichever rank of the
        restarted job opens first."""
        buf = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64,
                           device=self.device)
        dist.broadcast(buf, src=self._src, group=self.group)
        return f"{int(buf.item()):x}"

    def close(self) -> None:
        """Close the link to the exchange service (``exchange="servers"``); a no-op otherwise."""
        if self.server is not None:
            self.server.close()

    def _decide(self, reports: list[WorkerReport]) -> list[int]:
        """Rank 0 asks the policy; the result (or a failure marker) is broadcast to all."""
        buf = torch.full((self.world_size,), _FAILED, dtype=torch.int64, device=self.device)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                if self._setup_error is not None:
                    raise self._setup_error
                assert self._decider is not None
                for rep in reports:
                    self._decider.observe(rep)
                buf.copy_(torch.tensor(self._check(self._decider.assign(
                    list(range(self.world_size)), self.global_batch, self.min_batch)),
                    dtype=torch.int64))
            except Exception as exc:
                error = exc
                buf.fill_(_FAILED)
        dist.broadcast(buf, src=self._src, group=self.group)
        if error is not None:
            raise error
        sizes = [int(v) for v in buf.cpu().tolist()]
        if any(v == _FAILED for v in sizes):
            raise RuntimeError("the batch policy failed on rank 0 (see rank 0's error)")
        return sizes

    def _check(self, assignment: Mapping[int, int]) -> list[int]:
        """The policy's answer as a rank-indexed list, refusing anything but an exact split."""
        if set(assignment) != set(range(self.world_size)):
            raise RuntimeError(f"policy assigned workers {sorted(assignment)}, "
                               f"expected ranks 0..{self.world_size - 1}")
        sizes = [int(assignment[r]) for r in range(self.world_size)]
        if sum(sizes) != self.global_batch or any(s < self._floor for s in sizes):
            raise RuntimeError(f"policy assigned {sizes}: must sum to {self.global_batch} "
                               f"with every size >= {self._floor}")
        return sizes


#: The name used in the design notes for the loop helper.
LBBSPHelper = DDPBatchBalancer
