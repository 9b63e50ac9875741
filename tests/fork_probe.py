"""A role for tests/integration/test_fork_server.py: prints what a started process sees, as JSON,
then sleeps ``--sleep`` seconds and exits with ``--code``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--watch-parent", action="store_true")
    args = ap.parse_args()
    if args.watch_parent:
        from ps_common.cli_util import watch_parent

        watch_parent(interval_s=0.1)
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                      "argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                      "parent_env": os.environ.get("LBBSP_PARENT_PID"), "random": float(np.random.rand()),
                      "wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                      "torch_loaded": "torch" in sys.modules}), flush=True)
    time.sleep(args.sleep)
    sys.exit(args.code)
