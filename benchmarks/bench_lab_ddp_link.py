"""The DDP plug-in with one rank behind a slow real link: what all-reduce does with it.

Every rank of ``examples/ddp_lbbsp.py`` (gloo, LeNet, MNIST) runs on a host of its own (a network
namespace on the lab's bridge, real TCP); the last rank's link is held to ``--rate-mbit`` with
``--delay-ms`` added each way (tbf and the lab's delay relay), from the start. Once per policy
(plain DDP's even split, ``uniform``; the plug-in's ``lbbsp-cpu``) it reads rank 0's
per-iteration lines and prints median / mean / p95 of the iteration, of the slowest rank's
compute, and of the rest (the all-reduce and the balancer's small collectives after the last
rank finished, plus rank 0's data loading and step), with the last split.

A ring all-reduce sends every rank's share of the gradient through every link, the slow one
included, so the slow link's cost lands on every rank's all-reduce, whatever the split: the
table shows how much of the iteration that is. The parameter server's runs on the same link
are in ``configs/compare_link.yaml``.

``--exchanges auto,servers`` also runs every policy with the gradients going through a
``ps-bsm --world-size N`` service on a host of its own (unshaped link), where only the slow
rank's own bucket crosses the slow link.

    python benchmarks/bench_lab_ddp_link.py [--ranks 4] [--rate-mbit 100] [--delay-ms 5]
        [--iterations 200] [--policies uniform,lbbsp-cpu] [--exchanges auto] [--repeats 1]

Needs root, network namespaces, tbf and /dev/net/tun (the lab's links).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_lab_ddp import describe, parse_rows, variant_labels  # noqa: E402
from ps_launcher.lab import NetLab, delay_available, netns_available  # noqa: E402
from ps_launcher.lab.netns import HOST_IF, Host  # noqa: E402
from ps_launcher.processes import ENDPOINT_RE  # noqa: E402

MASTER_PORT = 29500  # inside rank 0's own namespace: nothing else listens there


def start_service(lab: NetLab, policy: str, args: argparse.Namespace) -> tuple[Host, subprocess.Popen, str]:
    """``ps-bsm --world-size N`` on a host of its own; its host, process and endpoint."""
    host = lab.add_host("bsm")
    cmd = [sys.executable, "-m", "ps_server.bsm_service", "--world-size", str(args.ranks),
           "--policy", policy, "--global-batch", str(args.global_batch), "--host", host.ip, "--port", "0"]
    proc = host.popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    found = ENDPOINT_RE.search(proc.stdout.readline())
    if found is None:
        host.stop(proc)
        raise RuntimeError("ps-bsm did not start")
    return host, proc, found.group(1)


def run(policy: str, exchange: str, args: argparse.Namespace,
        seed: int) -> list[tuple[int, list[int], list[float], float]]:
    """One DDP job, every rank on a host of its own; rank 0's per-iteration rows."""
    with NetLab() as lab:
        hosts = [lab.add_host(f"rank{r}") for r in range(args.ranks - 1)]
        hosts.append(lab.add_host(f"rank{args.ranks - 1}", rate_mbit=args.rate_mbit, delay_ms=args.delay_ms))
        cmd = [sys.executable, str(ROOT / "examples" / "ddp_lbbsp.py"), "--policy", policy,
               "--iterations", str(args.iterations), "--print-every", "1", "--seed", str(seed),
               "--global-batch", str(args.global_batch), "--model", args.model, "--dataset", "mnist",
               "--exchange", exchange]
        service = None
        if exchange == "servers":
            service = start_service(lab, policy, args)
            cmd += ["--bsm-endpoint", service[2]]
        procs = []
        for r, host in enumerate(hosts):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks),
                       MASTER_ADDR=hosts[0].ip, MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=HOST_IF)
            procs.append(host.popen(cmd, cwd=ROOT, env=env, text=True, stderr=subprocess.STDOUT,
                                    stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL))
        try:
            out, _ = procs[0].communicate(timeout=args.timeout_s)
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for host, p in zip(hosts, procs):
                if p.poll() is None:
                    host.stop(p)
            if service is not None:
                service[0].stop(service[1])
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"ranks exited with {bad}:\n{out[-3000:]}")
    return parse_rows(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--policies", default="uniform,lbbsp-cpu")
    ap.add_argument("--exchanges", default="auto", help="comma-separated: auto (all-reduce), servers")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--skip", type=int, default=30, help="first iterations left out")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=500)
    args = ap.parse_args(argv)
    why = netns_available() or (delay_available() if args.delay_ms > 0 else None)
    if why:
        print(f"bench_lab_ddp_link: the lab's links are unavailable: {why}", file=sys.stderr)
        return 2
    label = variant_labels(args.policies, args.exchanges)
    variants = list(label)
    results: dict[str, list] = {label[v]: [] for v in variants}
    for r in range(args.repeats):
        for policy, exchange in variants:
            rows = run(policy, exchange, args, seed=r)[args.skip:]
            results[label[(policy, exchange)]] += rows
            print(f"repeat {r} {label[(policy, exchange)]}: median iteration "
                  f"{statistics.median(x[3] for x in rows) * 1e3:.1f} ms", flush=True)
    print(f"\nDDP plug-in (examples/ddp_lbbsp.py, gloo), {args.model}, MNIST, X = {args.global_batch}, "
          f"{args.ranks} ranks each on its own host, rank {args.ranks - 1} behind {args.rate_mbit:g} Mbit/s"
          f" + {args.delay_ms:g} ms each way; {args.iterations} iterations x {args.repeats} "
          f"(first {args.skip} left out); median / mean / p95 in ms\n")
    print("| policy | iteration | slowest rank's compute | rest (collectives, data, step) | rest / iteration | "
          "compute per rank (median) | last split |")
    print("|---|---|---|---|---|---|---|")
    for policy, rows in results.items():
        it = [x[3] for x in rows]
        rest = [max(0.0, x[3] - max(x[2])) for x in rows]
        per_rank = [statistics.median(x[2][k] for x in rows) * 1e3 for k in range(args.ranks)]
        print(f"| {policy} | {describe(it)} | {describe([max(x[2]) for x in rows])} | {describe(rest)} | "
              f"{statistics.median(rest) / statistics.median(it):.2f} | "
              f"{', '.join(f'{c:.1f}' for c in per_rank)} | {rows[-1][1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
