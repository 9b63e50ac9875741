"""``ps-bsm``: one :class:`~batchsize_manager.manager.BatchSizeManager` served over the protocol.

Training loops in other processes or frameworks (a DDP job, a JAX loop, a shell script through
:class:`ps_server.bsm_client.BatchSizeClient`) ask it for batch sizes: ``BsmJoin``/``BsmLeave``
change membership, ``BsmReport`` feeds one worker's measurements of a finished iteration,
``BsmAssign`` returns the next split (``BsmAssignment``) and ``BsmStats`` the counters.

Clients choose worker ids (a DDP rank, a host's index), so an id proves nothing: a join answers
with a random token, and a leave or report of a live worker must carry it. Joining a live id is
a restart of that worker (a process that comes back under its rank has lost its token): it gets
a fresh token and the old one is void, so an earlier incarnation, or a second process started
with the same id by mistake, is refused (``bad_token``) instead of mixing its reports in. That
is a rule against stale and confused clients, not against a holder of the worker credential,
who can take any id over by joining it; the takeover is logged and counted (``rejoins``).

With ``world_size`` (``ps-bsm --world-size N``) it also exchanges the gradients of a DDP job's
N ranks (:mod:`ps_server.exchange`): ``ExchangeOpen``/``ExchangePush`` replace the ring
all-reduce, the split of every iteration is decided here and rides on the last bucket's answer.
Membership is then the fixed world (ranks 0..N-1), so join, leave, report and assign are refused.

The manager stays free of ZeroMQ; this module is only the I/O loop around it: a ROUTER socket,
a dispatch table, a receive timeout on every poll so that SIGINT/SIGTERM (or :meth:`stop`) end
it promptly. Every message is decoded and validated before it touches the manager; bad input
is answered with :class:`~ps_common.protocol.Error`, counted and logged, never a crash.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping

import zmq

from batchsize_manager import BatchSizeManager, WorkerReport
from ps_common import protocol as P
from ps_common.cli_util import StopFlag
from ps_common.errors import PsError
from ps_common.open_files import ensure_open_files, open_files_for
from ps_common.security.settings import SecurityConfig
from ps_common.security.sockets import close_socket
from ps_common.transport import DEFAULT_HWM, advertised, bind_address, make_router
from ps_server.exchange import GradientExchange
from ps_server.router import Limits, Refused, RouterLoop, worth_logging

log = logging.getLogger(__name__)

#: Largest message accepted (ZMQ_MAXMSGSIZE): a header and nothing else; no BSM message has arrays.
MAX_MSG_BYTES = P.MAX_HEADER_BYTES + 4096
#: Largest gradient bucket an exchange accepts (DDP's default buckets are 25 MB).
DEFAULT_MAX_BUCKET_BYTES = 256 << 20


def _worker_id(w: int) -> int:
    if w < 0:
        raise Refused("bad_request", f"worker_id must be a non-negative int, got {w}")
    return w


class BatchSizeService:
    """A ROUTER loop around one manager. Not thread-safe: one thread runs :meth:`run`.

    ``stop()`` may be called from any thread (or a signal handler); ``run()`` returns within one
    poll interval and closes the socket.
    """

    def __init__(self, manager: BatchSizeManager, *, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, ctx: zmq.Context | None = None,
                 security: SecurityConfig | None = None, poll_s: float = 0.1,
                 world_size: int | None = None, max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
                 stale_s: float = 60.0) -> None:
        self.manager = manager
        self.ctx = ctx or zmq.Context.instance()
        self.poll_s = float(poll_s)
        #: The gradient exchange of a DDP world, when the service serves one.
        self.exchange = (GradientExchange(manager, world_size, stale_s=stale_s,
                                          max_bytes=max(4 * max_bucket_bytes, 1 << 31))
                         if world_size is not None else None)
        array_bytes = max_bucket_bytes if self.exchange is not None else 0
        # a connection per rank; without --world-size the ranks are not known: room for 1,024
        ensure_open_files(open_files_for(world_size or 1024), "ps-bsm")
        # A rank reads the answers of an iteration's buckets only after sending its last one
        # (DDP's hook): up to max_buckets of them wait for it, and must not be dropped.
        send_hwm = None if self.exchange is None else max(DEFAULT_HWM, self.exchange.max_buckets + 64)
        self.sock, bound = make_router(self.ctx, bind_address(host, port),
                                       max_msg_bytes=MAX_MSG_BYTES + array_bytes, security=security,
                                       send_hwm=send_hwm)
        self.endpoint = advertised(bound, advertise_host)
        self.stop_event = StopFlag()
        self.started = time.monotonic()
        self.reports = 0
        self.rejoins = 0        # joins of a live id: a restarted worker, or a takeover
        self.answers_lost = 0   # exchange answers the socket could not take (see _send)
        self._closed = False
        #: The token of every live worker (at most X / min_batch of them).
        self._tokens: dict[int, str] = {}
        self.handlers: dict[type[P.Message], Callable[[Any, str], P.Message]] = {
            P.BsmJoin: self._on_join,
            P.BsmLeave: self._on_leave,
            P.BsmReport: self._on_report,
            P.BsmAssign: self._on_assign,
            P.BsmStats: self._on_stats,
        }
        routes: dict[type, Callable[[bytes, str, Any], P.Message | None]] = {}
        if self.exchange is not None:
            routes[P.ExchangeOpen] = self._dispatch_open  # may also tell an abandoned iteration's ranks
            routes[P.ExchangePush] = self._dispatch_push  # answered later, to every rank at once
        routes.update({kind: self._dispatch for kind in self.handlers})
        # With credentials, workers report and the operator may do anything but send gradients;
        # without, anyone may do anything.
        perms = None
        if security is not None and security.mechanism != "none":
            anyone = frozenset({"worker", "operator"})
            perms = {kind: anyone for kind in routes}
            perms[P.ExchangeOpen] = perms[P.ExchangePush] = frozenset({"worker"})
        self.router = RouterLoop(self.sock, routes, server="ps-bsm",
                                 limits=Limits(max_frames=4, max_array_bytes=array_bytes),
                                 permissions=perms)

    @property
    def requests(self) -> int:
        return self.router.counters["received"]

    @property
    def malformed(self) -> int:
        return self.router.counters["malformed"]

    @property
    def errors_sent(self) -> int:
        return self.router.counters["errors_sent"]

    # ----- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`stop` (or SIGINT/SIGTERM once handlers are installed)."""
        try:
            while not self.stop_event.is_set():
                self.router.poll(int(self.poll_s * 1000))
                if self.exchange is not None:
                    self._send(self.exchange.expire())
        finally:
            self.close()

    def start(self, name: str = "ps-bsm") -> threading.Thread:
        """Run the loop in a daemon thread (tests, embedding); ``stop()`` then ``join()`` it."""
        t = threading.Thread(target=self.run, name=name, daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        log.info("ps-bsm stopping: %d requests, %d reports, %d decisions, %d malformed, %d errors sent",
                 self.requests, self.reports, self.manager.decisions, self.malformed, self.errors_sent)
        if self.exchange is not None:
            log.info("ps-bsm exchange: %d iterations completed, %d failed or abandoned",
                     self.exchange.completed, self.exchange.abandoned)
        close_socket(self.sock)

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM end :meth:`run` cleanly (main thread only)."""
        self.stop_event.install((signal.SIGINT, signal.SIGTERM))

    # ----- dispatch ------------------------------------------------------------------------
    def handle(self, frames: list[zmq.Frame]) -> None:
        """Answer one message; nothing a peer sends raises out of here."""
        self.router.handle(frames)

    def _dispatch(self, ident: bytes, role: str, msg: P.Message) -> P.Message:
        return _guarded(msg, lambda: self.handlers[type(msg)](msg, role))

    def _dispatch_open(self, ident: bytes, role: str, msg: P.ExchangeOpen) -> None:
        assert self.exchange is not None
        exchange = self.exchange
        _guarded(msg, lambda: self._send(exchange.open(ident, msg.worker_id, msg.iteration, msg.job)))

    def _dispatch_push(self, ident: bytes, role: str, msg: P.ExchangePush) -> None:
        assert self.exchange is not None
        exchange = self.exchange
        _guarded(msg, lambda: self._send(exchange.push(ident, msg)))

    # ----- handlers: each returns the reply or raises Refused -------------------------------
    def _fixed_world(self, what: str) -> None:
        if self.exchange is not None:
            raise Refused("not_supported", f"this service exchanges the gradients of a world of "
                                           f"{self.exchange.world} ranks, which decides its own "
                                           f"membership and splits: {what} is not accepted")

    def _on_join(self, msg: P.BsmJoin, role: str) -> P.Message:
        self._fixed_world("bsm_join")
        w = _worker_id(msg.worker_id)
        m = self.manager
        live = m.is_live(w)
        limit = m.global_batch // m.min_batch  # more workers than this can never be assigned
        if not live and len(m.live_workers) >= limit:
            raise Refused("too_many_workers",
                          f"{len(m.live_workers)} workers are live; X={m.global_batch} with "
                          f"min_batch={m.min_batch} cannot be split over more than {limit}")
        if live:
            self.rejoins += 1
            if worth_logging(self.rejoins):
                log.info("worker %d joined again: a restart (or another process under its id); "
                         "its previous token is void (%d rejoins so far)", w, self.rejoins)
        else:
            m.join(w)
        token = self._tokens[w] = secrets.token_hex(16)
        return P.BsmWelcome(worker_id=w, token=token)

    def _check_token(self, w: int, token: str) -> None:
        """``token`` is live worker ``w``'s current one."""
        held = self._tokens.get(w)
        if held is None or not secrets.compare_digest(held.encode(), token.encode()):
            raise Refused("bad_token", f"the request does not carry worker {w}'s token: it is "
                                       f"given by bsm_join, and a later join of worker {w} (a "
                                       f"restart under that id) voids the earlier ones")

    def _on_leave(self, msg: P.BsmLeave, role: str) -> P.Message:
        self._fixed_world("bsm_leave")
        w = _worker_id(msg.worker_id)
        if self.manager.is_live(w):
            if role != "operator":          # the operator may evict a worker that died
                self._check_token(w, msg.token)
            self.manager.leave(w)
            self._tokens.pop(w, None)
        return P.Ack(what="bsm_leave")

    def _on_report(self, msg: P.BsmReport, role: str) -> P.Message:
        self._fixed_world("bsm_report")
        w = _worker_id(msg.worker_id)
        if msg.iteration < 0:
            raise Refused("bad_request", f"iteration must be >= 0, got {msg.iteration}")
        if not 0 <= msg.batch_size <= self.manager.global_batch:   # no worker's share exceeds X
            raise Refused("bad_request", f"batch_size must be in [0, {self.manager.global_batch}], "
                                         f"got {msg.batch_size}")
        if not self.manager.is_live(w):
            raise Refused("unknown_worker", f"worker {w} is not live (join it first)")
        self._check_token(w, msg.token)
        self.manager.observe(WorkerReport.received(w, msg.iteration, msg.batch_size, msg.telemetry))
        self.reports += 1
        return P.Ack(what="bsm_report")

    def _on_assign(self, msg: P.BsmAssign, role: str) -> P.Message:
        self._fixed_world("bsm_assign")
        m = self.manager
        if not m.live_workers:
            raise Refused("no_workers", "no live workers: join at least one before asking for a split")
        try:
            sizes = m.assign()
        except ValueError as exc:  # the bounds cannot hold X (check_feasible says why)
            raise Refused("infeasible", str(exc)) from None
        except RuntimeError as exc:  # the policy broke its contract (validated by the manager)
            raise Refused("policy_error", str(exc)) from None
        ws = sorted(sizes)
        return P.BsmAssignment(workers=ws, batch_sizes=[int(sizes[w]) for w in ws],
                               global_batch=m.global_batch, decision_s=float(m.last_decision_s))

    def _send(self, replies: list[tuple[bytes, P.Message]]) -> None:
        for ident, reply in replies:
            if not self.router.reply(ident, reply) and isinstance(reply, P.ExchangeResult):
                self.answers_lost += 1   # a rank gone, or not reading: it times out, and so fails
                if worth_logging(self.answers_lost, 20):
                    log.warning("the sum of bucket %d of iteration %d could not be sent to a rank "
                                "(gone, or not reading); %d lost so far", reply.bucket,
                                reply.iteration, self.answers_lost)

    def _on_stats(self, msg: P.BsmStats, role: str) -> P.Message:
        m = self.manager
        last = m.last_assignment
        return P.BsmStatsReply(
            policy=m.policy.name or type(m.policy).__name__, global_batch=m.global_batch,
            min_batch=m.min_batch, max_batch=m.max_batch, live=m.live_workers,
            last_workers=sorted(last), last_batch_sizes=[int(last[w]) for w in sorted(last)],
            decisions=m.decisions, last_decision_s=float(m.last_decision_s),
            mean_decision_s=float(m.mean_decision_s), total_decision_s=float(m.total_decision_s),
            reports=self.reports, ignored_reports=m.ignored_reports, rejoins=self.rejoins,
            requests=self.requests,
            malformed=self.malformed, errors_sent=self.errors_sent,
            uptime_s=time.monotonic() - self.started,
            state=_plain_state(m.state_dict()) if msg.include_state else {})


_internal_errors = 0   # handler failures logged with a traceback (the first 20, then 1 in 1,000)


def _guarded(msg: P.Message, handle: Callable[[], Any]) -> Any:
    """``handle()``, with any failure but a refusal answered as ``internal``: a policy bug must
    not take the service down."""
    global _internal_errors
    try:
        return handle()
    except Refused:
        raise
    except Exception as exc:
        _internal_errors += 1
        if worth_logging(_internal_errors, 20):
            log.exception("%s failed (%d internal errors so far)", msg.TYPE, _internal_errors)
        raise Refused("internal", f"{type(exc).__name__}: {exc}") from None


def _plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict()`` as msgpack-safe plain data (it is JSON-able by contract)."""
    return json.loads(json.dumps(state, default=str))


# ----- CLI ---------------------------------------------------------------------------------
def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _security(args: argparse.Namespace) -> SecurityConfig | None:
    if not args.curve:
        return None
    cfg = SecurityConfig(curve=True, server_secret_key=args.server_secret_key,
                         allowed_clients_dir=args.allowed_clients_dir)
    cfg.require_server()
    return cfg


def main(argv: list[str] | None = None) -> int:
    """``ps-bsm``: serve a batch-size manager; prints the endpoint it bound, stops on SIGINT/SIGTERM."""
    from batchsize_manager import policy_names

    ap = argparse.ArgumentParser(prog="ps-bsm", description=main.__doc__)
    ap.add_argument("--policy", default="lbbsp-cpu", help=f"batch policy: {', '.join(policy_names())}")
    ap.add_argument("--global-batch", type=int, required=True, help="X, the constant global batch")
    ap.add_argument("--min-batch", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=None, help="cap on every worker's batch")
    ap.add_argument("--policy-args", default="{}", metavar="JSON",
                    help='policy keyword arguments, e.g. \'{"predictor": "ema"}\'')
    ap.add_argument("--world-size", type=int, default=None, metavar="N",
                    help="also exchange the gradients of a DDP job's N ranks (its split is decided here)")
    ap.add_argument("--max-bucket-mb", type=float, default=DEFAULT_MAX_BUCKET_BYTES / (1 << 20),
                    help="with --world-size: the largest gradient bucket accepted")
    ap.add_argument("--stale-s", type=float, default=60.0,
                    help="with --world-size: abandon an iteration held this long without progress")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind")
    ap.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    ap.add_argument("--advertise", default=None, help="host name clients use to reach this service")
    ap.add_argument("--curve", action="store_true", help="CURVE encryption and client allow-list")
    ap.add_argument("--server-secret-key", default=None, help="with --curve: the server .key_secret file")
    ap.add_argument("--allowed-clients-dir", default=None, help="with --curve: allowed clients' .key files")
    ap.add_argument("--log-level", default=os.environ.get("LBBSP_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        manager = BatchSizeManager(args.policy, args.global_batch, min_batch=args.min_batch,
                                   max_batch=args.max_batch,
                                   policy_args=_json_object(args.policy_args, "--policy-args"))
        if args.world_size is not None and args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        if not args.max_bucket_mb > 0 or not args.stale_s > 0:
            raise ValueError("--max-bucket-mb and --stale-s must be > 0")
        service = BatchSizeService(manager, host=args.host, port=args.port,
                                   advertise_host=args.advertise, security=_security(args),
                                   world_size=args.world_size,
                                   max_bucket_bytes=int(args.max_bucket_mb * (1 << 20)),
                                   stale_s=args.stale_s)
    except (PsError, ValueError, TypeError, zmq.ZMQError) as exc:
        print(f"ps-bsm: error: {exc}", file=sys.stderr)
        return 2
    service.install_signal_handlers()
    print(f"ps-bsm listening on {service.endpoint}", flush=True)
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
