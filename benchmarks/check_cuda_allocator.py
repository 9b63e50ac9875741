"""Does a per-process CUDA memory fraction still hold with expandable segments, and how much more
fits under it? cnn1m forward + backward passes under a 3000 MB fraction at batch sizes that go
up, down and up again (as LB-BSP moves them); prints the allocated and reserved peaks and where
an allocation fails. Run it twice, with the allocator's default and with the setting CUDA
workers use (ps_worker/memory.py, choose_cuda_allocator):

    python benchmarks/check_cuda_allocator.py
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/check_cuda_allocator.py

Needs a CUDA device (results on an H100: docs/results/gpu_h100/allocator_*.txt).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ps_ml.models import build_model  # noqa: E402

LIMIT_MB = 3000
SIZES = [2048, 3072, 4096, 3000, 4608, 5120, 5632, 6144, 7168]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(LIMIT_MB * 2**20 / total, dev)
    net = build_model("cnn1m", seed=0).to(dev)
    print("PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    for b in SIZES:
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            x = torch.randn(b, 1, 28, 28, device=dev)
            y = torch.randint(0, 10, (b,), device=dev)
            net.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            torch.cuda.synchronize(dev)
            print(f"{b}: fits, peak allocated {torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MB, "
                  f"peak reserved {torch.cuda.max_memory_reserved(dev) / 2**20:.0f} MB")
        except torch.OutOfMemoryError:
            print(f"{b}: out of memory (reserved {torch.cuda.memory_reserved(dev) / 2**20:.0f} MB)")
        x = y = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
