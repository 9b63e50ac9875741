"""``ps-server``: serve one parameter shard (shard 0 also coordinates the job)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ps_common.cli_util import add_common_args, load_cli_config, setup_logging, watch_parent
from ps_common.config import ConfigError
from ps_common.credentials import CredentialError, generate_master
from ps_common.datasets import DatasetUnavailable
from ps_server.checkpoint import CheckpointError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ps-server", description=__doc__)
    add_common_args(ap)
    ap.add_argument("--shard", type=int, default=0, help="shard index, 0..cluster.num_shards-1")
    ap.add_argument("--host", default=None, help="address to bind (default cluster.host, 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    ap.add_argument("--advertise", default=None,
                    help="host name other machines use to reach this shard (multi-host runs)")
    ap.add_argument("--coordinator", default=None, help="shard 0's endpoint (required for shard > 0)")
    ap.add_argument("--resume", action="store_true",
                    help="restart from this shard's newest checkpoint (checkpoint.dir or RUN_DIR/checkpoints)")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    watch_parent()
    try:
        cfg = load_cli_config(args.config, args.set, args.secret_file)
        _make_secret_if_new(cfg, args.shard)
        from ps_server.server import ShardServer

        server = ShardServer(cfg, args.shard, host=args.host, port=args.port,
                             advertise_host=args.advertise, coordinator=args.coordinator,
                             run_dir=args.run_dir, resume=args.resume)
    except (ConfigError, DatasetUnavailable, ValueError, CheckpointError, CredentialError) as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return 2
    server.install_signal_handlers()
    print(f"ps-server shard {args.shard} listening on {server.endpoint}", flush=True)
    try:
        server.run()
    except RuntimeError as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return 1
    return server.exit_code


def _make_secret_if_new(cfg, shard: int) -> None:
    """Shard 0 of a hand-started job makes the job secret it was pointed at, if it is new."""
    path = cfg.security.secret_file
    if shard == 0 and path and not cfg.security.curve and not Path(path).exists():
        generate_master(path)
        print(f"ps-server: made a new job secret at {path}: give it to the other shards; workers "
              f"and the evaluator may get role files instead (ps-keys secret --role ...)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
