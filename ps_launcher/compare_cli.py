"""``ps-compare CONFIG``: every listed mode on the same scenario, R repeats, one report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ps_common.cli_util import interrupt_on_signals, setup_logging
from ps_common.errors import PsError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ps-compare", description=__doc__)
    ap.add_argument("config", help="comparison YAML: a job config plus a 'compare' section")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a base config value for every mode")
    ap.add_argument("--repeats", type=int, default=None, help="override compare.repeats")
    ap.add_argument("--out", default=None, help="report directory (default runs/compare-NAME-TIME)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the runs already in --out (refused otherwise: metrics would mix)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    from ps_launcher.compare import (
        ComparisonInterrupted,
        default_out_dir,
        load_comparison,
        report_table,
        run_comparison,
    )
    from ps_launcher.run_dir import RunDirInUse

    interrupt_on_signals()

    try:
        base, comp = load_comparison(args.config, args.set)
    except PsError as exc:
        print(f"ps-compare: {exc}", file=sys.stderr)
        return 2
    if args.repeats is not None:
        comp = comp.model_copy(update={"repeats": args.repeats})
    out = Path(args.out) if args.out else default_out_dir(base)
    try:
        rows = run_comparison(base, comp, out, progress=not args.no_progress, overwrite=args.overwrite)
    except RunDirInUse as exc:
        print(f"ps-compare: {exc}", file=sys.stderr)
        return 2
    except ComparisonInterrupted as exc:
        print(f"ps-compare: {exc}", file=sys.stderr)
        return 130
    except PsError as exc:  # a run that failed, no dataset...
        print(f"ps-compare: {exc}", file=sys.stderr)
        return 1
    target = comp.target_accuracy or base.training.target_accuracy or 0.97
    print(report_table(rows, [m.name for m in comp.modes], target))
    print(f"\nreport: {out / 'report.md'}  (runs.csv, accuracy_vs_time.png, iteration_time.png, batch_size.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
