"""``ps-evaluator``: measure test accuracy of a running job at fixed iteration counts."""

from __future__ import annotations

import argparse
import sys

from ps_common.cli_util import add_common_args, interrupt_on_signals, load_cli_config, setup_logging, watch_parent
from ps_common.errors import PsError
from ps_common.rendezvous import resolve_endpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ps-evaluator", description=__doc__)
    add_common_args(ap)
    ap.add_argument("--server", required=True,
                    help="shard 0 (coordinator) endpoint, or file:PATH (see ps-worker --server)")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    watch_parent()
    try:
        cfg = load_cli_config(args.config, args.set, args.secret_file)
        from ps_worker.evaluator import Evaluator  # torch: before waiting for shard 0

        server = resolve_endpoint(args.server, cfg.transport.connect_timeout_s)
        interrupt_on_signals()
        Evaluator(cfg, server, run_dir=args.run_dir, overwrite=args.overwrite).run()
        return 0
    except KeyboardInterrupt:
        return 130
    except PsError as exc:  # anything else is a bug: its traceback is printed, exit 1
        print(f"ps-evaluator: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
