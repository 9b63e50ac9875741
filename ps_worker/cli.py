"""``ps-worker``: join a job through shard 0 and train until the coordinator says stop."""

from __future__ import annotations

import argparse
import os
import sys

from ps_common.cli_util import add_common_args, interrupt_on_signals, load_cli_config, setup_logging, watch_parent
from ps_common.dmlc import read_dmlc_env
from ps_common.errors import PsError
from ps_common.rendezvous import resolve_endpoint


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ps-worker", description=__doc__)
    add_common_args(ap)
    ap.add_argument("--server", default=None,
                    help="shard 0 (coordinator) endpoint, tcp://HOST:PORT, or file:PATH: read it from PATH "
                         "(ps-server --endpoint-file) once this worker has started up (default: from "
                         "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
    ap.add_argument("--name", default=None,
                    help="this worker's stable name: logs, and the memory caps learned for it across "
                         "rejoins and restarts (default host:pid, which changes with every process)")
    ap.add_argument("--device", default=None, help="override worker.device (cpu, cuda, cuda:N, auto)")
    ap.add_argument("--max-iterations", type=int, default=None, help="leave after this many iterations")
    ap.add_argument("--scenario-index", type=int, default=None,
                    help="which scenario.workers entry applies to this worker (default: its worker id)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    watch_parent()
    try:
        overrides = list(args.set)
        if args.server is None:
            dmlc = read_dmlc_env(os.environ)
            if dmlc is None:
                ap.error("--server is required (or the dmlc variables: DMLC_ROLE=worker, DMLC_PS_ROOT_URI, ...)")
            args.server = dmlc.coordinator
            overrides += dmlc.overrides()
        if args.device:
            overrides.append(f"worker.device={args.device}")
        cfg = load_cli_config(args.config, overrides, args.secret_file)
        from ps_worker.worker import Worker  # torch: before waiting for shard 0

        server = resolve_endpoint(args.server, cfg.transport.connect_timeout_s)
        worker = Worker(cfg, server, name=args.name, run_dir=args.run_dir, overwrite=args.overwrite,
                        scenario_index=args.scenario_index)
        interrupt_on_signals()
        worker.run(max_iterations=args.max_iterations)
        return 0
    except KeyboardInterrupt:
        return 130
    except PsError as exc:  # anything else is a bug: its traceback is printed, exit 1
        print(f"ps-worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
