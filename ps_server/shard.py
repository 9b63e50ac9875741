"""One shard's state: its slice of the parameters, optimizer, version, received gradients.

A shard never decides what to apply. It holds the gradients workers pushed (read-only views of
the received frames) until the coordinator's commit names the ones that make up the next
version, then applies exactly those: g = sum(x_i g_i) / sum(x_i), summed in worker-id order so
the bits do not depend on arrival order. Every shard therefore goes through the same versions,
and ``log_hash`` (a digest chained over every applied commit) proves it: two shards at the same
version with the same hash applied the same gradient sets.

Applying a commit settles its bookkeeping at once (version, history, settled iterations) and
leaves the arithmetic pending, so that the server can send each piece of the new parameters
while the rest is computed (:meth:`ShardState.finish_update`). Reading :attr:`ShardState.params`
or any optimizer state finishes a pending update first, so nothing else ever sees half of one.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from ps_common.config import OptimizerConfig
from ps_common.errors import PsError
from ps_server.optimizer import SGD, all_finite

GENESIS_HASH = "0" * 16
#: Workers whose last settled iteration a shard remembers, the least recently settled forgotten
#: first. An async pull waits for its own push's entry, settled one commit before it is answered;
#: the rest are departed workers', which nothing else would ever remove.
MAX_SETTLED = 100_000


def next_log_hash(prev: str, version: int, iteration: int, entries: Sequence[Sequence[int]],
                  lr_scale: float) -> str:
    """The digest after applying one commit: chained, so equal hashes mean equal histories."""
    text = f"{prev}|{version}|{iteration}|{[list(e) for e in entries]}|{float(lr_scale)!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class GradientRejected(PsError, ValueError):
    """A pushed gradient that must not be stored; ``code`` for the Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class MissingGradient(PsError, RuntimeError):
    """A commit names a gradient this shard does not hold: it cannot apply it."""


@dataclass
class Held:
    batch_size: int
    grad: np.ndarray  # read-only view of the received frame


@dataclass
class PendingUpdate:
    """The arithmetic of an applied commit, not done yet: ``out`` becomes the new parameters."""

    base: np.ndarray
    grads: list[tuple[np.ndarray, float]]
    lr_scale: float
    out: np.ndarray


class Snapshot(NamedTuple):
    """A kept version: its parameters (a reference), when it was made, the samples applied by
    then, and its log hash, so that a measurement of it can prove which history it is of."""

    params: np.ndarray
    version_time: float
    samples: int
    log_hash: str


@dataclass
class Applied:
    version: int
    iteration: int
    entries: list[list[int]]
    samples: int
    log_hash: str


class ShardState:
    def __init__(self, shard: int, params: np.ndarray, opt_cfg: OptimizerConfig, *,
                 reject_nonfinite: bool = True, clock: Callable[[], float] = time.time,
                 snapshot_every: int = 0, max_snapshots: int = 8, max_held_per_worker: int = 4) -> None:
        if params.dtype != np.float32 or params.ndim != 1:
            raise ValueError("shard parameters must be a flat float32 vector")
        self.shard = shard
        self._params = params
        self._pending: PendingUpdate | None = None
        self._finishing = False
        self.size = params.size
        self.optimizer = SGD(opt_cfg, self.size)
        self.reject_nonfinite = reject_nonfinite
        self.clock = clock
        self.version = 0
        self.log_hash = GENESIS_HASH
        self.version_time = clock()
        self.samples_applied = 0
        self.max_held_per_worker = max_held_per_worker
        self.max_buffers = max_snapshots + 4
        self._pool: list[np.ndarray] = []
        self.held: dict[tuple[int, int], Held] = {}
        self._held_per_worker: dict[int, int] = {}
        # worker -> 1 + the highest iteration of its gradients applied or dropped here: an async
        # worker's next parameters wait until its previous gradient is settled (it reads its own
        # writes, as it would on one server).
        self.settled: dict[int, int] = {}
        self.dropped = 0
        # Parameters at every ``snapshot_every``-th version, so the evaluator measures exactly
        # those versions even when it falls behind. Updates are out of place, so a snapshot is
        # a reference, not a copy; at most ``max_snapshots`` are kept.
        self.snapshot_every = snapshot_every
        self.max_snapshots = max_snapshots
        self._snapshots: dict[int, Snapshot] = {}
        self._snapshot()

    # ----- receiving ------------------------------------------------------------------------
    def receive(self, worker: int, iteration: int, batch_size: int, grad: np.ndarray) -> None:
        """Hold a validated gradient until a commit applies or drops it."""
        if grad.dtype != np.float32 or grad.shape != (self.size,):
            raise GradientRejected("bad_shape", f"shard {self.shard} expects float32[{self.size}], got "
                                                f"{grad.dtype}{list(grad.shape)}")
        if self.reject_nonfinite and not all_finite(grad):  # a NaN or Inf anywhere (or an overflow)
            raise GradientRejected("nonfinite", f"gradient from worker {worker} has NaN or Inf")
        key = (worker, iteration)
        if key in self.held:
            raise GradientRejected("duplicate", f"worker {worker} already pushed iteration {iteration}")
        if self._held_per_worker.get(worker, 0) >= self.max_held_per_worker:
            raise GradientRejected("busy", f"worker {worker} has {self.max_held_per_worker} "
                                           "uncommitted gradients here")
        self.held[key] = Held(batch_size, grad)
        self._held_per_worker[worker] = self._held_per_worker.get(worker, 0) + 1

    def holds(self) -> list[list[int]]:
        return [[w, t, h.batch_size] for (w, t), h in self.held.items()]

    def drop(self, keys: Iterable[Sequence[int]]) -> int:
        """Forget the named gradients: ``[worker, iteration]`` whatever its size, ``[worker,
        iteration, batch_size]`` only where held at that size. The sized form discards a push
        that one shard held at a size nobody assigned without touching the assigned one that
        another shard may already hold under the same key (async modes: the drop and the
        worker's next pushes race)."""
        n = 0
        for key in keys:
            w, t = int(key[0]), int(key[1])
            if len(key) > 2:
                h = self.held.get((w, t))
                if h is None or h.batch_size != int(key[2]):
                    continue
            self._settle(w, t)
            if self._forget((w, t)):
                n += 1
        self.dropped += n
        return n

    def _settle(self, worker: int, iteration: int) -> None:
        if self.settled.get(worker, 0) <= iteration:
            self.settled.pop(worker, None)      # re-inserted last: the order is recency
            self.settled[worker] = iteration + 1
            if len(self.settled) > MAX_SETTLED:  # worker ids are never reused: departed ones go
                del self.settled[next(iter(self.settled))]

    def drop_all(self) -> int:
        """Forget every gradient held (the job stops, or goes back to a checkpoint)."""
        return self.drop(list(self.held))

    def drop_through(self, iteration: int) -> int:
        """Round modes: gradients of iterations up to ``iteration`` can never be applied now."""
        return self.drop([k for k in self.held if k[1] <= iteration])

    def _forget(self, key: tuple[int, int]) -> bool:
        if self.held.pop(key, None) is None:
            return False
        left = self._held_per_worker[key[0]] - 1
        if left:
            self._held_per_worker[key[0]] = left
        else:
            del self._held_per_worker[key[0]]
        return True

    # ----- applying ---------------------------------------------------------------------------
    def check_holds(self, iteration: int, entries: Sequence[Sequence[int]]) -> list[Held]:
        """The held gradients a commit names; MissingGradient if one is not held at its size."""
        grads = []
        for w, x in entries:
            h = self.held.get((int(w), iteration))
            if h is None or h.batch_size != x:
                raise MissingGradient(f"shard {self.shard} does not hold worker {w}'s gradient of "
                                      f"iteration {iteration} (batch size {x})")
            grads.append(h)
        return grads

    @property
    def params(self) -> np.ndarray:
        """The parameters of this version, complete (a pending update is finished first)."""
        self.finish_update()
        return self._params

    @property
    def snapshots(self) -> dict[int, Snapshot]:
        """Parameters at every ``snapshot_every``-th version (a pending update's own once done)."""
        self.finish_update()
        return self._snapshots

    @property
    def newest_params(self) -> np.ndarray:
        """This version's parameter buffer, still being written while :attr:`updating`: only
        for sending its pieces from :meth:`finish_update`'s ``done``, never whole."""
        return self._params

    @property
    def updating(self) -> bool:
        """An applied commit's arithmetic is still pending."""
        return self._pending is not None

    def apply(self, iteration: int, entries: Sequence[Sequence[int]], lr_scale: float) -> Applied:
        """Apply one commit: version + 1, its arithmetic left pending (:meth:`finish_update`).
        Raises MissingGradient (state unchanged) when a named gradient is not held here with
        that batch size."""
        self.finish_update()  # the previous commit's, first: the momentum goes from one to the next
        grads = self.check_holds(iteration, entries)
        total = sum(h.batch_size for h in grads)
        if total > 0:
            out = self._free_buffer()
            self._pending = PendingUpdate(self._params, [(h.grad, h.batch_size / total) for h in grads],
                                          lr_scale, out)
            self._params = out
        for w, _ in entries:
            self._forget((int(w), iteration))
            self._settle(int(w), iteration)
        self.samples_applied += total
        self.version += 1
        applied = [[int(w), int(x)] for w, x in entries]
        self.log_hash = next_log_hash(self.log_hash, self.version, iteration, applied, lr_scale)
        self.version_time = self.clock()
        if self._pending is None:
            self._snapshot()
        return Applied(self.version, iteration, applied, total, self.log_hash)

    def finish_update(self, done: Callable[[int], None] | None = None, block: int | None = None) -> None:
        """Do a pending update's arithmetic, if any, ``block`` elements at a time (default: the
        optimizer's); ``done(end)`` is called each time the prefix ``newest_params[:end]`` is
        final (and must not read :attr:`params`)."""
        pending = self._pending
        if pending is None:
            return
        if self._finishing:  # ``done`` read the state: it would see half an update
            raise RuntimeError("the shard's state was read while its update was being computed")
        self._finishing = True
        try:
            self.optimizer.step_weighted(pending.base, pending.grads, pending.lr_scale, out=pending.out,
                                         done=done, block=block)
            if done is not None:
                done(self.size)  # (every block has said so already; a repeat hands out nothing)
        finally:
            self._finishing = False
        self._pending = None
        self._snapshot()

    def snapshot_at(self, version: int) -> Snapshot | None:
        """The snapshot of ``version``, if kept; only this version's own waits for its update."""
        if version == self.version:
            self.finish_update()
        return self._snapshots.get(version)

    def _free_buffer(self) -> np.ndarray:
        """A parameter buffer nothing else holds any more (no send in flight, no snapshot, not
        the current version), reused instead of a fresh allocation: a new 20 MB array costs its
        page faults on every step (about 4 ms per 5M parameters here)."""
        for buf in self._pool:
            # held by the pool list, this loop and getrefcount itself: nobody else
            if buf is not self._params and sys.getrefcount(buf) <= 3:
                return buf
        buf = np.empty(self.size, dtype=np.float32)
        if len(self._pool) < self.max_buffers:
            self._pool.append(buf)
        return buf

    def _snapshot(self) -> None:
        if self.snapshot_every and self.version % self.snapshot_every == 0:
            self._snapshots[self.version] = Snapshot(self._params, self.version_time, self.samples_applied,
                                                     self.log_hash)
            while len(self._snapshots) > self.max_snapshots:
                del self._snapshots[next(iter(self._snapshots))]

    # ----- checkpoints ------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays of this version. Parameters are replaced, never mutated; the momentum buffer
        is copied because the next step updates it in place (a background writer may still be
        saving it)."""
        arrays = {"params": self.params}  # finishes a pending update: the momentum is its too
        for k, v in self.optimizer.state_arrays().items():
            arrays[k] = v.copy()
        return arrays

    def state_meta(self) -> dict[str, float | int | str]:
        return {"version": self.version, "samples_applied": self.samples_applied,
                "version_time": self.version_time, "log_hash": self.log_hash}

    def restore(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Back to a checkpoint: parameters, optimizer state, version; held gradients dropped."""
        params = arrays["params"]
        if params.dtype != np.float32 or params.shape != (self.size,):
            raise ValueError(f"checkpoint holds {params.dtype}{list(params.shape)}, shard has float32[{self.size}]")
        self.finish_update()  # it would write the momentum buffer about to be loaded
        self._params = params.copy()
        self.optimizer.load_state_arrays(arrays)
        self.version = int(meta["version"])
        self.samples_applied = int(meta["samples_applied"])
        self.log_hash = str(meta.get("log_hash", GENESIS_HASH))
        self.rewind()

    def rewind(self) -> None:
        """Back to this very version, as a restore of its checkpoint would leave it: held
        gradients, settled iterations and snapshots dropped (they belong to the iterations the
        job abandons); parameters, optimizer state and history kept."""
        self.finish_update()
        self.version_time = self.clock()
        self.held, self._held_per_worker, self.settled = {}, {}, {}
        self._snapshots = {}
        self._snapshot()
