"""``ps-launch CONFIG``: run a whole job (shards, workers, evaluator) on this host."""

from __future__ import annotations

import argparse
import sys

from ps_common.cli_util import interrupt_on_signals, setup_logging
from ps_common.config import ConfigError, load_config
from ps_common.datasets import DatasetUnavailable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ps-launch", description=__doc__)
    ap.add_argument("config", help="job YAML (see configs/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set cluster.num_workers=4")
    ap.add_argument("--run-dir", default=None, help="output directory (default run.run_dir/NAME-TIME)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the run already in --run-dir (refused otherwise: metrics would mix)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    from ps_launcher.launcher import LocalCluster, RunFailed
    from ps_launcher.run_dir import RunDirInUse
    from ps_launcher.summary import summary_markdown

    cluster = LocalCluster(cfg, args.run_dir, progress=not args.no_progress, overwrite=args.overwrite)
    interrupt_on_signals()
    try:
        summary = cluster.run()
    except RunDirInUse as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"ps-launch: run failed: {exc}", file=sys.stderr)
        return 1
    except DatasetUnavailable as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    print(summary_markdown(summary))
    print(f"run directory: {cluster.run_dir}")
    return 130 if summary["stop_reason"].startswith("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
