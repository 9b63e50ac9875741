"""Resource telemetry a worker sends with every push (psutil; GPU memory on CUDA).

Reading /proc costs about 0.3 ms, a few percent of a short iteration, so a background thread
samples every ``period_s`` and :meth:`ResourceProbe.sample` returns the latest reading: the
critical path pays nothing (a reading is an immutable ``Telemetry`` holding only the resource
fields). The values are averages over the last period, which is what a per-iteration predictor
input can use anyway.
"""

from __future__ import annotations

import threading

import psutil

from ps_common.report import Telemetry
from ps_common.timeouts import DEFAULT_TIMEOUTS


class ResourceProbe:
    """Process and host CPU (% over the last period), memory; sampled off the critical path."""

    def __init__(self, device: str = "cpu", period_s: float = 0.25) -> None:
        self.proc = psutil.Process()
        self.ncpu = psutil.cpu_count() or 1
        self.device = device
        self.period_s = period_s
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)
        self._latest = self._read()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "ResourceProbe":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DEFAULT_TIMEOUTS.probe_stop_s)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._latest = self._read()

    def sample(self, device: str | None = None) -> Telemetry:
        """The latest reading (a fresh one if the background thread is not running)."""
        if self._thread is None:
            self._latest = self._read(device)
        return self._latest

    def _read(self, device: str | None = None) -> Telemetry:
        """The resource fields of :class:`Telemetry`, everything else left at its default."""
        device = device or self.device
        vm = psutil.virtual_memory()
        proc_cpu = float(self.proc.cpu_percent(None))
        host_cpu = float(psutil.cpu_percent(None))
        gpu_free = gpu_total = gpu_alloc = None
        if device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(device))
            gpu_free, gpu_total = free / 2**20, total / 2**20
            gpu_alloc = torch.cuda.memory_allocated(torch.device(device)) / 2**20
        return Telemetry(proc_cpu=proc_cpu, host_cpu=host_cpu,
                         cotenant_cpu=max(0.0, host_cpu - proc_cpu / self.ncpu),
                         rss_mb=self.proc.memory_info().rss / 2**20, host_mem_pct=float(vm.percent),
                         gpu_mem_free_mb=gpu_free, gpu_mem_total_mb=gpu_total, gpu_mem_alloc_mb=gpu_alloc)
