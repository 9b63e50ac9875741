"""Client of the ``ps-bsm`` batch-size service (:mod:`ps_server.bsm_service`).

For training loops in another process or framework: no torch, only ZeroMQ and the protocol::

    with BatchSizeClient("tcp://127.0.0.1:5555") as bsm:
        bsm.join(rank)
        sizes = bsm.assign()                     # {worker: batch size}, sums to X
        ...train sizes[rank] samples...
        bsm.report(rank, it, sizes[rank], Telemetry(compute_s=..., iteration_s=...))

``join`` returns the worker's token, and the client keeps it: ``leave`` and ``report`` of that
worker carry it. Another process that reports for the worker (a proxy) passes ``token=``.
Joining an id that is live again (a restarted worker) voids its earlier token, so a stale
process under that id gets ``bad_token``.

A refused request raises :class:`~ps_common.transport.RemoteError` (``.code`` says why, e.g.
``unknown_worker``, ``no_workers``, ``bad_request``, ``malformed`` for a report field out of its
range); no reply within ``timeout_s`` raises
:class:`~ps_common.transport.TransportTimeout`. After a timeout the socket is replaced, so a late
reply can never be mistaken for the answer to the next request. Nothing is retried: reports are
not idempotent. One client per thread (ZeroMQ sockets are not thread-safe).

:meth:`send` and :meth:`recv` let a caller keep several requests in flight (the DDP gradient
exchange sends every bucket before it reads an answer), with the same socket replacement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import zmq

from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_common.security.settings import SecurityConfig
from ps_common.transport import Connection, RemoteError, TransportTimeout

__all__ = ["BatchSizeClient", "RemoteError", "TransportTimeout"]


class BatchSizeClient:
    """Request/reply access to one ``ps-bsm`` service."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, security: SecurityConfig | None = None,
                 *, ctx: zmq.Context | None = None, role: str = "worker", max_array_bytes: int = 0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.security = security
        self.role = role
        self.max_array_bytes = int(max_array_bytes)  # the largest array an answer may carry
        self.ctx = ctx or zmq.Context.instance()
        self.last_decision_s = math.nan  #: the manager's decision time of the last assign()
        self.tokens: dict[int, str] = {}  #: the token of every worker this client joined
        self._conn: Connection | None = self._connect()

    def _connect(self) -> Connection:
        return Connection(self.ctx, self.endpoint, role=self.role, timeout_s=self.timeout_s,
                          max_array_bytes=self.max_array_bytes, security=self.security)

    def _open_conn(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("BatchSizeClient is closed")
        return self._conn

    def reconnect(self) -> None:
        """A fresh socket: no late answer to what was sent before can reach the next request."""
        self._open_conn().close()
        self._conn = self._connect()

    def request(self, msg: P.Message, expect: type[P.Message]) -> Any:
        """Send ``msg`` and return its answer, which must be an ``expect``."""
        conn = self._open_conn()
        try:
            return conn.request(msg, expect)
        except RemoteError:
            raise
        except (TransportTimeout, P.ProtocolError):
            # A late or unexpected reply would answer the wrong request: start a fresh socket.
            self.reconnect()
            raise

    def send(self, msg: P.Message) -> None:
        """Send without waiting for the answer (read it with :meth:`recv`)."""
        try:
            self._open_conn().send(msg)
        except TransportTimeout:
            self.reconnect()
            raise

    def recv(self) -> P.Message:
        """The next answer; an Error is raised as :class:`RemoteError`."""
        try:
            return self._open_conn().recv()
        except (TransportTimeout, P.ProtocolError):
            self.reconnect()
            raise

    # ----- membership --------------------------------------------------------------------
    def join(self, worker_id: int) -> str:
        """Make ``worker_id`` live and return its token (kept here for its leave and reports).
        Joining a live id again is a restart: the earlier token is void."""
        w = int(worker_id)
        welcome = self.request(P.BsmJoin(worker_id=w), P.BsmWelcome)
        if welcome.worker_id != w:
            raise P.ProtocolError(f"{self.endpoint}: joined worker {w}, welcomed {welcome.worker_id}")
        self.tokens[w] = welcome.token
        return str(welcome.token)

    def _token(self, worker_id: int, token: str | None) -> str:
        return token if token is not None else self.tokens.get(worker_id, "")

    def leave(self, worker_id: int, token: str | None = None) -> None:
        """``worker_id`` left (unknown ids are ignored by the service); an operator's client may
        evict a worker without its token."""
        w = int(worker_id)
        self.request(P.BsmLeave(worker_id=w, token=self._token(w, token)), P.Ack)
        self.tokens.pop(w, None)

    # ----- reports and decisions ---------------------------------------------------------
    def report(self, worker_id: int, iteration: int, batch_size: int, telemetry: Telemetry,
               token: str | None = None) -> None:
        """One worker's measurements of a finished iteration (the fields of ``WorkerReport``),
        with its token (the one this client's ``join`` got, unless ``token`` is given)."""
        w = int(worker_id)
        self.request(P.BsmReport(worker_id=w, token=self._token(w, token), iteration=int(iteration),
                                  batch_size=int(batch_size), telemetry=telemetry), P.Ack)

    def observe(self, report: Any) -> None:
        """Send a ``WorkerReport`` (or any object with its attributes)."""
        self.report(report.worker_id, report.iteration, report.batch_size, report.telemetry)

    def assign(self) -> dict[int, int]:
        """The next ``{worker: batch size}`` for the live workers (sums to the global batch)."""
        a = self.request(P.BsmAssign(), P.BsmAssignment)
        if len(a.workers) != len(a.batch_sizes):
            raise P.ProtocolError(f"{self.endpoint}: assignment lists {len(a.workers)} workers "
                                  f"and {len(a.batch_sizes)} batch sizes")
        self.last_decision_s = a.decision_s
        return dict(zip(a.workers, a.batch_sizes))

    def stats(self, include_state: bool = False) -> dict[str, Any]:
        """The service's counters and decision times (``BsmStatsReply`` fields as a dict),
        plus ``last_assignment`` as ``{worker: batch}``; ``include_state`` adds ``state``,
        the manager's ``state_dict()``."""
        r = self.request(P.BsmStats(include_state=bool(include_state)), P.BsmStatsReply)
        out = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "arrays"}
        out["last_assignment"] = dict(zip(r.last_workers, r.last_batch_sizes))
        if not include_state:
            out.pop("state")
        return out

    # ----- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "BatchSizeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
