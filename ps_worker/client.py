"""The worker side of the protocol: join through shard 0, push slices, get parameters back.

One round trip per iteration: each shard gets its slice of the gradient in a ``Push`` that
asks for the parameters (``pull``), and answers once it has applied the iteration the push
belonged to. Shard 0's answer carries the next assignment.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zmq

from ps_common import protocol as P
from ps_common.errors import PsError
from ps_common.faults import kill_in_push, nan_in_push
from ps_common.report import Telemetry
from ps_common.security.settings import SecurityConfig
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts
from ps_common.transport import Connection, RemoteError, TransportTimeout, undialable
from ps_worker.slice_assembly import SliceAssembly

log = logging.getLogger(__name__)


#: Error codes from shard 0 after which a worker joins again (new membership, new connections).
REJOIN_CODES = ("unknown_worker", "rolled_back", "unauthorized")


class ShardUnreachable(PsError, RuntimeError):
    """The coordinator's welcome names a shard address that cannot be dialed."""


class PullAborted(PsError, RuntimeError):
    """A pull given up because the membership or the coordinator changed under it."""


@dataclass
class PullResult:
    version: int
    version_time: float
    stop: bool
    assignment: P.Assignment | None
    wait_s: float  # until the first shard answered (the barrier)
    pull_s: float  # from the first answer until every slice was in place
    samples: int = 0  # shard 0's count of samples applied up to this version
    send_s: float = 0.0  # handing the push to ZeroMQ (push_pull only)
    log_hash: str = ""  # shard 0's log hash at ``version``


class ShardClients:
    """One DEALER per shard, authenticated as ``role``; shard 0 is reached at the address given."""

    def __init__(self, ctx: zmq.Context, server: str, *, timeout_s: float, connect_timeout_s: float,
                 security: SecurityConfig | None = None, role: str = "worker", hwm: int = 100,
                 timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        self.security = security
        self.timeouts = timeouts
        self.role = role
        self.hwm = hwm
        self.ctx = ctx
        self.server = server
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.conns: list[Connection] = []
        self.ranges: list[tuple[int, int]] = []
        self.welcome: P.Welcome | None = None
        self.token = ""
        self.instance = os.urandom(8).hex()  # one identity per process: a second join replaces the first
        self.name = ""
        # Heterogeneity lab: an added delay per push and per pull (a slower link); no-op by default.
        self.comm_delay: Callable[[int], float] = lambda nbytes: 0.0

    def _connection(self, endpoint: str, max_array_bytes: int = 1 << 32) -> Connection:
        return Connection(self.ctx, endpoint, role=self.role, timeout_s=self.timeout_s,
                          max_array_bytes=max_array_bytes, security=self.security, hwm=self.hwm,
                          timeouts=self.timeouts)

    def join(self, name: str, job_digest: str, device: str, *, memory_fits: int = 0,
             memory_fails: int = 0) -> P.Welcome:
        """Join the job; waits (up to connect_timeout_s) for the coordinator and all shards."""
        self.close()
        self.name = name
        c0 = self._connection(self.server)
        try:
            welcome = c0.request(P.Join(name=name, instance=self.instance, job_digest=job_digest,
                                        device=device, memory_fits=memory_fits,
                                        memory_fails=memory_fails),
                                 P.Welcome, timeout_s=self.connect_timeout_s)
        except TransportTimeout as exc:
            c0.close()
            if "refused" in str(exc) or "handshake" in str(exc):
                raise
            raise TransportTimeout(
                f"coordinator at {self.server} did not answer the join within "
                f"{self.connect_timeout_s:.0f}s (is ps-server --shard 0 running there, and have "
                "all shards registered?)") from None
        except BaseException:
            c0.close()
            raise
        assert isinstance(welcome, P.Welcome)
        bad = [f"shard {k}: {ep}" for k, ep in enumerate(welcome.shard_endpoints) if undialable(ep)]
        if bad:
            c0.close()
            raise ShardUnreachable(f"the job's shards advertise addresses no machine can dial "
                                   f"({', '.join(bad)}): restart them with --advertise HOST")
        try:
            check_layout(welcome)
        except P.ProtocolError as exc:   # a member already: say goodbye, so no round waits for it
            try:
                c0.request(P.Leave(worker_id=welcome.worker_id, reason=f"refused the layout: {exc}"[:200],
                                   token=welcome.token), P.Ack, timeout_s=2.0)
            except Exception:  # noqa: BLE001 - best effort: the heartbeat timeout covers it
                pass
            c0.close()
            raise
        self.welcome = welcome
        self.token = welcome.token
        self.ranges = [(int(a), int(b)) for a, b in welcome.shard_ranges]
        self.conns = [c0] + [self._connection(ep, (b - a) * 4)
                             for ep, (a, b) in zip(welcome.shard_endpoints[1:], self.ranges[1:])]
        c0.max_array_bytes = (self.ranges[0][1] - self.ranges[0][0]) * 4
        return welcome

    def push_pull(self, grads: np.ndarray, params: np.ndarray, *, worker_id: int,
                  assignment: P.Assignment, loss: float, telemetry: Telemetry,
                  consistent: bool = True, abort: Callable[[], str | None] | None = None) -> PullResult:
        """Send each shard its slice of the flat gradient (zero-copy) and wait for the
        parameters that include it. ``grads`` must not change until this returns."""
        self.comm_delay(grads.nbytes)
        kill = kill_in_push(self.name, assignment.iteration)
        if (k_nan := nan_in_push(self.name, assignment.iteration)) is not None:
            grads[self.ranges[k_nan][0]] = np.nan

        def push_to(k: int) -> None:
            a, b = self.ranges[k]
            self.conns[k].send(P.Push(worker_id=worker_id, token=self.token, iteration=assignment.iteration,
                                      batch_size=assignment.batch_size, loss=loss, pull=True,
                                      telemetry=telemetry if k == 0 else None, arrays=[grads[a:b]]))

        t0 = time.perf_counter()
        for k in range(len(self.conns)):
            if kill is None or k in kill["shards"]:
                push_to(k)
        if kill is not None:
            _die(kill)
        sent = time.perf_counter()
        res = self._collect(params, worker_id=worker_id, min_version=assignment.iteration + 1, t0=sent,
                            consistent=consistent, abort=abort, honor_stop=True, exact=False,
                            push_again=push_to)
        res.send_s = sent - t0
        return res

    def pull(self, params: np.ndarray, *, worker_id: int, min_version: int,
             honor_stop: bool = True, exact: bool = False, consistent: bool = True,
             abort: Callable[[], str | None] | None = None) -> PullResult:
        """Pull every shard's slice into ``params`` once its version reaches ``min_version``."""
        t0 = time.perf_counter()
        for conn in self.conns:
            conn.send(P.Pull(worker_id=worker_id, token=self.token, min_version=min_version, exact=exact))
        return self._collect(params, worker_id=worker_id, min_version=min_version, t0=t0,
                             consistent=consistent, abort=abort, honor_stop=honor_stop, exact=exact)

    def _collect(self, params: np.ndarray, *, worker_id: int, min_version: int, t0: float,
                 consistent: bool, abort: Callable[[], str | None] | None, honor_stop: bool,
                 exact: bool, push_again: Callable[[int], None] | None = None) -> PullResult:
        """Gather one answer per shard. With ``consistent`` (round modes) the shards can answer at
        different versions (a backup worker whose iteration was committed without it, an
        observer racing an update), so a shard behind the newest version seen is asked again
        for exactly that one; the result is one version, and its history (log hash) must be
        the same on every shard. Async modes take each shard's latest slice."""
        first: float | None = None
        replies: dict[int, P.Params] = {}
        arriving: dict[int, SliceAssembly] = {}  # answers of which some parts are in place
        poller = zmq.Poller()
        for conn in self.conns:
            poller.register(conn.sock, zmq.POLLIN)
        waiting = set(range(len(self.conns)))
        asked = dict.fromkeys(waiting, min_version)   # the version each shard's next answer must reach
        tries: dict[int, int] = {}         # plan_pending answers per shard
        resend_at: dict[int, float] = {}   # shard -> when its push goes again (plan_pending)
        error: RemoteError | None = None
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                for k in sorted(waiting):
                    self.conns[k].check_auth()
                eps = [self.conns[k].endpoint for k in sorted(waiting)]
                raise TransportTimeout(f"no parameters from {eps} within {self.timeout_s:.0f}s")
            for k in [k for k, at in resend_at.items() if at <= now]:
                del resend_at[k]
                assert push_again is not None  # only set when there is a push to send again
                push_again(k)
            wait_s = min(left, self.timeouts.pull_poll_s, *(at - now for at in resend_at.values()))
            events = dict(poller.poll(math.ceil(max(0.0, wait_s) * 1000)))
            if not events:
                for k in sorted(waiting):
                    self.conns[k].check_auth()
                if abort is not None and (reason := abort()):
                    raise PullAborted(reason)
            for k in sorted(waiting):
                conn = self.conns[k]
                if conn.sock not in events:
                    continue
                try:
                    reply = conn.recv(0)
                except RemoteError as exc:
                    if exc.code == "plan_pending" and push_again is not None:
                        # A follower got the push before shard 0's plan for it: send it again
                        # once the plan has had time to arrive (bounded by the pull deadline),
                        # reading the other shards' answers meanwhile.
                        tries[k] = tries.get(k, 0) + 1
                        resend_at[k] = time.monotonic() + self.timeouts.plan_pending_backoff.ceiling(tries[k] - 1)
                        continue
                    if k == 0 and exc.code in REJOIN_CODES:
                        # The coordinator ended this membership (rolled back, declared lost): the
                        # worker joins again on new connections, so nothing left queued on these
                        # can be mistaken for a later answer, and a shard that died is not waited for.
                        self._drain(waiting - {k} - set(arriving), 0.2, _owed(arriving, k))
                        raise
                    if push_again is not None:
                        # A shard refused this push for good (a NaN in its slice, a size or plan
                        # it does not hold, its bounds): the gradient can never be whole, so no
                        # shard will answer until the transport timeout, and a round would wait
                        # that long for it (120 s by default). Join again at once: the new Join
                        # ends this membership, the coordinator drops what the other shards hold
                        # of the gradient, and its samples are served again.
                        self._drain(waiting - {k} - set(arriving), 0.2, _owed(arriving, k))
                        raise PullAborted(f"shard {k} refused the push: [{exc.code}] {exc}") from None
                    # Keep draining the other shards' answers, so none is left queued to be
                    # mistaken for the answer to a later request.
                    error = error or exc
                    waiting.discard(k)
                    continue
                if not isinstance(reply, P.Params):
                    raise P.ProtocolError(f"{conn.endpoint}: expected params, got {reply.TYPE}")
                first = first or time.perf_counter()
                if k == 0 and reply.stop and honor_stop and k not in arriving:
                    self._drain(waiting - {0} - set(arriving), self.timeouts.stop_drain_s,
                                {**_owed(arriving, 0), 0: reply.parts - 1})
                    return PullResult(reply.version, reply.version_time, True, None,
                                      first - t0, time.perf_counter() - first)
                a, b = self.ranges[k]
                if (parts := arriving.get(k)) is None:
                    if consistent and reply.version < asked[k] and not reply.stop:
                        # Round modes: a shard answers a pull once its version reaches the one
                        # asked (or with the stop). An older one is not an answer to this request
                        # (a forger on a shard's address, a server bug), and training on it would
                        # push a gradient of other parameters than the iteration's. (Async modes
                        # answer by the worker's own clock, not the shard's version.)
                        raise P.ProtocolError(f"{conn.endpoint} answered version {reply.version} to a pull "
                                              f"of version {asked[k]} or later")
                    parts = arriving[k] = SliceAssembly(k, reply, params[a:b])
                else:
                    parts.add(reply)
                if not parts.complete:
                    continue
                del arriving[k]
                replies[k] = parts.head
                waiting.discard(k)
            if error is not None or not consistent or not replies:
                continue
            target = max(r.version for r in replies.values())
            for k, r in list(replies.items()):
                if r.version < target:
                    del replies[k]
                    waiting.add(k)
                    asked[k] = target
                    self.conns[k].send(P.Pull(worker_id=worker_id, token=self.token, min_version=target))
        if error is not None:
            raise error
        self.comm_delay(params.nbytes)
        if consistent and not exact:
            hashes = {r.log_hash for r in replies.values()}
            if len(hashes) > 1:
                raise P.ProtocolError(f"shards at version {replies[0].version} report different "
                                      f"histories {sorted(hashes)}: refusing mixed parameters")
        r0 = replies[0]
        assert first is not None
        if consistent and r0.assignment is not None and r0.assignment.iteration != r0.version:
            # Round modes: shard 0 hands out the assignment of the version it answers with. Another
            # (a repeat of an earlier one: a forger on its address, a server bug) would be computed
            # for nothing (its push is refused) or for other parameters than the iteration's.
            raise P.ProtocolError(f"{self.conns[0].endpoint} answered version {r0.version} with an "
                                  f"assignment for iteration {r0.assignment.iteration}")
        return PullResult(r0.version, max(r.version_time for r in replies.values()), r0.stop,
                          r0.assignment, first - t0, time.perf_counter() - first, r0.samples,
                          log_hash=r0.log_hash)

    def _drain(self, shards: set[int], timeout_s: float, owed: dict[int, int] | None = None) -> None:
        """Read the answers still coming from ``shards``, every part of each, and the parts
        ``owed`` by answers begun already, so nothing stale stays queued to be mistaken for a
        later answer."""
        owed = dict(owed or {})
        deadline = time.monotonic() + timeout_s
        for k in sorted(shards | set(owed)):
            left = owed.get(k)  # None: the answer's first message is still to come
            while left is None or left > 0:
                try:
                    msg = self.conns[k].recv(max(0.0, deadline - time.monotonic()))
                except (TransportTimeout, RemoteError, P.ProtocolError):
                    break
                if left is None:  # a first message: a Params announces its parts, anything else is whole
                    left = msg.parts if isinstance(msg, P.Params) else 1
                left -= 1

    def send_to_coordinator(self, msg: P.Message, expect: type[P.Message],
                            timeout_s: float | None = None) -> P.Message:
        return self.conns[0].request(msg, expect, timeout_s)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns = []


def _owed(arriving: dict[int, SliceAssembly], skip: int) -> dict[int, int]:
    """Parts still to come of the answers begun, but shard ``skip``'s."""
    return {k: a.head.parts - a.count for k, a in arriving.items() if k != skip}


def _die(kill: dict) -> None:
    """Fault injection: let the frames already sent leave, then die without a goodbye."""
    import signal

    time.sleep(float(kill.get("delay_s", 0.5)))
    log.warning("fault injection: SIGKILL in the middle of a push")
    os.kill(os.getpid(), signal.SIGKILL)


def check_layout(welcome: P.Welcome) -> None:
    """The shards' slices must tile the model, one per shard, in order: ``[0, a), [a, b), ...,
    [.., num_params)``. A gap would leave parameters that no answer ever fills (the worker's
    buffer holds whatever it held before), an overlap would write one slice over another."""
    ranges, n = welcome.shard_ranges, welcome.num_params
    end = 0
    for k, r in enumerate(ranges):
        if len(r) != 2 or r[0] != end or not r[0] < r[1]:
            raise P.ProtocolError(f"the coordinator's shard ranges {ranges} do not tile the model's "
                                  f"{n} parameters (shard {k})")
        end = r[1]
    if end != n or not ranges or len(ranges) != len(welcome.shard_endpoints):
        raise P.ProtocolError(f"the coordinator's shard ranges {ranges} do not tile the model's {n} "
                              f"parameters over its {len(welcome.shard_endpoints)} shards")
