"""Where the test suite's CPU goes: how many Python processes the chosen tests start, and what
each costs, against what importing torch and this project costs one process.

Why: the suite is over its 15-minute target on 2 cores and CPU-bound (README, Tests). This
runs pytest on the given paths with a ``sitecustomize`` on ``PYTHONPATH`` that records every
Python process the tests start (shards, workers, evaluators, helpers) and, at a clean exit, its
CPU time; processes killed by a test (SIGKILL) are counted but their CPU is not known. Then it
measures, in a fresh process, the CPU of ``import torch`` plus the worker's and shard's modules,
which every such process pays before doing anything.

    python benchmarks/suite_processes.py tests/system/test_system_failures.py [more paths]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_HOOK = '''
import atexit, json, os, resource, sys
_LOG = os.environ["LBBSP_PROCESS_LOG"]
with open(_LOG, "a") as f:
    f.write(json.dumps({"started": os.getpid()}) + "\\n")
def _ended():
    r = resource.getrusage(resource.RUSAGE_SELF)
    with open(_LOG, "a") as f:
        f.write(json.dumps({"ended": os.getpid(), "cpu_s": r.ru_utime + r.ru_stime,
                            "torch": "torch" in sys.modules}) + "\\n")
atexit.register(_ended)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="test files or folders, as pytest takes them")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lbbsp-test-processes-") as d:
        (Path(d) / "sitecustomize.py").write_text(_HOOK)
        log = Path(d) / "processes.jsonl"
        env = dict(os.environ, LBBSP_PROCESS_LOG=str(log),
                   PYTHONPATH=os.pathsep.join([d, str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.paths],
                           cwd=ROOT, env=env)
        wall = time.monotonic() - t0
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    runner = rows[0]["started"] if rows else None            # the pytest process itself
    started = [x["started"] for x in rows if "started" in x and x["started"] != runner]
    ended = [x for x in rows if "ended" in x and x["ended"] != runner]
    runner_cpu = next((x["cpu_s"] for x in rows if x.get("ended") == runner), float("nan"))
    cpu = [x["cpu_s"] for x in ended]
    imports = import_cpu_s()
    print(f"\npytest exit {r.returncode}; {wall:.0f} s wall; the pytest process: {runner_cpu:.1f} s CPU")
    print("| processes started | ended cleanly (CPU known) | their CPU (s) | median / mean per process (s) "
          "| imports of one process (s) | imports x processes started (s) |")
    print("|---|---|---|---|---|---|")
    if cpu:
        print(f"| {len(started)} | {len(ended)} | {sum(cpu):.0f} | {statistics.median(cpu):.2f} / "
              f"{statistics.fmean(cpu):.2f} | {imports:.2f} | {imports * len(started):.0f} |")
    else:
        print(f"| {len(started)} | 0 | | | {imports:.2f} | {imports * len(started):.0f} |")


if __name__ == "__main__":
    main()
