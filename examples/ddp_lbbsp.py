"""LB-BSP on plain PyTorch DDP: uneven per-rank batches, exact global-batch updates.

Why: DDP averages gradients over ranks, so it needs equal batches, and a slow rank holds
everybody back. With ``batchsize_manager.integrations.torch_ddp`` each rank gets its own batch
size x_i (sum fixed at X), the comm hook weights gradients by x_i, and a batch policy on rank 0
moves samples from slow to fast ranks between iterations.

Run with torchrun::

    torchrun --nproc_per_node 2 examples/ddp_lbbsp.py --policy fixed --weights 1,3 --iterations 50

or let the script spawn the ranks itself (no torchrun needed)::

    python examples/ddp_lbbsp.py --nproc 2 --policy uniform --slowdown 1,3 --iterations 50

``--slowdown 1,3`` makes rank 1 emulate a 3x slower machine: it sleeps (f-1) times its own
compute time, between forward and backward so the sleep counts as its compute (see
``emulated_sleep``). Rank 0 prints the sizes every ``--print-every`` iterations and, at the end,
the mean iteration time and the test accuracy.

``--exchange servers`` sends the gradient buckets through a ``ps-bsm --world-size N`` service
(``--bsm-endpoint``) instead of a ring all-reduce; the service's policy decides the splits. With
``--nproc`` and no endpoint the script starts that service itself, with this script's policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable as `python examples/ddp_lbbsp.py` from a checkout without installing; spawned ranks
# re-import this file, so the path fix must happen at import time.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from batchsize_manager.integrations.torch_ddp import DDPBatchBalancer, LBBSPSampler  # noqa: E402
from ps_launcher.processes import ENDPOINT_RE  # noqa: E402
from ps_ml.datasets import load_dataset  # noqa: E402
from ps_ml.models import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="uniform", help="batch policy name (uniform, fixed, lbbsp-cpu, ...)")
    p.add_argument("--weights", default=None, help="comma-separated weights for --policy fixed, e.g. 1,3")
    p.add_argument("--policy-args", default=None, help="JSON object of policy arguments")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--model", default="lenet")
    p.add_argument("--dataset", default="synthetic", choices=["synthetic", "mnist"])
    p.add_argument("--cache-dir", default=None, help="dataset cache (MNIST)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slowdown", default=None, help="per-rank slowdown factors, e.g. 1,3")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: gloo (CPU); nccl needs CUDA")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many ranks locally instead of running under torchrun")
    p.add_argument("--exchange", default="auto", choices=["auto", "fused", "separate", "servers", "plain"],
                   help="how the ranks' reports reach rank 0: with the last gradient bucket (fused, "
                        "the default on CPU) or by an all-gather of their own (separate); or "
                        "servers: gradients, reports and splits through a ps-bsm service; or "
                        "plain: no plug-in at all (DDP's own mean, even split; the baseline)")
    p.add_argument("--bsm-endpoint", default=None,
                   help="with --exchange servers: the `ps-bsm --world-size N` service's endpoint")
    p.add_argument("--verify", action="store_true",
                   help="debug: all-reduce the batch sizes with every bucket and check the sum")
    args = p.parse_args(argv)
    if args.iterations < 1 or args.global_batch < 1 or args.print_every < 1:
        p.error("--iterations, --global-batch and --print-every must be >= 1")
    if args.exchange == "plain" and (args.policy != "uniform" or args.slowdown or args.verify):
        p.error("--exchange plain is DDP without the plug-in: --policy uniform, no --slowdown or --verify")
    return args


def policy_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(args.policy_args) if args.policy_args else {}
    if args.weights:
        out["weights"] = [float(w) for w in args.weights.split(",")]
    return out


def slowdown_of(args: argparse.Namespace, rank: int) -> float:
    if not args.slowdown:
        return 1.0
    factors = [float(f) for f in args.slowdown.split(",")]
    f = factors[rank] if rank < len(factors) else 1.0
    if f < 1.0:
        raise ValueError(f"slowdown factors must be >= 1, got {f}")
    return f


def emulated_sleep(factor: float, per_sample_s: float | None, batch_size: int, forward_s: float) -> float:
    """Seconds to sleep so this rank's compute looks ``factor`` times slower.

    The sleep sits between forward and backward, not after backward: DDP's all-reduce is issued
    from inside the backward, so only time spent before the last gradient bucket is ready
    delays the other ranks and counts as this rank's compute. The real per-sample compute time
    comes from the previous iteration (``per_sample_s``); the first iteration guesses forward
    + backward as 3x the forward.
    """
    if factor <= 1.0:
        return 0.0
    own = per_sample_s * batch_size if per_sample_s is not None else 3.0 * forward_s
    return (factor - 1.0) * own


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank's training loop (after the process group is up)."""
    torch.set_num_threads(args.threads)
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if use_cuda:
        torch.cuda.set_device(device)

    data = load_dataset(args.dataset, cache_dir=args.cache_dir, seed=args.seed)
    model = build_model(args.model, seed=args.seed, num_classes=data.num_classes).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    servers = args.exchange == "servers"
    balancer = DDPBatchBalancer(args.global_batch, args.policy, None if servers else policy_args(args),
                                min_batch=args.min_batch, device=device, verify=args.verify,
                                exchange=args.exchange, endpoint=args.bsm_endpoint if servers else None)
    balancer.register_hook(ddp)
    sampler = LBBSPSampler(data.num_train, args.global_batch, seed=args.seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    factor = slowdown_of(args, rank)
    per_sample_s: float | None = None

    if rank == 0:
        print(f"LB-BSP DDP: {world_size} ranks, backend {dist.get_backend()}, model {args.model}, "
              f"dataset {args.dataset}, X={args.global_batch}, policy {args.policy}"
              f"{' ' + json.dumps(policy_args(args)) if policy_args(args) else ''}, "
              f"slowdown {args.slowdown or 'none'}"
              f"{', exchange through ' + args.bsm_endpoint if servers else ''}", flush=True)
    dist.barrier()
    iteration_s: list[float] = []
    t_prev = time.perf_counter()
    for it in range(args.iterations):
        sizes = balancer.sizes
        with balancer.timed_data():
            x, y = data.train_batch(balancer.batch_indices(sampler))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        slept = 0.0
        with balancer.timed_compute():
            t0 = time.perf_counter()
            loss = F.cross_entropy(ddp(x), y)  # mean over this rank's x_i samples
            slept = emulated_sleep(factor, per_sample_s, len(y), time.perf_counter() - t0)
            if slept > 0:
                time.sleep(slept)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        balancer.step()
        own = balancer.last_reports[rank].telemetry.compute_s - slept
        if own > 0:
            per_sample_s = own / max(1, len(y))
        now = time.perf_counter()
        iteration_s.append(now - t_prev)
        t_prev = now
        if rank == 0 and ((it + 1) % args.print_every == 0 or it == 0):
            reports = balancer.last_reports
            compute_ms = ", ".join(f"{r.telemetry.compute_s * 1e3:.1f}" for r in reports)
            finish_ms = ", ".join("-" if r.telemetry.finish_s is None else f"{r.telemetry.finish_s * 1e3:.1f}"
                                  for r in reports)
            print(f"it {it + 1:4d}  sizes {[sizes[r] for r in range(world_size)]}  "
                  f"compute ms [{compute_ms}]  iteration {iteration_s[-1] * 1e3:.1f} ms  "
                  f"loss(rank 0) {loss.item():.4f}  finish ms [{finish_ms}]", flush=True)

    if rank == 0:
        half = iteration_s[len(iteration_s) // 2:]
        with torch.no_grad():
            correct = 0
            for s in range(0, data.num_test, 1024):
                tx, ty = data.test_batch(s, s + 1024)
                correct += int((model(tx.to(device)).argmax(1).cpu() == ty).sum())
        print(f"final sizes {[balancer.sizes[r] for r in range(world_size)]}; mean iteration "
              f"{statistics.fmean(iteration_s) * 1e3:.1f} ms (last half "
              f"{statistics.fmean(half) * 1e3:.1f} ms) over {len(iteration_s)} iterations; "
              f"test accuracy {correct / data.num_test:.4f}", flush=True)
    balancer.close()


def train_plain(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """The baseline: DDP as shipped (its own mean all-reduce, an even split, nothing else per
    iteration). Each rank times its own forward+backward (which, in DDP, ends when the
    all-reduce is done) and the per-iteration lines are gathered once, after training, so the
    loop has no collective beyond DDP's own."""
    torch.set_num_threads(args.threads)
    data = load_dataset(args.dataset, cache_dir=args.cache_dir, seed=args.seed)
    model = build_model(args.model, seed=args.seed, num_classes=data.num_classes)
    ddp = DistributedDataParallel(model)
    sizes = [args.global_batch // world_size + (1 if r < args.global_batch % world_size else 0)
             for r in range(world_size)]
    sampler = LBBSPSampler(data.num_train, args.global_batch, seed=args.seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    if rank == 0:
        print(f"plain DDP: {world_size} ranks, backend {dist.get_backend()}, model {args.model}, "
              f"dataset {args.dataset}, X={args.global_batch}, even split {sizes}", flush=True)
    dist.barrier()
    rows: list[tuple[float, float]] = []  # (forward+backward s, iteration s)
    t_prev = time.perf_counter()
    for it in range(args.iterations):
        x, y = data.train_batch(sampler.rank_indices(it, sizes, rank))
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        compute_s = time.perf_counter() - t0
        opt.step()
        now = time.perf_counter()
        rows.append((compute_s, now - t_prev))
        t_prev = now
        if rank == 0 and ((it + 1) % args.print_every == 0 or it == 0):
            print(f"tick {it + 1} ", flush=True)  # progress now; the rows come at the end
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        for it in range(args.iterations):
            if (it + 1) % args.print_every == 0 or it == 0:
                compute_ms = ", ".join(f"{g[it][0] * 1e3:.1f}" for g in gathered)
                print(f"it {it + 1:4d}  sizes {sizes}  compute ms [{compute_ms}]  "
                      f"iteration {rows[it][1] * 1e3:.1f} ms", flush=True)
        its = [r[1] for r in rows]
        print(f"final sizes {sizes}; mean iteration {statistics.fmean(its) * 1e3:.1f} ms over "
              f"{len(its)} iterations; loss(rank 0) {loss.item():.4f}", flush=True)


def choose_backend(args: argparse.Namespace) -> str:
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs CUDA")
    return "nccl" if args.backend == "nccl" else "gloo"


def run_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str = "env://") -> None:
    """One rank: join the process group, train, leave (torchrun: ``env://``)."""
    dist.init_process_group(choose_backend(args), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=5))
    try:
        (train_plain if args.exchange == "plain" else train)(rank, world_size, args)
        dist.barrier()  # leave together
    finally:
        dist.destroy_process_group()


def spawned_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    """One rank in a process of its own (``--nproc``, or under torchrun), which ends without
    running C++ static destructors. With gloo on torch 2.13 a rank's exit after a clean destroy_process_group()
    aborted about one time in ten ("terminate called without an active exception", SIGABRT),
    failing a run whose work was done; there is nothing left to tear down at that point."""
    run_rank(rank, world_size, args, init_method)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_exchange_service(args: argparse.Namespace, world_size: int) -> subprocess.Popen:
    """``ps-bsm --world-size N`` with this script's policy; sets ``args.bsm_endpoint``."""
    cmd = [sys.executable, "-m", "ps_server.bsm_service", "--world-size", str(world_size),
           "--policy", args.policy, "--global-batch", str(args.global_batch),
           "--min-batch", str(args.min_batch), "--policy-args", json.dumps(policy_args(args))]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ps-bsm listening on tcp://..."
    found = ENDPOINT_RE.search(line)
    if found is None:
        proc.kill()
        raise SystemExit(f"ps-bsm did not start (exit {proc.wait()}): {line.strip()}")
    args.bsm_endpoint = found.group(1)
    return proc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.exchange == "servers") != (args.bsm_endpoint is not None) and args.nproc is None:
        raise SystemExit("--exchange servers needs --bsm-endpoint under torchrun (and the "
                         "endpoint is only used with --exchange servers)")
    if args.nproc is not None:
        if args.nproc < 1:
            raise SystemExit("--nproc must be >= 1")
        service = None
        if args.exchange == "servers" and args.bsm_endpoint is None:
            service = start_exchange_service(args, args.nproc)
        try:
            # Rendezvous through a file, not a "free" TCP port that another process may take
            # between choosing and binding it.
            with tempfile.TemporaryDirectory(prefix="ddp_lbbsp_") as tmp:
                init_method = Path(tmp, "rendezvous").as_uri()
                mp.spawn(spawned_rank, args=(args.nproc, args, init_method), nprocs=args.nproc, join=True)
        finally:
            if service is not None:
                service.terminate()
                try:
                    service.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    service.kill()
        return 0
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, or pass --nproc N to spawn the ranks locally")
    # One rank of a finished run aborted in gloo's teardown on the lab's links, as under --nproc.
    spawned_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
    return 0


if __name__ == "__main__":
    sys.exit(main())
