"""The GPU half of LB-BSP on a device: the saturation curve, memory caps learned from real
out-of-memory errors, and lbbsp-gpu against uniform and lbbsp-cpu, in one run.

(a) Saturation: forward + backward time of the model on the device at batch sizes 2^k (median
    of ``--passes`` after warm-up, synchronized): flat below a saturation batch on a GPU,
    linear on a CPU. lbbsp-gpu searches instead of predicting because of this curve.
(b) Memory-limited workers: ``len(--limits-mb)`` workers on the device, each with a real memory
    limit (a CUDA per-process memory fraction; on a CPU an address-space limit; ``none``: no
    limit), an emulated speed (``--slowdowns``) and, on CUDA under an MPS control daemon, a real
    share of the GPU's SMs (``--sm-percent``; ps_worker/gpu_share.py). For each policy, a local
    cluster trains ``--iterations``; printed: time per iteration (median, mean, p95 after
    ``--skip``), out-of-memory retries, then per worker: its limit, speed, median share and
    compute time after ``--skip``, its out-of-memory retries and what the memory search learned
    (from the coordinator's events).

    python benchmarks/bench_gpu_memory.py --device cuda --model cnn1m --global-batch 4096 \\
        --limits-mb 2000,2000,600,600 --slowdowns 1,1,1,2

Without MPS, workers on one GPU time-slice it: each one's compute grows with the others'
batches, which is not the setting of separate GPUs. With ``--sm-percent 40,30,20,10`` (after
``nvidia-cuda-mps-control -d``) they run side by side at four real speeds.

On a CPU (``--device cpu``, the default here) the same code runs as a smoke test: a limited CPU
worker computes about 2x slower (ps_worker/memory.py says why), so its numbers are not a speed
benchmark. Uses the synthetic dataset (no download).
"""

from __future__ import annotations

import argparse
import json
import os
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


def scenario_workers(args: argparse.Namespace) -> str:
    """The ``scenario.workers`` override: per worker, its limit, emulated slowdown and SM share."""
    out = []
    for lim, slow, sm in zip(args.limits_mb, args.slowdowns, args.sm_percent):
        parts = [f"slowdown: {slow}"]
        if lim is not None:
            parts.append(f"memory_limit_mb: {lim}")
        if sm is not None:
            parts.append(f"gpu_sm_percent: {sm}")
        out.append("{" + ", ".join(parts) + "}")
    return "[" + ", ".join(out) + "]"


def run_policy(args: argparse.Namespace, policy: str, work: Path) -> dict:
    cfg = load_config(None, [
        f"model.name={args.model}", "data.dataset=synthetic", f"data.synthetic_train={args.train}",
        f"training.global_batch={args.global_batch}", f"training.max_iterations={args.iterations}",
        "training.epochs=null", "training.target_accuracy=null", "evaluator.enabled=false",
        f"cluster.num_workers={len(args.limits_mb)}", f"cluster.num_shards={args.shards}",
        f"worker.device={args.device}", f"worker.memory_probe={str(args.probe).lower()}",
        f"mode.batch_policy={policy}", f"scenario.workers={scenario_workers(args)}", "scenario.name=memory"], env={})
    run_dir = work / policy
    LocalCluster(cfg, run_dir, progress=False).run()
    rows = list(read_jsonl(run_dir / "metrics" / "coordinator.jsonl"))
    recs = [r for r in rows if "event" not in r]
    events = [r for r in rows if "event" in r]
    d = [r["duration"] for r in recs][args.skip:]
    # worker ids follow join order; the launcher names worker i of the scenario "worker-i"
    index = {str(e["worker"]): int(e["name"].removeprefix("worker-"))
             for e in events if e["event"] == "worker_joined"}
    # What the memory search learned, per worker: the smallest size that ran out of memory (in
    # a run or the start-up probe) and the largest size committed from its last failure on.
    fails: dict[int, int] = {}
    last_oom: dict[int, int] = {}
    ooms: dict[int, int] = {}
    for e in events:
        failed = e.get("failed") if e["event"] == "out_of_memory" else e.get("fails") or None
        if e["event"] in ("out_of_memory", "memory_probe") and failed:
            i = index[str(e["worker"])]
            fails[i] = min(failed, fails.get(i, failed))
            last_oom[i] = max(last_oom.get(i, -1), e.get("iteration", -1))
            ooms[i] = ooms.get(i, 0) + (e["event"] == "out_of_memory")
    per_worker = []
    for i in range(len(args.limits_mb)):
        wid = next((w for w, k in index.items() if k == i), None)
        sizes = [r["batch_sizes"][wid] for r in recs[args.skip:] if wid in r["batch_sizes"]]
        # a worker's records are named by its worker id (join order), not its scenario index
        mine = [r for r in read_jsonl(run_dir / "metrics" / f"worker-{wid}.jsonl")
                if "compute_s" in r and r.get("iteration", -1) >= args.skip] if wid is not None else []
        compute = [r["compute_s"] for r in mine]
        per_sample = [r["compute_s"] / r["batch_size"] for r in mine if r.get("batch_size")]
        # the size its reported headroom says would still fit (what the manager caps it by)
        room = [r["batch_size"] + r["mem_headroom_mb"] / r["mem_per_sample_mb"] for r in mine
                if r.get("mem_per_sample_mb") and r.get("mem_headroom_mb") is not None]
        fits = max((r["batch_sizes"].get(wid, 0) for r in recs if r["iteration"] >= last_oom.get(i, 0)), default=0)
        per_worker.append({
            "worker": i, "limit_mb": args.limits_mb[i], "slowdown": args.slowdowns[i],
            "sm_percent": args.sm_percent[i], "median_batch": statistics.median(sizes) if sizes else None,
            "median_compute_ms": statistics.median(compute) * 1e3 if compute else None,
            "median_us_per_sample": statistics.median(per_sample) * 1e6 if per_sample else None,
            "median_room_for": statistics.median(room) if room else None,
            "ooms": ooms.get(i, 0), "fails": fails.get(i), "fits": fits if i in fails else None})
    return {"policy": policy, "median": statistics.median(d), "mean": statistics.fmean(d),
            "p95": percentile(d, 0.95), "durations": [r["duration"] for r in recs],
            "ooms": sum(e["event"] == "out_of_memory" for e in events), "workers": per_worker}


def run_or_report(args: argparse.Namespace, policy: str, work: Path) -> dict:
    """One policy's run; a run that fails is printed and recorded, and the others still run."""
    try:
        return run_policy(args, policy, work)
    except Exception as exc:  # noqa: BLE001 - a benchmark of several runs reports each failure
        print(f"{policy}: the run failed: {exc}", flush=True)
        return {"policy": policy, "error": str(exc)}


def print_runs(args: argparse.Namespace, results: list[dict]) -> None:
    sm = "" if all(p is None for p in args.sm_percent) else f", SM shares {args.sm_percent} %"
    print(f"## (b) {len(args.limits_mb)} workers, limits {args.limits_mb} MB, slowdowns {args.slowdowns}{sm}, "
          f"X = {args.global_batch}, {args.iterations} iterations (statistics after {args.skip})\n")
    print("| policy | median ms | mean ms | p95 ms | out-of-memory retries |")
    print("|---|---|---|---|---|")
    for r in results:
        ms = " | ".join(f"{r[k] * 1e3:.1f}" for k in ("median", "mean", "p95"))
        print(f"| {r['policy']} | {ms} | {r['ooms']} |")
    print("\nPer worker (median after the skip; headroom fits: its size plus reported headroom over memory "
          "per sample; memory learned: largest size committed since its last failure / smallest that failed):\n")
    print("| policy | worker | limit MB | slowdown | SM % | batch | compute ms | µs per sample | headroom fits "
          "| OOM retries | memory learned |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in results:
        for w in r["workers"]:
            learned = "-" if w["fails"] is None else f"fits {w['fits']}, fails {w['fails']}"
            print(f"| {r['policy']} | {w['worker']} | {fmt(w['limit_mb'], '.0f')} | {w['slowdown']:g} | "
                  f"{fmt(w['sm_percent'], 'd')} | {fmt(w['median_batch'], '.0f')} | "
                  f"{fmt(w['median_compute_ms'], '.1f')} | {fmt(w['median_us_per_sample'], '.2f')} | "
                  f"{fmt(w['median_room_for'], '.0f')} | "
                  f"{w['ooms']} | {learned} |")
    print()


def per_worker_list(text: str, n: int | None, convert, name: str) -> list:
    values = [None if v.strip().lower() == "none" else convert(v) for v in text.split(",")] if text else []
    if n is not None and len(values) != n:
        raise SystemExit(f"{name} needs one value per worker ({n}), got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--sizes", default="16,32,64,128,256,512,1024,2048,4096",
                    help="(a) batch sizes of the saturation curve")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--limits-mb", default="200,200,64,64", help="(b) memory limit per worker ('none': no limit)")
    ap.add_argument("--slowdowns", default="1,1,1,2", help="(b) emulated slowdown per worker")
    ap.add_argument("--sm-percent", default="", help="(b) share of the GPU's SMs per worker, CUDA MPS ('none': all)")
    ap.add_argument("--policies", default="uniform,lbbsp-cpu,lbbsp-gpu")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="iterations left out of the statistics")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--train", type=int, default=8192, help="synthetic training samples")
    ap.add_argument("--probe", action="store_true", help="workers probe their memory before joining")
    ap.add_argument("--tables", default="ab")
    ap.add_argument("--json", type=Path, default=None, help="also append the results here, one JSON line a run")
    args = ap.parse_args(argv)
    args.limits_mb = per_worker_list(args.limits_mb, None, float, "--limits-mb")
    n = len(args.limits_mb)
    args.slowdowns = per_worker_list(args.slowdowns, n, float, "--slowdowns")
    args.sm_percent = per_worker_list(args.sm_percent, n, int, "--sm-percent") if args.sm_percent else [None] * n
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available here")
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU, 1 thread"
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    print(f"device: {args.device} ({name}); model {args.model}"
          f"{f'; this process under MPS at {share}% of the SMs' if share else ''}\n")
    report: dict = {"device": name, "model": args.model, "sm_percent": share}
    if "a" in args.tables:
        curve = saturation(args.model, args.device, [int(v) for v in args.sizes.split(",")], args.passes)
        report["saturation"] = [{"batch": b, "s": t, "peak_reserved_mb": p} for b, t, p in curve]
        print("## (a) Forward + backward time against batch size\n")
        print("| batch | ms | µs per sample | peak reserved MB |")
        print("|---|---|---|---|")
        for b, t, peak in curve:
            print(f"| {b} | {'out of memory' if t is None else f'{t * 1e3:.2f}'} | "
                  f"{'-' if t is None else f'{t / b * 1e6:.1f}'} | {'-' if peak is None else f'{peak:.0f}'} |")
        print()
    if "b" in args.tables:
        with tempfile.TemporaryDirectory(prefix="lbbsp-gpu-bench-") as tmp:
            results = [run_or_report(args, p, Path(tmp)) for p in args.policies.split(",")]
        print_runs(args, [r for r in results if "error" not in r])
        report.update(runs=results, global_batch=args.global_batch, iterations=args.iterations, skip=args.skip,
                      limits_mb=args.limits_mb, slowdowns=args.slowdowns, worker_sm_percent=args.sm_percent)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
