"""Resource telemetry a worker sends with every push (psutil; GPU memory on CUDA)."""

from __future__ import annotations

import psutil


class ResourceProbe:
    """Process and host CPU (% since the previous sample), memory; cheap enough per iteration."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)

    def sample(self, device: str = "cpu") -> dict[str, float]:
        vm = psutil.virtual_memory()
        out = {
            "proc_cpu": float(self.proc.cpu_percent(None)),
            "host_cpu": float(psutil.cpu_percent(None)),
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
