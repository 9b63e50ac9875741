"""Batch policies: how the global batch X is split over the live workers each iteration.

A policy is pure decision logic (no sockets, no clocks of its own): the coordinator tells it
who joined and left, feeds it each worker's per-iteration report, and asks for the next split.
LB-BSP's predictive policies plug in here through the same interface and registry.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from batchsize_manager.allocation import (
    CapsArg,
    bounded_split,
    bounded_split_arrays,
    proportional_split,
    uniform_split,
)
from ps_common.registry import Registry

if TYPE_CHECKING:
    from batchsize_manager.reports import ReportBatch, WorkerReport


class BatchPolicy(ABC):
    """Decides {worker: batch size} with sum exactly ``global_batch``.

    Two ways in: per report and per mapping (``observe``, ``assign``; any policy), and per batch
    and per array (``observe_batch``, ``assign_arrays``), which the BatchSizeManager uses so that an
    iteration of N workers costs a few numpy operations rather than N Python calls. The defaults
    of the batch forms fall back to the per-report ones, so a policy only has to write one of them;
    the built-in policies implement the array forms natively (``native_arrays = True``) and their
    per-report forms are batches of one.
    """

    name: str = ""
    #: True when ``assign_arrays``/``observe_batch`` are the policy's own (vectorised) code
    native_arrays: bool = False
    #: compiled helpers (:mod:`batchsize_manager.lbbsp_kernel`) that the manager also uses for its
    #: own per-decision checks when the policy has loaded them; None: numpy
    kernels: Any = None

    def join(self, worker_id: int) -> None:
        """A worker became live."""

    def leave(self, worker_id: int) -> None:
        """A worker left or was declared lost."""

    def observe(self, report: WorkerReport) -> None:
        """A worker's report for a finished iteration."""

    @abstractmethod
    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        """The next batch size of every worker in ``workers``; sums exactly to ``global_batch``.

        Every size is >= ``min_batch`` and <= the worker's cap: ``max_batch`` is one int for
        all, a ``{worker: cap}`` mapping (missing = uncapped) or None. Every policy takes this
        signature; :class:`~batchsize_manager.manager.BatchSizeManager` checks each answer
        against the bounds all the same.
        """

    def observe_batch(self, batch: ReportBatch) -> None:
        """Several reports at once, in arrival order (default: :meth:`observe` each)."""
        if type(self).observe is BatchPolicy.observe:
            return                                # the policy ignores reports
        for r in batch.reports:
            self.observe(r)

    def assign_arrays(self, ids: np.ndarray, global_batch: int, min_batch: int,
                      caps: np.ndarray, *, checked: bool = False) -> np.ndarray:
        """:meth:`assign` on arrays: ``ids`` sorted int64, ``caps`` aligned floats (inf: uncapped);
        returns the sizes aligned with ``ids``. ``checked``: the caller already checked that X fits
        within ``caps`` (the manager does; its caps are the memory caps it keeps by worker name).
        Neither array may change after the call: a policy may recognise them by identity at the
        next decision (the manager passes the same objects until membership or caps change).
        The default goes through :meth:`assign`."""
        ws = ids.tolist()
        capd = {w: int(c) for w, c in zip(ws, caps.tolist()) if c != math.inf}
        sizes = self.assign(ws, global_batch, min_batch, max_batch=capd or None)
        if sorted(sizes) != ws:
            raise RuntimeError(f"batch policy {self.name or type(self).__name__} answered for "
                               f"workers {sorted(sizes)}, live are {ws}")
        return np.array([sizes[w] for w in ws], dtype=np.int64)

    def close(self) -> None:
        """Release background resources (a refit thread or process); the policy stays usable."""

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state for checkpoints (stateless policies: empty)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


#: Batch policy classes by name (``mode.batch_policy``); add one with ``@register_policy(name)``.
BATCH_POLICIES: Registry[type[BatchPolicy]] = Registry("batch policy", base=BatchPolicy)
register_policy = BATCH_POLICIES.register
policy_names = BATCH_POLICIES.names


def get_policy(name: str, **args: Any) -> BatchPolicy:
    """Instantiate a registered policy; unknown names and bad arguments give clear errors."""
    return BATCH_POLICIES.create(name, **args)


@register_policy("uniform")
class UniformPolicy(BatchPolicy):
    """Plain BSP: x_i = X / N (the remainder to the lowest ids)."""

    native_arrays = True

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        if max_batch is None:
            return uniform_split(sorted(workers), global_batch)
        # Equal shares up to the caps; what capped workers cannot take goes to the others.
        return bounded_split({w: 1.0 for w in workers}, global_batch, min_batch, max_batch)

    def observe_batch(self, batch: ReportBatch) -> None:
        pass

    def assign_arrays(self, ids: np.ndarray, global_batch: int, min_batch: int,
                      caps: np.ndarray, *, checked: bool = False) -> np.ndarray:
        n = ids.size
        if not np.isfinite(caps).any() or (caps >= global_batch).all():
            # no binding cap: X // N each, the remainder to the lowest ids (as uniform_split)
            out = np.full(n, global_batch // n, dtype=np.int64)
            out[: global_batch % n] += 1
            return out
        return bounded_split_arrays(np.ones(n), global_batch, min_batch, caps)


@register_policy("fixed")
class FixedWeightsPolicy(BatchPolicy):
    """Fixed shares by worker id (``weights: {id: w}`` or a list indexed by id).

    Useful for tests of uneven batches and for hand-tuned splits; workers without a weight
    get weight 1.
    """

    def __init__(self, weights: Mapping[int, float] | Sequence[float] = ()) -> None:
        if isinstance(weights, Mapping):
            self.weights = {int(k): float(v) for k, v in weights.items()}
        else:
            self.weights = {i: float(v) for i, v in enumerate(weights)}
        if any(v <= 0 for v in self.weights.values()):
            raise ValueError("weights must be positive")

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        shares = {w: self.weights.get(w, 1.0) for w in sorted(workers)}
        if max_batch is None:
            return proportional_split(shares, global_batch, min_batch)
        return bounded_split(shares, global_batch, min_batch, max_batch)
