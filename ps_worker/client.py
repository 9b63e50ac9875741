"""The worker side of the protocol: join through shard 0, push slices, pull all shards."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zmq

from ps_common import protocol as P
from ps_common.security import SecurityConfig
from ps_common.transport import Connection, RemoteError, TransportTimeout

log = logging.getLogger(__name__)


class PullAborted(RuntimeError):
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


class ShardClients:
    """One DEALER per shard; shard 0 (the coordinator) is reached at the address given."""

    def __init__(self, ctx: zmq.Context, server: str, *, timeout_s: float, connect_timeout_s: float,
                 security: SecurityConfig | None = None) -> None:
        self.security = security
        self.ctx = ctx
        self.server = server
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.conns: list[Connection] = []
        self.ranges: list[tuple[int, int]] = []
        self.welcome: P.Welcome | None = None
        self.token = ""
        # Heterogeneity lab: an added delay per push and per pull (a slower link); no-op by default.
        self.comm_delay: Callable[[int], float] = lambda nbytes: 0.0

    def join(self, name: str, job_digest: str, device: str, role: str = "worker") -> P.Welcome:
        """Join the job; waits (up to connect_timeout_s) for the coordinator and all shards."""
        c0 = Connection(self.ctx, self.server, timeout_s=self.timeout_s, security=self.security)
        try:
            welcome = c0.request(P.Join(name=name, job_digest=job_digest, device=device, role=role),
                                 P.Welcome, timeout_s=self.connect_timeout_s)
        except TransportTimeout:
            c0.close()
            raise TransportTimeout(
                f"coordinator at {self.server} did not answer the join within "
                f"{self.connect_timeout_s:.0f}s (is ps-server --shard 0 running there, and have "
                "all shards registered?)") from None
        except BaseException:
            c0.close()
            raise
        assert isinstance(welcome, P.Welcome)
        self.welcome = welcome
        self.token = welcome.token
        self.ranges = [(int(a), int(b)) for a, b in welcome.shard_ranges]
        self.conns = [c0] + [
            Connection(self.ctx, ep, timeout_s=self.timeout_s,
                       max_array_bytes=(b - a) * 4, security=self.security)
            for ep, (a, b) in zip(welcome.shard_endpoints[1:], self.ranges[1:])
        ]
        c0.max_array_bytes = (self.ranges[0][1] - self.ranges[0][0]) * 4
        return welcome

    def push(self, grads: np.ndarray, *, worker_id: int, assignment: P.Assignment, loss: float,
             telemetry: dict[str, float]) -> None:
        """Send each shard its slice of the flat gradient, zero-copy.

        ``grads`` must not be modified until the following pull has been answered by every
        shard: an answer proves the shard has read the push that preceded it on the same pipe.
        """
        self.comm_delay(grads.nbytes)
        for k, (conn, (a, b)) in enumerate(zip(self.conns, self.ranges)):
            conn.send(P.Push(worker_id=worker_id, iteration=assignment.iteration,
                             batch_size=assignment.batch_size,
                             expected_workers=assignment.expected_workers,
                             global_batch=assignment.global_batch, loss=loss, token=self.token,
                             lr_scale=assignment.lr_scale,
                             telemetry=telemetry if k == 0 else {}, arrays=[grads[a:b]]))

    def pull(self, params: np.ndarray, *, worker_id: int, min_version: int,
             honor_stop: bool = True, exact: bool = False, consistent: bool = True,
             abort: Callable[[], str | None] | None = None) -> PullResult:
        """Pull every shard's slice into ``params`` once its version reaches ``min_version``.

        Shard 0's answer carries the assignment. With ``consistent`` (round modes): shards can
        answer at different versions (a worker joining mid-run, an observer racing an update),
        so any shard behind the newest version seen is asked again for exactly that one and the
        result is one consistent version. Async modes take each shard's latest slice.
        """
        t0 = time.perf_counter()
        for conn in self.conns:
            conn.send(P.Pull(worker_id=worker_id, min_version=min_version, exact=exact))
        first: float | None = None
        replies: dict[int, P.Params] = {}
        poller = zmq.Poller()
        for conn in self.conns:
            poller.register(conn.sock, zmq.POLLIN)
        waiting = set(range(len(self.conns)))
        error: RemoteError | None = None
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                eps = [self.conns[k].endpoint for k in sorted(waiting)]
                raise TransportTimeout(f"no parameters from {eps} within {self.timeout_s:.0f}s")
            events = dict(poller.poll(int(min(left, 0.5) * 1000)))
            if not events and abort is not None and (reason := abort()):
                raise PullAborted(reason)
            for k in sorted(waiting):
                conn = self.conns[k]
                if conn.sock not in events:
                    continue
                try:
                    reply = conn.recv(0)
                except RemoteError as exc:
                    # Keep draining the other shards' answers, so none is left queued to be
                    # mistaken for the answer to a later pull.
                    error = error or exc
                    waiting.discard(k)
                    continue
                if not isinstance(reply, P.Params):
                    raise P.ProtocolError(f"{conn.endpoint}: expected params, got {reply.TYPE}")
                first = first or time.perf_counter()
                if k == 0 and reply.stop and honor_stop:
                    return PullResult(reply.version, reply.version_time, True, None,
                                      first - t0, time.perf_counter() - first)
                replies[k] = reply
                a, b = self.ranges[k]
                params[a:b] = reply.arrays[0]
                waiting.discard(k)
            if error is not None or not consistent or not replies:
                continue
            target = max(r.version for r in replies.values())
            for k, r in list(replies.items()):
                if r.version < target:
                    del replies[k]
                    waiting.add(k)
                    self.conns[k].send(P.Pull(worker_id=worker_id, min_version=target))
        if error is not None:
            raise error
        self.comm_delay(params.nbytes)
        r0 = replies[0]
        assert first is not None
        return PullResult(r0.version, max(r.version_time for r in replies.values()), r0.stop,
                          r0.assignment, first - t0, time.perf_counter() - first, r0.samples)

    def send_to_coordinator(self, msg: P.Message, expect: type[P.Message]) -> P.Message:
        return self.conns[0].request(msg, expect)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns = []
