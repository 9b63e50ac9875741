"""How a shard's update threads wait between updates (``cluster.shard_threads`` > 1).

libgomp, the OpenMP runtime of torch's Linux builds, keeps the threads of a parallel step
spinning for a while after it ends (GOMP_SPINCOUNT polls, milliseconds), in case the next step
follows at once. A shard runs a few large parallel steps per iteration (the finiteness sum of
each gradient, the update) and then waits for the network, so its threads spun through most of
the iteration and took the cores that ZeroMQ's I/O threads and the other processes needed: on
the 2-core VM, two shards with two threads each took 60.9 ms per 1-worker exchange against 31.1
with ``OMP_WAIT_POLICY=PASSIVE``, which makes them sleep instead (``bench_dataplane.py --shards 2
--shard-threads 1 2``, docs/performance.md). The runtime reads the variable once, when torch
loads it, so it must be in the environment before the process imports torch: ``ps-server``
sets it first thing, and whoever starts shards otherwise (a benchmark's spawned processes)
calls :func:`sleep_between_updates` before they start. A policy the user set is kept.
"""

from __future__ import annotations

import os
from typing import MutableMapping

WAIT_POLICY = "OMP_WAIT_POLICY"


def sleep_between_updates(environ: MutableMapping[str, str] = os.environ) -> None:
    """Let update threads sleep between parallel steps, unless a wait policy is set already.
    Takes effect only in processes that import torch after this call."""
    environ.setdefault(WAIT_POLICY, "PASSIVE")
