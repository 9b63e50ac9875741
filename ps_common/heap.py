"""glibc's heap policy for the processes that move a model's worth of bytes every iteration.

Why: libzmq allocates every received frame with ``malloc``, and glibc serves a block above its
mmap threshold with a fresh ``mmap`` and unmaps it on ``free``, so each such frame faults all
its pages in again. The threshold rises by itself to the largest block freed, but never above
32 MB, so a frame over 32 MB (a shard's slice of a model over 8M float32 parameters) pays that
on every push and every reply. Measured here (``docs/results/ddp_vs_ps/dataplane_2026-11-27/``):
one 40 MB round trip over loopback took 39-67 ms in one frame, 20-32 ms in 2 to 32 frames, and
25 ms in one frame with the heap kept as below (``benchmarks/bench_pipelining.py``); a push and
pull of 10M parameters through one shard (``bench_dataplane.py``) 82.1 -> 39.9 ms, two workers
on it 130.4 -> 66.4 ms. A forward pass's activations (1-2 MB each) were unmapped and faulted in
again the same way before the threshold had risen.

:func:`keep_freed_memory` serves every block from the heap (``M_MMAP_MAX`` 0) and keeps what is
freed for reuse (``M_TRIM_THRESHOLD`` 1 GiB): resident memory then stays at the process's peak,
which for a shard, a worker and the evaluator is its steady state. A process whose memory is
measured against a limit (a worker under ``RLIMIT_AS``) calls :func:`return_freed_memory`
first, which restores glibc's defaults and returns the free heap top to the kernel.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

#: glibc's defaults (malloc/malloc.c): 128 KB thresholds, at most 65,536 mmapped blocks
_DEFAULT_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_MAX = 65536
KEEP_BYTES = 1 << 30


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)   # the C library this process runs on
        libc.mallopt  # noqa: B018  (absent where the C library is not glibc)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and keep freed memory for reuse; False where the C
    library is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))


def return_freed_memory() -> bool:
    """glibc's default policy again (blocks over 128 KB mmapped, a free heap top over 128 KB
    returned), and the free heap top returned now: the process's address space is then what it
    uses. False where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    ok = (libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX) and libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
          and libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD))
    libc.malloc_trim(0)
    return bool(ok)
