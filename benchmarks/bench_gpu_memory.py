"""The GPU half of LB-BSP on a device: the saturation curve, memory caps learned from real
out-of-memory errors, and lbbsp-gpu against uniform and lbbsp-cpu, in one run.

(a) Saturation: forward + backward time of the model on the device at batch sizes 2^k (median
    of ``--passes`` after warm-up, synchronized): flat below a saturation batch on a GPU,
    linear on a CPU. lbbsp-gpu searches instead of predicting because of this curve.
(b) Memory-limited workers: ``len(--limits-mb)`` workers on the device, each with a real memory
    limit (a CUDA per-process memory fraction; on a CPU an address-space limit) and an emulated
    speed (``--slowdowns``). For each policy, a local cluster trains ``--iterations``; printed:
    time per iteration (median, mean, p95 after ``--skip``), out-of-memory retries, the caps the
    manager learned (from the coordinator's events), the last split.

    python benchmarks/bench_gpu_memory.py --device cuda --model cnn1m --global-batch 4096 \\
        --limits-mb 2000,2000,600,600 --slowdowns 1,1,1,2

On a CPU (``--device cpu``, the default here) the same code runs as a smoke test: a limited CPU
worker computes about 2x slower (ps_worker/memory.py says why), so its numbers are not a speed
benchmark. Uses the synthetic dataset (no download).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ps_common.config import load_config  # noqa: E402
from ps_common.metrics import read_jsonl  # noqa: E402
from ps_launcher.launcher import LocalCluster  # noqa: E402
from ps_launcher.summary import percentile  # noqa: E402
from ps_ml.models import build_model  # noqa: E402
from ps_worker.memory import bound_kernel_cache, is_out_of_memory  # noqa: E402


def saturation(model: str, device: str, sizes: list[int],
               passes: int) -> list[tuple[int, float | None, float | None]]:
    """(batch, median seconds of forward + backward, peak MB the CUDA caching allocator reserved
    for the pass, model and gradients included), None where it did not fit (peak None on a CPU)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
        bound_kernel_cache()
    net = build_model(model, seed=0).to(dev)
    out = []
    for b in sizes:
        try:
            x = torch.randn(b, 1, 28, 28, device=dev)
            y = torch.randint(0, 10, (b,), device=dev)
            times = []
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            for i in range(passes + 2):
                t0 = time.perf_counter()
                net.zero_grad(set_to_none=True)
                F.cross_entropy(net(x), y).backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_reserved(dev) / 2**20 if dev.type == "cuda" else None
            out.append((b, statistics.median(times), peak))
        except Exception as exc:  # noqa: BLE001 - only an allocation failure ends the curve
            if not is_out_of_memory(exc):
                raise
            out.append((b, None, None))
            break
        finally:
            x = y = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def run_policy(args: argparse.Namespace, policy: str, work: Path) -> dict:
    workers = ", ".join(f"{{memory_limit_mb: {lim}, slowdown: {s}}}"
                        for lim, s in zip(args.limits_mb, args.slowdowns))
    cfg = load_config(None, [
        f"model.name={args.model}", "data.dataset=synthetic", f"data.synthetic_train={args.train}",
        f"training.global_batch={args.global_batch}", f"training.max_iterations={args.iterations}",
        "training.epochs=null", "training.target_accuracy=null", "evaluator.enabled=false",
        f"cluster.num_workers={len(args.limits_mb)}", f"cluster.num_shards={args.shards}",
        f"worker.device={args.device}", f"worker.memory_probe={str(args.probe).lower()}",
        f"mode.batch_policy={policy}", f"scenario.workers=[{workers}]", "scenario.name=memory"], env={})
    run_dir = work / policy
    LocalCluster(cfg, run_dir, progress=False).run()
    rows = list(read_jsonl(run_dir / "metrics" / "coordinator.jsonl"))
    recs = [r for r in rows if "event" not in r]
    events = [r for r in rows if "event" in r]
    d = [r["duration"] for r in recs][args.skip:]
    # worker ids follow join order; the launcher names worker i of the scenario "worker-i"
    name = {str(e["worker"]): e["name"].removeprefix("worker-") for e in events if e["event"] == "worker_joined"}
    who = lambda w: name.get(str(w), f"id {w}")  # noqa: E731
    # What the memory search learned, per worker: the smallest size that ran out of memory (in
    # a run or the start-up probe) and the largest size committed from its last failure on.
    fails: dict[str, int] = {}
    last_oom: dict[str, int] = {}
    for e in events:
        failed = e.get("failed") if e["event"] == "out_of_memory" else e.get("fails") or None
        if e["event"] in ("out_of_memory", "memory_probe") and failed:
            w = who(e["worker"])
            fails[w] = min(failed, fails.get(w, failed))
            last_oom[w] = max(last_oom.get(w, -1), e.get("iteration", -1))
    fits = {w: max((x for r in recs if r["iteration"] >= last_oom[w]
                    for wid, x in r["batch_sizes"].items() if who(wid) == w), default=0) for w in fails}
    caps = {w: f"fits {fits[w]}, fails {fails[w]}" for w in fails}
    split = {who(w): x for w, x in recs[-1]["batch_sizes"].items()} if recs else {}
    return {"policy": policy, "median": statistics.median(d), "mean": statistics.fmean(d),
            "p95": percentile(d, 0.95), "ooms": sum(e["event"] == "out_of_memory" for e in events),
            "caps": dict(sorted(caps.items())), "split": dict(sorted(split.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--sizes", default="16,32,64,128,256,512,1024,2048,4096",
                    help="(a) batch sizes of the saturation curve")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--limits-mb", default="200,200,64,64", help="(b) memory limit per worker")
    ap.add_argument("--slowdowns", default="1,1,1,2", help="(b) emulated slowdown per worker")
    ap.add_argument("--policies", default="uniform,lbbsp-cpu,lbbsp-gpu")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="iterations left out of the statistics")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--train", type=int, default=8192, help="synthetic training samples")
    ap.add_argument("--probe", action="store_true", help="workers probe their memory before joining")
    ap.add_argument("--tables", default="ab")
    args = ap.parse_args(argv)
    args.limits_mb = [float(v) for v in args.limits_mb.split(",")]
    args.slowdowns = [float(v) for v in args.slowdowns.split(",")]
    if len(args.slowdowns) != len(args.limits_mb):
        ap.error("--slowdowns needs one value per --limits-mb")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available here")
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU, 1 thread"
    print(f"device: {args.device} ({name}); model {args.model}\n")
    if "a" in args.tables:
        curve = saturation(args.model, args.device, [int(v) for v in args.sizes.split(",")], args.passes)
        print("## (a) Forward + backward time against batch size\n")
        print("| batch | ms | µs per sample | peak reserved MB |")
        print("|---|---|---|---|")
        for b, t, peak in curve:
            print(f"| {b} | {'out of memory' if t is None else f'{t * 1e3:.2f}'} | "
                  f"{'-' if t is None else f'{t / b * 1e6:.1f}'} | {'-' if peak is None else f'{peak:.0f}'} |")
        print()
    if "b" in args.tables:
        with tempfile.TemporaryDirectory(prefix="lbbsp-gpu-bench-") as tmp:
            results = [run_policy(args, p, Path(tmp)) for p in args.policies.split(",")]
        print(f"## (b) {len(args.limits_mb)} workers, limits {args.limits_mb} MB, slowdowns {args.slowdowns}, "
              f"X = {args.global_batch}, {args.iterations} iterations (statistics after {args.skip})\n")
        print("| policy | median ms | mean ms | p95 ms | out-of-memory retries | memory learned (worker i) "
              "| last split (worker i: samples) |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['policy']} | {r['median'] * 1e3:.1f} | {r['mean'] * 1e3:.1f} | {r['p95'] * 1e3:.1f} | "
                  f"{r['ooms']} | {r['caps'] or '-'} | {r['split']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
