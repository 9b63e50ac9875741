"""``ps-server``: serve one parameter shard (shard 0 also coordinates the job)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ps_common.cli_util import add_common_args, load_cli_config, setup_logging, watch_parent
from ps_common.dmlc import DmlcEnv, read_dmlc_env
from ps_common.errors import PsError
from ps_common.rendezvous import remove_endpoint, resolve_endpoint, write_endpoint
from ps_common.security.credentials import generate_master
from ps_server.job_config import check_job_config
from ps_server.threads import sleep_between_updates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ps-server", description=__doc__)
    add_common_args(ap)
    ap.add_argument("--shard", type=int, default=None,
                    help="shard index, 0..cluster.num_shards-1 (default 0, or from DMLC_ROLE: see below)")
    ap.add_argument("--name", default=None,
                    help="this server's name, stable across its restarts and unique in the job "
                         "(DMLC_ROLE=server: the follower index is claimed by it, so a restarted server "
                         "gets its index back, also from a resumed shard 0; two live servers of one name "
                         "would both be that index; Kubernetes: the pod name). Default: a random one")
    ap.add_argument("--host", default=None, help="address to bind (default cluster.host, 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    ap.add_argument("--advertise", default=None,
                    help="host name other machines use to reach this shard (multi-host runs)")
    ap.add_argument("--coordinator", default=None,
                    help="shard 0's endpoint (required for shard > 0), or file:PATH: read it from PATH, which "
                         "shard 0's --endpoint-file writes, once this server has started up (all processes "
                         "of a job can start at once; waits up to transport.connect_timeout_s)")
    ap.add_argument("--endpoint-file", default=None,
                    help="write the endpoint this shard listens on into this file once bound (for "
                         "launchers on a shared file system: bind port 0, let the others read it)")
    ap.add_argument("--resume", nargs="?", const="always", default=None, choices=("always", "auto"),
                    help="restart from this shard's newest checkpoint (checkpoint.dir or RUN_DIR/checkpoints); "
                         "'--resume auto': only if it has one, else start afresh (a container that "
                         "a cluster manager restarts runs the same command as the first time)")
    ap.epilog = ("Without --shard and --coordinator, the dmlc variables (DMLC_ROLE, DMLC_PS_ROOT_URI, "
                 "DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER) say what to run: the scheduler "
                 "is shard 0, a server a follower shard, a worker a worker (ps_common/dmlc.py).")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    watch_parent()
    try:
        dmlc = read_dmlc_env(os.environ) if args.shard is None and args.coordinator is None else None
    except PsError as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return 2
    if dmlc is not None and dmlc.role == "worker":
        return _run_worker(args, dmlc)
    sleep_between_updates()   # before anything imports torch (ps_server.threads)
    try:
        overrides = list(args.set) + (dmlc.overrides() if dmlc is not None else [])
        cfg = load_cli_config(args.config, overrides, args.secret_file, check=check_job_config)
        shard = 0 if args.shard is None else args.shard
        host, port, advertise, coordinator = args.host, args.port, args.advertise, args.coordinator
        if dmlc is not None:
            host = host or "0.0.0.0"
            advertise = advertise or (dmlc.root_uri if dmlc.role == "scheduler" else dmlc.advertise())
            if dmlc.role == "scheduler":
                port = port or dmlc.root_port
            else:
                coordinator = dmlc.coordinator
                shard = _claim_shard(cfg, coordinator, args.name)
        _make_secret_if_new(cfg, shard)
        from ps_server.server import ShardServer  # torch: before waiting for shard 0

        if coordinator is not None:
            coordinator = resolve_endpoint(coordinator, cfg.transport.connect_timeout_s)
        server = ShardServer(cfg, shard, host=host, port=port, advertise_host=advertise,
                             coordinator=coordinator, run_dir=args.run_dir,
                             resume="auto" if args.resume == "auto" else args.resume == "always",
                             overwrite=args.overwrite)
    except PsError as exc:  # anything else is a bug: its traceback is printed, exit 1
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return 2
    if shard == 0 and args.run_dir:  # the config beside shard 0's records, for ps-summary
        cfg_file = Path(args.run_dir) / "config.yaml"
        if args.overwrite or not cfg_file.exists():
            from ps_common.config import dump_yaml

            cfg_file.parent.mkdir(parents=True, exist_ok=True)
            cfg_file.write_text(dump_yaml(cfg))
    server.install_signal_handlers()
    print(f"ps-server shard {shard} listening on {server.endpoint}", flush=True)
    if args.endpoint_file:
        write_endpoint(args.endpoint_file, server.endpoint)
    try:
        server.run()
    except PsError as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.endpoint_file:   # a process started after this one ends waits for the next shard 0
            remove_endpoint(args.endpoint_file, server.endpoint)
    return server.exit_code


def _claim_shard(cfg, coordinator: str, name: str | None) -> int:
    """A follower index from the coordinator (dmlc servers are started without one), claimed by
    ``name``; without one, by a random id that a restarted server cannot reclaim."""
    import uuid

    import zmq

    from ps_common import protocol as P
    from ps_common.transport import Connection

    conn = Connection(zmq.Context.instance(), coordinator, role="shard", security=cfg.security,
                      timeout_s=cfg.transport.connect_timeout_s)
    try:
        reply = conn.request(P.ClaimShard(job_digest=cfg.job_digest(), instance=name or uuid.uuid4().hex),
                             P.ShardClaimed)
    finally:
        conn.close()
    assert isinstance(reply, P.ShardClaimed)
    return reply.shard


def _run_worker(args: argparse.Namespace, dmlc: DmlcEnv) -> int:
    """``DMLC_ROLE=worker``: the same command line runs a worker (dmlc-submit starts one command
    for every role)."""
    from ps_worker import cli as worker_cli

    argv = ["--config", args.config, "--log-level", args.log_level,
            *[x for kv in args.set for x in ("--set", kv)]]
    if args.run_dir:
        argv += ["--run-dir", args.run_dir]
    if args.overwrite:
        argv.append("--overwrite")
    if args.secret_file:
        argv += ["--secret-file", args.secret_file]
    return worker_cli.main(argv)


def _make_secret_if_new(cfg, shard: int) -> None:
    """Shard 0 of a hand-started job makes the job secret it was pointed at, if it is new."""
    path = cfg.security.secret_file
    if shard == 0 and path and not cfg.security.curve and not Path(path).exists():
        generate_master(path)
        print(f"ps-server: made a new job secret at {path}: give it to the other shards; workers "
              f"and the evaluator may get role files instead (ps-keys secret --role ...)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
