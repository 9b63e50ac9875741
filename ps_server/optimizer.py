"""Server-side optimizer over a shard's flat float32 slice (torch.optim.SGD's rules).

A shard's update is bandwidth-bound: every pass over the slice costs about a millisecond per
5M parameters. :meth:`SGD.step_weighted` takes the committed gradients with their weights
x_i / sum(x_i) and fuses the aggregation into the momentum buffer with torch's in-place
``add_(alpha=...)`` (one pass per gradient), so plain momentum SGD costs 2 + N passes instead of
the 3N + 5 of aggregate-then-step. Weight decay and Nesterov take the general path.

Both paths run a block of :data:`BLOCK` elements per torch thread at a time (or a shard's part
of a streamed answer, if smaller) through all their passes, so that
the block's momentum, gradients and parameters stay in the CPU cache from one pass to the
next: memory then sees about one read of each array and one write of each result, instead of
one per pass (between two commits the whole slice has left the cache). Each element goes
through the same operations in the same order as unblocked, so the bits are the same.

Parameters are never updated in place: the step returns a NEW array, because older ones may
still be referenced by zero-copy sends in flight and must never change under them.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch

from ps_common.config import OptimizerConfig

# Received gradients are read-only views of ZeroMQ frames; torch only reads them here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


#: Elements per block of the update and per torch thread: 2 MB of float32 per array, so that a
#: block's momentum, gradients, parameters and result (8-10 MB) stay in this VM's 32 MB L3 cache
#: between their passes. Measured with one thread, arrays out of the cache
#: (``benchmarks/bench_update_blocks.py``): 0.78-0.86 of the time of the whole slice at once, for
#: 5M and 10M parameters and one or two gradients. With ``cluster.shard_threads`` T a block holds
#: T times as many elements (:func:`block_elements`), so that each thread's share of a pass stays
#: as large: on a 16-core host with 8 threads, blocks of this size alone cost 1.44-1.71x the
#: whole slice's time (2 + N parallel steps per block, each waking the threads), and even blocks
#: of 1,048,576 cost 1.15-1.31x (``docs/results/speed_checks_h100_2026-11-28/blocks.txt``).
BLOCK = 1 << 19


def block_elements(threads: int | None = None) -> int:
    """Elements per block of the update with ``threads`` torch threads (default: torch's now)."""
    return BLOCK * max(1, threads if threads is not None else torch.get_num_threads())


def _weighted_sum(grads: list[tuple[torch.Tensor, float]], out: torch.Tensor) -> None:
    """``out`` = sum(w_i g_i), added in the order given (the order fixes the bits)."""
    (g0, w0), rest = grads[0], grads[1:]
    torch.mul(g0, w0, out=out)
    for g, w in rest:
        out.add_(g, alpha=w)


def all_finite(a: np.ndarray) -> bool:
    """No NaN or Inf in the float32/float64 array ``a``, in one read pass: a sum is finite only
    if every term is (a sum that overflows is refused too, as no update could use it). torch
    sums 10M float32 in 1.2 ms here, numpy in 2.0 ms; ``np.isfinite(a).all()`` writes a mask and
    takes 12.6 ms."""
    return bool(np.isfinite(float(_t(a).sum())))


class SGD:
    """SGD with momentum, weight decay and Nesterov, matching ``torch.optim.SGD`` (dampening 0)."""

    def __init__(self, cfg: OptimizerConfig, size: int) -> None:
        self.lr = cfg.lr
        self.momentum = cfg.momentum
        self.weight_decay = cfg.weight_decay
        self.nesterov = cfg.nesterov
        self.buf = np.zeros(size, dtype=np.float32) if cfg.momentum else None
        self._has_buf = False
        self._acc = np.empty(size, dtype=np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray, lr_scale: float = 1.0) -> np.ndarray:
        return self.step_weighted(params, [(grad, 1.0)], lr_scale)

    def step_weighted(self, params: np.ndarray, grads: list[tuple[np.ndarray, float]],
                      lr_scale: float = 1.0, out: np.ndarray | None = None,
                      done: Callable[[int], None] | None = None, block: int | None = None) -> np.ndarray:
        """One step with gradient d = sum(w_i g_i) (in the order given); returns the new
        parameters, in ``out`` if given (a free buffer, never ``params``). ``done(end)`` is
        called after each block with the end of the prefix ``result[:end]`` that is final
        (the shard streams it to the workers while the rest is computed); ``block`` overrides
        :func:`block_elements` (a streaming shard's parts, benchmarks, tests)."""
        result = out if out is not None else np.empty_like(params)
        p, r = _t(params), _t(result)
        gs = [(_t(g), w) for g, w in grads]
        buf = None if self.buf is None else _t(self.buf)
        acc = _t(self._acc)
        lr = self.lr * lr_scale
        step = block or block_elements()
        for start in range(0, params.size, step):
            part = slice(start, start + step)
            self._step_block(p[part], [(g[part], w) for g, w in gs], r[part],
                             None if buf is None else buf[part], acc[part], lr)
            if done is not None:
                done(min(start + step, params.size))
        if buf is not None:
            self._has_buf = True
        return result

    def _step_block(self, p: torch.Tensor, grads: list[tuple[torch.Tensor, float]], out: torch.Tensor,
                    buf: torch.Tensor | None, acc: torch.Tensor, lr: float) -> None:
        """The step on one block of the slice (views of the whole arrays)."""
        if buf is not None and not self.weight_decay and not self.nesterov:
            if self._has_buf:
                buf.mul_(self.momentum)
                for g, w in grads:
                    buf.add_(g, alpha=w)
            else:
                _weighted_sum(grads, buf)
            torch.add(p, buf, alpha=-lr, out=out)
            return
        d = acc
        _weighted_sum(grads, d)
        if self.weight_decay:
            d.add_(p, alpha=self.weight_decay)
        if buf is not None:
            if self._has_buf:
                buf.mul_(self.momentum).add_(d)
            else:
                buf.copy_(d)
            d = d.add(buf, alpha=self.momentum) if self.nesterov else buf
        torch.add(p, d, alpha=-lr, out=out)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"momentum_buffer": self.buf} if self.buf is not None and self._has_buf else {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        buf = arrays.get("momentum_buffer")
        if self.buf is not None and buf is not None:
            if buf.shape != self.buf.shape:
                raise ValueError(f"momentum buffer of shape {buf.shape}, expected {self.buf.shape}")
            np.copyto(self.buf, buf)
            self._has_buf = True
        elif self.buf is not None:
            self.buf.fill(0.0)
            self._has_buf = False
