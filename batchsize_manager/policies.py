"""Batch policies: how the global batch X is split over the live workers each iteration.

A policy is pure decision logic (no sockets, no clocks of its own): the coordinator tells it
who joined and left, feeds it each worker's per-iteration report, and asks for the next split.
LB-BSP's predictive policies plug in here through the same interface and registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from batchsize_manager.allocation import CapsArg, bounded_split, proportional_split, uniform_split


@dataclass(frozen=True)
class WorkerReport:
    """One worker's measurements for one iteration (from its telemetry)."""

    worker_id: int
    iteration: int
    batch_size: int
    compute_s: float
    iteration_s: float
    telemetry: Mapping[str, float] = field(default_factory=dict)


class BatchPolicy(ABC):
    """Decides {worker: batch size} with sum exactly ``global_batch``."""

    name: str = ""

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
        all, a ``{worker: cap}`` mapping (missing = uncapped) or None. Policies written before
        caps existed may omit the keyword; :class:`~batchsize_manager.manager.BatchSizeManager`
        then checks their answer against the caps instead.
        """

    def memory_caps(self) -> dict[int, int]:
        """Per-worker batch caps the policy knows of (from config or learned from OOM reports)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state for checkpoints (stateless policies: empty)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


_REGISTRY: dict[str, Callable[..., BatchPolicy]] = {}


def register_policy(name: str) -> Callable[[type[BatchPolicy]], type[BatchPolicy]]:
    def deco(cls: type[BatchPolicy]) -> type[BatchPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **args: Any) -> BatchPolicy:
    """Instantiate a registered policy; unknown names and bad arguments give clear errors."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown batch policy {name!r}; known: {', '.join(policy_names())}") from None
    try:
        return cls(**args)
    except TypeError as exc:
        raise ValueError(f"batch policy {name!r}: bad arguments {args}: {exc}") from None


@register_policy("uniform")
class UniformPolicy(BatchPolicy):
    """Plain BSP: x_i = X / N (the remainder to the lowest ids)."""

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        if max_batch is None:
            return uniform_split(sorted(workers), global_batch)
        # Equal shares up to the caps; what capped workers cannot take goes to the others.
        return bounded_split({w: 1.0 for w in workers}, global_batch, min_batch, max_batch)


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
