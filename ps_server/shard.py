"""One shard's state: its slice of the parameters, optimizer, version and aggregation buffers."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ps_common.config import OptimizerConfig
from ps_server.optimizer import SGD
from ps_server.sync import Apply, PushOutcome, PushRejected, SyncPolicy


class ShardState:
    """Validates pushes, hands them to the sync policy, applies the weighted updates.

    Aggregation g = sum(x_i g_i) / sum(x_i) runs in preallocated float32 buffers; a gradient
    that fails validation never reaches the policy, so parameters stay exactly as they were.
    """

    def __init__(self, shard: int, params: np.ndarray, opt_cfg: OptimizerConfig, sync: SyncPolicy,
                 *, reject_nonfinite: bool = True, clock: Callable[[], float] = time.time,
                 snapshot_every: int = 0, max_snapshots: int = 8) -> None:
        if params.dtype != np.float32 or params.ndim != 1:
            raise ValueError("shard parameters must be a flat float32 vector")
        self.shard = shard
        self.params = params
        self.size = params.size
        self.optimizer = SGD(opt_cfg, self.size)
        self.sync = sync
        self.reject_nonfinite = reject_nonfinite
        self.clock = clock
        self.version = 0
        self.version_time = clock()
        self._acc = np.zeros(self.size, dtype=np.float32)
        self._scratch = np.empty(self.size, dtype=np.float32)
        self.rejected: dict[str, int] = {}
        self.dropped = 0
        self.samples_applied = 0
        self.lr_factors: dict[int, float] = {}  # iteration -> elastic learning-rate factor
        # Parameters at every ``snapshot_every``-th version, so the evaluator measures exactly
        # those versions even when it falls behind. Updates are out of place, so a snapshot is
        # a reference, not a copy; at most ``max_snapshots`` are kept.
        self.snapshot_every = snapshot_every
        self.max_snapshots = max_snapshots
        self.snapshots: dict[int, tuple[np.ndarray, float, int]] = {}
        self._snapshot()

    def _snapshot(self) -> None:
        if self.snapshot_every and self.version % self.snapshot_every == 0:
            self.snapshots[self.version] = (self.params, self.version_time, self.samples_applied)
            while len(self.snapshots) > self.max_snapshots:
                del self.snapshots[next(iter(self.snapshots))]

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"params": self.params, **self.optimizer.state_arrays()}

    def state_meta(self) -> dict[str, float | int]:
        return {"version": self.version, "samples_applied": self.samples_applied,
                "version_time": self.version_time}

    def restore(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Back to a checkpoint: parameters, optimizer state, version; pending work is dropped."""
        params = arrays["params"]
        if params.dtype != np.float32 or params.shape != (self.size,):
            raise ValueError(f"checkpoint holds {params.dtype}{list(params.shape)}, shard has float32[{self.size}]")
        self.params = params.copy()
        self.optimizer.load_state_arrays(arrays)
        self.version = int(meta["version"])
        self.samples_applied = int(meta["samples_applied"])
        self.version_time = self.clock()
        self.sync.reset()
        self.lr_factors = {}
        self.snapshots = {}
        self._snapshot()

    def push(self, worker_id: int, iteration: int, batch_size: int, expected_workers: int,
             global_batch: int, grad: np.ndarray, lr_scale: float = 1.0) -> list[Apply]:
        """Record a gradient; return the updates it completed (already applied)."""
        try:
            if not (np.isfinite(lr_scale) and 0 < lr_scale <= 64):
                raise PushRejected("bad_plan", f"lr_scale {lr_scale} out of (0, 64]")
            known = self.lr_factors.get(iteration)
            if self.sync.kind == "round" and known is not None and known != lr_scale:
                raise PushRejected("bad_plan", f"lr_scale {lr_scale} differs from {known} for iteration {iteration}")
            if grad.dtype != np.float32 or grad.shape != (self.size,):
                raise PushRejected(
                    "bad_shape", f"shard {self.shard} expects float32[{self.size}], got "
                    f"{grad.dtype}{list(grad.shape)}")
            if self.reject_nonfinite and not np.isfinite(np.sum(grad, dtype=np.float64)):
                raise PushRejected("nonfinite", f"gradient from worker {worker_id} has NaN or Inf")
            outcome = self.sync.on_push(self.version, worker_id, iteration, batch_size,
                                        expected_workers, global_batch, grad)
            if self.sync.kind == "round" and iteration >= self.version:
                self.lr_factors[iteration] = lr_scale
        except PushRejected as exc:
            self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
            raise
        return self._carry_out(outcome)

    def commit(self, iteration: int, accepted: dict[int, int], global_batch: int) -> list[Apply]:
        """The coordinator fixed which gradients make up ``iteration``."""
        return self._carry_out(self.sync.on_commit(self.version, iteration, accepted, global_batch))

    def _carry_out(self, outcome: PushOutcome) -> list[Apply]:
        self.dropped += outcome.dropped
        for a in outcome.applies:
            self._apply(a)
        return outcome.applies

    def _apply(self, a: Apply) -> None:
        acc, scratch = self._acc, self._scratch
        acc.fill(0.0)
        total = 0
        for g in a.gradients:
            np.multiply(g.grad, np.float32(g.batch_size), out=scratch)
            acc += scratch
            total += g.batch_size
        acc /= np.float32(total)
        factor = self.lr_factors.pop(a.iteration, 1.0) if self.sync.kind == "round" else 1.0
        self.lr_factors = {t: f for t, f in self.lr_factors.items() if t > a.iteration}
        self.params = self.optimizer.step(self.params, acc, lr_scale=a.lr_scale * factor)
        self.samples_applied += total
        self.version += 1
        self.version_time = self.clock()
        self._snapshot()
