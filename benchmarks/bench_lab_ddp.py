"""The DDP plug-in under real kernel CPU quotas: where the time of a throttled job goes.

Runs ``examples/ddp_lbbsp.py --nproc N`` (gloo, LeNet, MNIST) with each rank in a cgroup of its
own at ``--quotas`` of a core, once per policy, and reads rank 0's per-iteration lines (every
rank's compute time as the plug-in measures it: forward + backward until its last gradient
bucket, before any waiting; and the iteration time). Per policy it prints median / mean / p95
of the iteration, of the slowest rank's compute, and of the rest: iteration - max compute,
i.e. the all-reduce and the balancer's two small collectives after the last rank finished,
plus rank 0's data loading and optimizer step. A throttled rank takes part in every
collective, so under a quota the rest can grow too.

    python benchmarks/bench_lab_ddp.py [--quotas 0.7,0.7,0.2,0.2] [--iterations 300]
        [--policies uniform,lbbsp-cpu] [--exchanges auto] [--global-batch 512] [--rotate-s 5]

``--rotate-s S`` moves the quotas one rank along every S seconds (rank r gets rank r-1's), as
the lab's ``rotation`` does for parameter-server workers.

``--exchanges fused,separate,servers`` runs every policy each way: the ranks' reports riding
with the last gradient bucket, gathered by a collective of their own (the balancer's
``exchange``), or the gradients themselves going through a ``ps-bsm --world-size N`` service
(started by the example outside the quotas, like a parameter server on a host of its own).
``plain`` is DDP without the plug-in (its own mean all-reduce, an even split, no other
collective; its "compute" is forward+backward with the all-reduce in it): the baseline. The
first variant is the reference of the ratio column, so list ``plain`` first.

Needs root and the cgroup cpu controller (the lab's CPU quotas).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ps_launcher.lab import CpuQuotaGroup, cpu_quota_available  # noqa: E402
from ps_launcher.plots import Panel, plot_panels  # noqa: E402
from ps_launcher.summary import percentile  # noqa: E402

#: A line printed when an iteration ends: a row, or plain DDP's "tick N".
PROGRESS = re.compile(r"(?:it|tick)\s+(\d+)\s")
LINE = re.compile(r"it\s+(\d+)\s+sizes \[([^\]]*)\]\s+compute ms \[([^\]]*)\]\s+iteration ([\d.]+) ms"
                  r"[^\n]*?(?:finish ms \[([^\]]*)\])?\n")
#: rank 0's row: (iteration, sizes, each rank's compute s, iteration s, each rank's finish s or None)
Row = tuple[int, list[int], list[float], float, list[float | None]]


def rank_processes(parent: psutil.Process, n: int, timeout_s: float) -> list[psutil.Process]:
    """The N spawned ranks, in rank order (mp.spawn starts them one after the other)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
        if len(kids) >= n:
            return sorted(kids, key=lambda p: (p.create_time(), p.pid))[:n]
        time.sleep(0.05)
    raise RuntimeError(f"{n} ranks did not start within {timeout_s:.0f}s")


def cpu_seconds(procs: list[psutil.Process]) -> list[float]:
    """Each rank's CPU seconds so far (user + system)."""
    out = []
    for p in procs:
        t = p.cpu_times()
        out.append(t.user + t.system)
    return out


def run(policy: str, exchange: str, args: argparse.Namespace,
        quotas: list[float]) -> tuple[list[Row], list[float], list[int]]:
    """Rank 0's rows, each rank's CPU seconds per measured iteration, and the iterations at
    which the quotas moved (``--rotate-s``)."""
    cmd = [sys.executable, str(ROOT / "examples" / "ddp_lbbsp.py"), "--nproc", str(len(quotas)),
           "--policy", policy, "--exchange", exchange, "--iterations", str(args.iterations), "--print-every", "1",
           "--global-batch", str(args.global_batch), "--model", args.model, "--dataset", "mnist"]
    if getattr(args, "policy_args", None):
        cmd += ["--policy-args", args.policy_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    groups: list[CpuQuotaGroup] = []
    stop_rotating = threading.Event()
    progress = [0]                       # the newest iteration printed, for the moves' places
    moves: list[int] = []
    try:
        ranks = rank_processes(psutil.Process(proc.pid), len(quotas), 60)
        for r, (p, q) in enumerate(zip(ranks, quotas)):
            g = CpuQuotaGroup(f"ddp{r}", fraction=q).create()
            groups.append(g)
            g.add(p.pid)
        if args.rotate_s:
            threading.Thread(target=rotate, args=(groups, quotas, args.rotate_s, stop_rotating,
                                                  lambda: moves.append(progress[0])), daemon=True).start()
        # CPU per iteration over the measured iterations only (start-up ran outside the quota):
        # under a quota a rank can spend at most quota x wall time, so this against that budget
        # shows which ranks the quota binds and how much CPU they spend per iteration.
        deadline = time.monotonic() + args.timeout_s
        lines: list[str] = []
        first = last = None
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = PROGRESS.match(line)  # as it happens (plain DDP prints its rows at the end)
            if m:
                progress[0] = int(m.group(1))
            if m and int(m.group(1)) == args.skip and first is None:
                first = (args.skip, cpu_seconds(ranks))
            if m and int(m.group(1)) == args.iterations - 1 and last is None:
                last = (args.iterations - 1, cpu_seconds(ranks))
            if time.monotonic() > deadline:
                raise TimeoutError(f"ddp_lbbsp.py ran over {args.timeout_s:.0f}s")
        proc.wait(timeout=30)
        out = "".join(lines)
        if first is None or last is None:
            raise RuntimeError(f"no iteration lines to measure CPU from:\n{out[-3000:]}")
        cpu_s = [(b - a) / (last[0] - first[0]) for a, b in zip(first[1], last[1])]
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        stop_rotating.set()
        for g in groups:
            g.remove()
    if proc.returncode != 0:
        raise RuntimeError(f"ddp_lbbsp.py exited {proc.returncode}:\n{out[-3000:]}")
    return parse_rows(out), cpu_s, moves


def parse_rows(out: str) -> list[Row]:
    """Rank 0's per-iteration lines (plain DDP's have no finish times: empty)."""
    rows = []
    for m in LINE.finditer(out):
        sizes = [int(x) for x in m.group(2).split(",")]
        compute = [float(x) / 1e3 for x in m.group(3).split(",")]
        finish = [None if x.strip() == "-" else float(x) / 1e3 for x in (m.group(5) or "").split(",") if x.strip()]
        rows.append((int(m.group(1)), sizes, compute, float(m.group(4)) / 1e3, finish))
    return rows


def variant_labels(policies: str, exchanges: str) -> dict[tuple[str, str], str]:
    """Every (policy, exchange) to run, in order, with its table label; ``plain`` (DDP without
    the plug-in, even split) runs once, as ``uniform``."""
    variants = [(p, e) for e in exchanges.split(",") for p in policies.split(",")
                if e != "plain" or p == "uniform"]
    return {v: "plain DDP" if v[1] == "plain" else v[0] if v[1] == "auto" else f"{v[0]} ({v[1]})"
            for v in variants}


def rotate(groups: list[CpuQuotaGroup], quotas: list[float], period_s: float, stop: threading.Event,
           moved: Callable[[], None] = lambda: None) -> None:
    """Every ``period_s``, each rank takes the quota of the rank before it."""
    shift = 0
    while not stop.wait(period_s):
        shift += 1
        for r, g in enumerate(groups):
            try:
                g.set_fraction(quotas[(r - shift) % len(quotas)])
            except Exception:  # noqa: BLE001 - the run is ending and the group is gone
                return
        moved()


def plot(runs: dict[str, tuple[list[Row], list[int]]], out: Path, skip: int = 0) -> None:
    """Each rank's finish time per iteration in each run that has them, then the last run's
    split; the quota moves dashed; the first ``skip`` iterations (start-up) left out."""
    panels: list[Panel] = []
    split: Panel | None = None
    for name, (all_rows, all_moves) in runs.items():
        rows = [r for r in all_rows if r[0] > skip]
        if not any(r[4] for r in rows):
            continue                                      # plain DDP: no finish times
        moves = [float(m) for m in all_moves if m > skip]
        finish: dict[str, tuple[list[float], list[float]]] = {}
        sizes: dict[str, tuple[list[float], list[float]]] = {}
        for w in range(len(rows[0][1])):
            timed = [(r[0], f * 1e3) for r in rows if (f := r[4][w]) is not None]
            finish[f"rank {w}"] = ([float(t[0]) for t in timed], [t[1] for t in timed])
            sizes[f"rank {w}"] = ([float(r[0]) for r in rows], [float(r[1][w]) for r in rows])
        panels.append(Panel(name, "finish (ms)", finish, moves))
        split = Panel(f"{name}: split", "batch size", sizes, moves)
    if split is not None:
        plot_panels(out, [*panels, split], "iteration (dashed: the quotas moved)")


def describe(xs: list[float]) -> str:
    return (f"{statistics.median(xs) * 1e3:.1f} / {statistics.fmean(xs) * 1e3:.1f} / "
            f"{percentile(xs, 0.95) * 1e3:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quotas", default="0.7,0.7,0.2,0.2")
    ap.add_argument("--policies", default="uniform,lbbsp-cpu")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--exchanges", default="auto",
                    help="comma-separated: plain (no plug-in), auto, fused, separate, servers")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--skip", type=int, default=30, help="first iterations left out")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=500)
    ap.add_argument("--rotate-s", type=float, default=0.0, help="move the quotas one rank along every S s")
    ap.add_argument("--policy-args", default=None, help="JSON object of policy arguments (every policy run)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="each rank's finish time and the split over the last repeat")
    args = ap.parse_args(argv)
    if why := cpu_quota_available():
        print(f"bench_lab_ddp: CPU quotas unavailable: {why}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C: the ranks are killed and their cgroups removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quotas = [float(q) for q in args.quotas.split(",")]
    label = variant_labels(args.policies, args.exchanges)
    variants = list(label)
    results: dict[str, list] = {label[v]: [] for v in variants}
    cpu: dict[str, list[list[float]]] = {p: [] for p in results}
    last: dict[str, tuple[list[Row], list[int]]] = {}
    for r in range(args.repeats):
        for (policy_name, exchange) in variants:
            policy = label[(policy_name, exchange)]
            all_rows, cpu_s, moves = run(policy_name, exchange, args, quotas)
            last[policy] = (all_rows, moves)
            rows = all_rows[args.skip:]
            results[policy] += rows
            cpu[policy].append(cpu_s)
            print(f"repeat {r} {policy}: median iteration "
                  f"{statistics.median(x[3] for x in rows) * 1e3:.1f} ms", flush=True)
    print(f"\nDDP plug-in (examples/ddp_lbbsp.py, gloo), {args.model}, MNIST, X = {args.global_batch}, "
          f"{len(quotas)} ranks under CPU quotas {quotas}"
          + (f" moving one rank along every {args.rotate_s:g} s" if args.rotate_s else "")
          + f", {args.iterations} iterations x {args.repeats} "
          f"(first {args.skip} left out); median / mean / p95 in ms\n")
    first = statistics.median(x[3] for x in next(iter(results.values())))
    print("| policy | iteration | median / first row's | slowest rank's compute | rest (collectives, data, step) | "
          "rest / iteration | compute per rank (median) | CPU ms per iteration per rank (budget) | last split |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, rows in results.items():
        it = [x[3] for x in rows]
        slowest = [max(x[2]) for x in rows]
        rest = [max(0.0, x[3] - max(x[2])) for x in rows]
        per_rank = [statistics.median(x[2][k] for x in rows) * 1e3 for k in range(len(quotas))]
        cpu_ms = [statistics.fmean(c[k] for c in cpu[policy]) * 1e3 for k in range(len(quotas))]
        budget = [q * statistics.fmean(it) * 1e3 for q in quotas]
        print(f"| {policy} | {describe(it)} | {statistics.median(it) / first:.2f}x | "
              f"{describe(slowest)} | {describe(rest)} | "
              f"{statistics.median(rest) / statistics.median(it):.2f} | "
              f"{', '.join(f'{c:.1f}' for c in per_rank)} | "
              f"{', '.join(f'{c:.1f} ({b:.0f})' for c, b in zip(cpu_ms, budget))} | {rows[-1][1]} |")
    if args.plot:
        plot(last, args.plot, args.skip)
        print(f"\neach rank's finish time: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
