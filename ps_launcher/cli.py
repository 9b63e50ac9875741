"""``ps-launch CONFIG``: run a whole job (shards, workers, evaluator) on this host."""

from __future__ import annotations

import argparse
import sys

from ps_common.cli_util import interrupt_on_signals, setup_logging
from ps_common.config import load_config
from ps_common.errors import PsError
from ps_server.job_config import check_job_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ps-launch", description=__doc__)
    ap.add_argument("config", help="job YAML (see configs/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set cluster.num_workers=4")
    ap.add_argument("--run-dir", default=None, help="output directory (default run.run_dir/NAME-TIME)")
    ap.add_argument("--backend", choices=("local", "ray", "slurm"), default="local",
                    help="local: start every process here; ray: on a Ray cluster (the ray: section places "
                         "them; pip install lbbsp-ps[ray]); slurm: with --print, write the run directory's "
                         "config and print an sbatch script that runs the job on a Slurm allocation")
    ap.add_argument("--address", default=None,
                    help="(--backend ray) the Ray cluster: HOST:PORT of its head, or auto (a running one); "
                         "default: RAY_ADDRESS, else a Ray started on this host for the run")
    ap.add_argument("--print", dest="print_only", action="store_true",
                    help="(--backend slurm) print the sbatch script instead of running anything")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the run already in --run-dir (refused otherwise: metrics would mix)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    from ps_launcher.launcher import RunFailed

    try:
        return _launch(args)
    except RunFailed as exc:
        print(f"ps-launch: run failed: {exc}", file=sys.stderr)
        return 1
    except PsError as exc:  # a bad config, a run directory in use, no dataset...
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, check=check_job_config)
    from ps_launcher.launcher import LocalCluster, new_run_dir
    from ps_launcher.run_dir import prepare_run_dir
    from ps_launcher.summary import summary_markdown

    if args.backend == "slurm":
        if not args.print_only:
            print("ps-launch: --backend slurm writes a script: add --print, then submit it with sbatch",
                  file=sys.stderr)
            return 2
        from pathlib import Path

        from ps_common.config import dump_yaml
        from ps_launcher.slurm import sbatch_script

        run_dir = Path(args.run_dir or new_run_dir(cfg)).resolve()
        prepare_run_dir(run_dir, args.overwrite)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        print(sbatch_script(cfg, run_dir / "config.yaml", run_dir), end="")
        return 0

    cluster: LocalCluster
    if args.backend == "ray":
        try:
            from ps_launcher.ray_backend import RayCluster
        except ImportError:
            print("ps-launch: --backend ray needs Ray: pip install 'lbbsp-ps[ray]'", file=sys.stderr)
            return 2
        try:
            cluster = RayCluster(cfg, args.run_dir, address=args.address, progress=not args.no_progress,
                                 overwrite=args.overwrite)
        except ValueError as exc:
            print(f"ps-launch: {exc}", file=sys.stderr)
            return 2
    else:
        cluster = LocalCluster(cfg, args.run_dir, progress=not args.no_progress, overwrite=args.overwrite)
    interrupt_on_signals()
    summary = cluster.run()
    print(summary_markdown(summary))
    print(f"run directory: {cluster.run_dir}")
    return 130 if summary["stop_reason"].startswith("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
