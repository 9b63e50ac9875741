"""What the test suite's processes cost, with roles forked from a fork server and with exec.

Why: the suite is over its 15-minute target on 2 cores and CPU-bound (README, Tests), and most
of a short role's CPU is importing torch and this project. This runs pytest on the given paths
twice, side by side: with ``LBBSP_FORK_SERVER=0`` (every role started with exec, importing
everything itself) and with the fork server (ps_launcher.fork_server: one import per process
group, each role forked from it). For each it prints the wall time, the CPU of every process
pytest started and reaped, and how many Python processes were started with exec (a
``sitecustomize`` on ``PYTHONPATH`` counts them; forked roles do not start Python again). It
also measures, in a fresh process, the CPU of importing torch and the worker's and shard's
modules.

    python benchmarks/suite_processes.py tests/system/test_system_failures.py [more paths]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_HOOK = '''
import json, os
with open(os.environ["LBBSP_PROCESS_LOG"], "a") as f:
    f.write(json.dumps({"started": os.getpid()}) + "\\n")
'''

_IMPORTS = ("import time; t = time.process_time(); import torch, ps_worker.worker, ps_server.server; "
            "print(time.process_time() - t)")


def import_cpu_s(repeats: int = 3) -> float:
    """Median CPU seconds of importing torch and the worker's and shard's modules."""
    out = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", _IMPORTS], cwd=ROOT, capture_output=True, text=True,
                           check=True, timeout=120)
        out.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(out)


def run_tests(paths: list[str], fork: bool) -> dict:
    """pytest on ``paths`` with roles forked from a fork server or started with exec: its wall
    time, the CPU of every process it started and reaped (RUSAGE_CHILDREN, which the fork server's
    children reach through the server), and the Python processes started with exec."""
    with tempfile.TemporaryDirectory(prefix="lbbsp-test-processes-") as d:
        (Path(d) / "sitecustomize.py").write_text(_HOOK)
        log = Path(d) / "processes.jsonl"
        env = dict(os.environ, LBBSP_PROCESS_LOG=str(log), LBBSP_FORK_SERVER="1" if fork else "0",
                   PYTHONPATH=os.pathsep.join([d, str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"fork": fork, "wall": wall, "rc": r.returncode, "summary": summary,
            "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "execs": sum(1 for x in rows if "started" in x) - 1}   # less the pytest process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="test files or folders, as pytest takes them")
    args = ap.parse_args()
    runs = [run_tests(args.paths, fork=False), run_tests(args.paths, fork=True)]
    imports = import_cpu_s()
    print(f"\nimporting torch and the shard's and worker's modules: {imports:.2f} s of CPU per process")
    print("| roles started | pytest | wall (s) | CPU of every process (s) | Python processes exec'd |")
    print("|---|---|---|---|---|")
    for x in runs:
        print(f"| {'forked (fork server)' if x['fork'] else 'exec'} | {x['summary']} | {x['wall']:.0f} | "
              f"{x['cpu']:.0f} | {x['execs']} |")
    base, forked = runs
    print(f"\nforked / exec: wall {forked['wall'] / base['wall']:.2f}x, CPU {forked['cpu'] / base['cpu']:.2f}x")
    if any(x["rc"] != 0 for x in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
