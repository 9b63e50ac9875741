"""A shard's update in blocks against the whole slice at once, with the arrays out of the cache.

Why: between two commits a shard's momentum, parameters and the gradients it is sent have left
the CPU cache, so each of the update's 2 + N passes (``ps_server/optimizer.py``) reads them
from memory again. Run a block at a time through every pass, a block's arrays stay in the
cache from one pass to the next. This times :meth:`ps_server.optimizer.SGD.step_weighted` with
blocks of the whole slice (one block: the passes as before), of smaller fixed sizes and of the
shard's own choice (``block_elements()``: ``BLOCK`` per torch thread), alternating, each step
after streaming 96 MB through the caches (as the transfers between two commits do), and once
without that ("hot").

Usage::

    python benchmarks/bench_update_blocks.py [--params 5000000] [--grads 1 2] [--steps 25] [--threads 1]

``--threads T``: torch threads for the update (``cluster.shard_threads``), which split each
pass of a block among them, as in a shard.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ps_common.config import OptimizerConfig  # noqa: E402
from ps_server import optimizer  # noqa: E402

BLOCKS = (1 << 17, 1 << 18, 1 << 19, 1 << 20)


def measure(n: int, n_grads: int, steps: int, cold: bool) -> dict[str, list[float]]:
    """ms per step for each block size (label), the same steps alternating between them."""
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n).astype(np.float32), 1.0 / n_grads) for _ in range(n_grads)]
    junk = np.ones(24_000_000, dtype=np.float32)        # 96 MB, three times this VM's L3
    cfg = OptimizerConfig(lr=0.01, momentum=0.9)
    labels = {f"whole slice ({n:,})": n, **{f"{b:,}": b for b in BLOCKS},
              f"the shard's ({optimizer.block_elements():,})": optimizer.block_elements()}
    opts = {label: optimizer.SGD(cfg, n) for label in labels}
    outs = {label: np.empty(n, dtype=np.float32) for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    for step in range(steps + 2):
        for label, block in labels.items():
            if cold:
                junk += 1.0
            t0 = time.perf_counter()
            opts[label].step_weighted(params, grads, out=outs[label], block=block)
            if step >= 2:                          # the first two: the momentum's first step, warm-up
                times[label].append((time.perf_counter() - t0) * 1e3)
    first = next(iter(outs.values()))
    assert all(np.array_equal(first, o) for o in outs.values()), "blocks changed the bits"
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=5_000_000, help="elements in the slice (a shard of 10M: 5M)")
    ap.add_argument("--grads", type=int, nargs="+", default=[1, 2], help="gradients per commit")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (ps-server's default: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"## The update of {args.params:,} float32 parameters (SGD, momentum 0.9), ms per step: "
          f"median / mean / p95 of {args.steps} steps, block sizes alternating; torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s); the results of every block size "
          "are checked bit-identical\n")
    print("| gradients | caches | block (elements) | median | mean | p95 | median / whole slice |")
    print("|---|---|---|---|---|---|---|")
    for n_grads in args.grads:
        for cold in (True, False):
            times = measure(args.params, n_grads, args.steps, cold)
            base = statistics.median(next(iter(times.values())))
            for label, ts in times.items():
                ts_sorted = sorted(ts)
                p95 = ts_sorted[min(len(ts) - 1, int(0.95 * len(ts)))]
                med = statistics.median(ts)
                print(f"| {n_grads} | {'cold' if cold else 'hot'} | {label} | {med:.2f} | "
                      f"{statistics.fmean(ts):.2f} | {p95:.2f} | {med / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
