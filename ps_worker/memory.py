"""A worker's memory for training: a real limit, out-of-memory detection, headroom telemetry.

On CUDA the limit is a per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``)
and an allocation above it raises ``torch.OutOfMemoryError``. On a CPU worker the same path is
made real by the kernel: the limit is an address-space limit (``RLIMIT_AS``) of ``limit_mb``
above what the process holds when training starts, so a forward or backward pass that needs more
fails inside torch's allocator with ``ENOMEM``, exactly where a GPU would. Large allocations are
then kept out of malloc's heap (a fixed mmap threshold: :func:`ps_common.heap.return_freed_memory`,
which undoes the heap a worker keeps otherwise), so what a pass allocated goes back to the kernel
when it is freed, and the address space is an honest measure of what training holds
(a heap keeps freed memory and fragments: a first pass failed at 512 samples under a 64 MB
limit that 700 fit in this way). The price: every large tensor is fresh memory from the kernel,
which made LeNet's passes about 2x slower on this machine, so a CPU worker with a limit is a
test of the out-of-memory path, not a speed benchmark; a GPU pays nothing of the kind. Memory
use still drifts a little (kernels cached per batch shape, :func:`bound_kernel_cache`), which
the manager's search treats as a limit that moved.

A CUDA worker without a configured limit measures against the device (free memory plus what it
holds). Every iteration reports what it could still have used: ``Telemetry.mem_headroom_mb`` (limit
minus the iteration's peak) and ``Telemetry.mem_per_sample_mb`` (its peak above the model's resting
use, per sample).
The BatchSizeManager turns them into a cap before anything fails (:mod:`batchsize_manager.memory`).
"""

from __future__ import annotations

import gc
import logging
import os
import resource
from typing import Any, MutableMapping

import torch

from ps_common.heap import return_freed_memory
from ps_common.report import Telemetry

log = logging.getLogger(__name__)

#: Messages of allocation failures that torch raises as plain RuntimeError on a CPU (the CUDA
#: allocator raises ``torch.OutOfMemoryError``). oneDNN reports a failed scratch allocation as a
#: primitive it could not create.
_OOM_TEXTS = ("can't allocate memory", "not enough memory", "out of memory", "cannot allocate memory",
              "could not create a primitive")
#: oneDNN keeps compiled kernels and their scratch space per input shape, up to 1024 of them by
#: default; LB-BSP changes batch sizes from one iteration to the next, and each new size added
#: about 3 MB of address space (LeNet, measured). A small cache bounds that growth at no measured
#: cost in speed, since a size that changed misses the cache anyway.
ONEDNN_CACHE_CAPACITY = "32"
CUDA_ALLOC_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
CUDA_ALLOC_DEFAULT = "expandable_segments:True"
_MIB = 2.0 ** 20


def is_out_of_memory(exc: BaseException) -> bool:
    """Did this exception come from an allocation that did not fit?"""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXTS)


def _status_kb(*keys: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = float(v.split()[0])
    return out


def bound_kernel_cache() -> None:
    """Bound oneDNN's per-shape kernel cache (unless the user set it); call before the first
    forward pass of the process: oneDNN reads the setting when it first uses the cache."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)


def choose_cuda_allocator(env: MutableMapping[str, str] = os.environ) -> bool:
    """Expandable segments for the CUDA caching allocator, unless the user configured it; call
    before the process's first CUDA call (the allocator reads it once). Returns whether they are on.

    LB-BSP gives a worker a new batch size at many iterations, and with fixed segments the blocks
    cut for one size do not fit the next: measured on an H100 under a 3000 MB fraction, cnn1m
    fitted 4096 samples (2.3 GB allocated, 2.7 GB reserved at the peak) and failed at 4608, where
    with expandable segments 5120 fitted (2.8 GB allocated) and 5632 failed, so the fraction
    still holds. The headroom a worker reports is measured from allocated memory, which then matches
    what fits: four workers at different SM shares ran without an out-of-memory error, where
    fixed segments took 2-3 (docs/results/gpu_h100/)."""
    env.setdefault(CUDA_ALLOC_VARIABLE, CUDA_ALLOC_DEFAULT)
    on = "expandable_segments:true" in env[CUDA_ALLOC_VARIABLE].replace(" ", "").lower()
    if not on:
        log.info("%s=%s: CUDA memory in fixed segments, so changing batch sizes fragment it",
                 CUDA_ALLOC_VARIABLE, env[CUDA_ALLOC_VARIABLE])
    return on


def _start_lazy_threads() -> None:
    """Threads that libraries start on first use would need address space (a stack, a ZeroMQ
    context) under the limit, and libzmq aborts when it cannot start one: start them first.
    pyzmq's zero-copy sends start its garbage-collector thread and context."""
    from zmq.utils.garbage import gc as zmq_gc

    if not zmq_gc.is_alive():
        zmq_gc.start()


class MemoryLimit:
    """The limit a worker trains under (None: no limit, nothing measured), see the module doc."""

    def __init__(self, limit_mb: float | None, device: torch.device) -> None:
        if limit_mb is not None and not limit_mb > 0:
            raise ValueError(f"memory limit must be > 0 MB, got {limit_mb}")
        self.limit_mb = limit_mb
        self.device = device
        self.applied = False
        self.warm = False  #: a first pass ran before the limit (set by the worker)
        self._as_limit_kb = 0.0
        self._base: dict[str, float] = {}
        self._can_reset_peak = True

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def apply(self) -> None:
        """Put the limit in force now (again after a rejoin: threads started since then, such as
        a new heartbeat, are not charged to training)."""
        if self.cuda:
            if self.limit_mb is None:
                # the device's own limit: what is free now plus what this process already holds
                free, _ = torch.cuda.mem_get_info(self.device)
                self._as_limit_kb = (free + torch.cuda.memory_reserved(self.device)) / 1024
                self.applied = True
                return
            total = torch.cuda.get_device_properties(self.device).total_memory
            frac = min(1.0, self.limit_mb * _MIB / total)
            torch.cuda.set_per_process_memory_fraction(frac, self.device)
            self._as_limit_kb = frac * total / 1024
        elif self.limit_mb is None:
            return
        else:
            _start_lazy_threads()
            return_freed_memory()   # the address space is then what the process uses (ps_common.heap)
            gc.collect()
            vm = _status_kb("VmSize")["VmSize"]
            self._as_limit_kb = vm + self.limit_mb * 1024
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            soft = int(self._as_limit_kb * 1024)
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        if not self.applied:
            log.info("memory limit for training: %.0f MB (%s)", self.limit_mb,
                     "CUDA memory fraction" if self.cuda else "address space, RLIMIT_AS")
        self.applied = True

    def lift(self) -> None:
        """Out of force until the next :meth:`apply` (CPU; a CUDA fraction stays)."""
        if self.applied and not self.cuda:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            self.applied = False

    def begin(self) -> None:
        """Before a forward/backward pass: mark the resting use the peak is measured from."""
        if not self.applied:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = {"used": torch.cuda.memory_allocated(self.device) / 1024}
            return
        if self._can_reset_peak:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")          # resets VmHWM, the peak resident size
            except OSError:
                self._can_reset_peak = False
        st = _status_kb("VmSize", "VmRSS")
        self._base = {"vm": st["VmSize"], "rss": st["VmRSS"]}

    def telemetry(self, batch_size: int) -> Telemetry:
        """After a pass that fitted: the memory fields of its report (none without a limit)."""
        if not self.applied or not self._base or batch_size <= 0:
            return Telemetry()
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 1024
            used = max(0.0, peak - self._base["used"])
            head = self._as_limit_kb - peak
        else:
            if not self._can_reset_peak:
                return Telemetry()
            st = _status_kb("VmHWM")
            used = max(0.0, st["VmHWM"] - self._base["rss"])
            head = self._as_limit_kb - self._base["vm"] - used
        return Telemetry(mem_headroom_mb=max(0.0, head) / 1024, mem_per_sample_mb=used / 1024 / batch_size,
                         mem_limit_mb=self._as_limit_kb / 1024 if self.cuda else float(self.limit_mb or 0.0))

    def release(self) -> None:
        """After an out-of-memory error: give back what the failed pass held."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        return {"limit_mb": self.limit_mb, "applied": self.applied}
