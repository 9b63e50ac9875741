"""Resource telemetry a worker sends with every push (psutil; GPU memory on CUDA)."""

from __future__ import annotations

import psutil


class ResourceProbe:
    """Process and host CPU (% since the previous sample), memory; cheap enough per iteration."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.ncpu = psutil.cpu_count() or 1
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)

    def sample(self, device: str = "cpu") -> dict[str, float]:
        """proc_cpu: this process, % of one core; host_cpu: whole host, % of all cores;
        cotenant_cpu: everything else on the host, % of all cores (what steals our cycles)."""
        vm = psutil.virtual_memory()
        proc_cpu = float(self.proc.cpu_percent(None))
        host_cpu = float(psutil.cpu_percent(None))
        out = {
            "proc_cpu": proc_cpu,
            "host_cpu": host_cpu,
            "cotenant_cpu": max(0.0, host_cpu - proc_cpu / self.ncpu),
            "rss_mb": self.proc.memory_info().rss / 2**20,
            "host_mem_pct": float(vm.percent),
        }
        if device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(device))
            out["gpu_mem_free_mb"] = free / 2**20
            out["gpu_mem_total_mb"] = total / 2**20
            out["gpu_mem_alloc_mb"] = torch.cuda.memory_allocated(torch.device(device)) / 2**20
        return out
