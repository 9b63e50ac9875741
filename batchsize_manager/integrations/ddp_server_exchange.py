"""DDP's gradient buckets through a ``ps-bsm --world-size N`` service instead of a ring all-reduce.

Used by :class:`~batchsize_manager.integrations.torch_ddp.DDPBatchBalancer` with
``exchange="servers"``: the balancer's communication hook hands each bucket to
:meth:`ServerExchange.submit`, which sends it at once (so sending overlaps the rest of the
backward, like DDP's own buckets) and returns a future. When the hook sees the last bucket it
waits for every answer of the iteration and completes the futures, all from the hook's own
thread: one socket, no extra thread. The last answer also brings the next split, decided by
the service's manager, so an iteration needs no collective at all (see
:mod:`ps_server.exchange` for the rule the service keeps).

Why: under a CPU quota or behind a slow link, a ring all-reduce makes every rank wait for the
slowest one at each of its 2(N-1) steps and costs every rank CPU; through the service a rank's
slowness costs only its own send and receive.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import zmq

from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_common.security.settings import SecurityConfig
from ps_common.transport import RemoteError, TransportTimeout
from ps_server.bsm_client import BatchSizeClient

__all__ = ["ServerExchange", "ExchangeFailed"]


class ExchangeFailed(RuntimeError):
    """The service refused this rank's bucket or did not answer in time; the iteration is lost."""


@dataclass
class _Sent:
    bucket: int
    tensor: torch.Tensor                    # DDP's bucket buffer: the answer is written into it
    future: torch.futures.Future[torch.Tensor]


class ServerExchange:
    """One rank's link to the exchange: a :class:`~ps_server.bsm_client.BatchSizeClient` with
    the buckets of an iteration in flight. Not thread-safe (DDP calls its hook from one thread
    per device); :meth:`open` once before the first backward."""

    def __init__(self, endpoint: str, rank: int, *, timeout_s: float = 120.0,
                 security: SecurityConfig | None = None, ctx: zmq.Context | None = None,
                 job: str = "") -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank = int(rank)
        #: the same on every rank of this start of the job (see ``ExchangeOpen.job``)
        self.job = job
        self.timeout_s = float(timeout_s)
        self.client = BatchSizeClient(endpoint, timeout_s, security, ctx=ctx, max_array_bytes=1 << 40)
        self.token = ""
        self.iteration = 0
        self._sent: list[_Sent] = []
        #: From the last bucket's answer: the next split and every rank's report.
        self.next_sizes: list[int] | None = None
        self.reports: list[Telemetry] = []
        self.buckets_sent = 0

    def open(self, iteration: int) -> list[int]:
        """Start (or restart) at ``iteration``; returns that iteration's split (one size per rank)."""
        plan = self.client.request(P.ExchangeOpen(worker_id=self.rank, iteration=int(iteration),
                                                  job=self.job), P.ExchangePlan)
        self.token = plan.token
        self.iteration = int(iteration)
        self.next_sizes = None
        return list(plan.batch_sizes)

    # ----- the hook's side ------------------------------------------------------------------
    def submit(self, tensor: torch.Tensor, bucket: int, last: bool, batch_size: int,
               telemetry: Telemetry | None) -> torch.futures.Future[torch.Tensor]:
        """Send one bucket: the mean gradient over this rank's ``batch_size`` samples, as a view
        of DDP's buffer (sent zero-copy), with this rank's report on the last one. The future
        completes with the weighted mean over all ranks; on the last bucket, wait for all."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._sent.append(_Sent(bucket=bucket, tensor=tensor, future=fut))
        self.buckets_sent += 1
        try:
            self.client.send(P.ExchangePush(
                worker_id=self.rank, token=self.token, iteration=self.iteration, bucket=int(bucket),
                last=bool(last), batch_size=int(batch_size),
                telemetry=(telemetry or Telemetry()) if last else None,
                arrays=[tensor.detach().reshape(-1).numpy()]))
            if last:
                self._collect()
        except Exception as exc:
            self._fail_all(exc)
            raise
        return fut

    def _collect(self) -> None:
        """Every answer of the iteration, in bucket order (the service answers in that order)."""
        while self._sent:
            sent = self._sent[0]
            try:
                msg = self.client.recv()
            except RemoteError as exc:
                raise ExchangeFailed(f"rank {self.rank}, iteration {self.iteration}, bucket "
                                     f"{sent.bucket}: {exc}") from exc
            except TransportTimeout as exc:
                raise ExchangeFailed(f"rank {self.rank}, iteration {self.iteration}: no answer for "
                                     f"bucket {sent.bucket} within {self.timeout_s:g} s (a rank is "
                                     f"slow, gone, or the service is down): {exc}") from exc
            if (not isinstance(msg, P.ExchangeResult) or msg.iteration != self.iteration
                    or msg.bucket != sent.bucket or msg.arrays[0].size != sent.tensor.numel()):
                self.client.reconnect()
                raise ExchangeFailed(f"rank {self.rank}: expected the sum of bucket {sent.bucket} "
                                     f"of iteration {self.iteration}, got {msg!r:.200}")
            with warnings.catch_warnings():  # a read-only view of the frame, only read from
                warnings.simplefilter("ignore", UserWarning)
                summed = torch.from_numpy(msg.arrays[0])
            sent.tensor.view(-1).copy_(summed)
            self._sent.pop(0)
            if msg.next_batch_sizes:
                self.next_sizes = list(msg.next_batch_sizes)
                self.reports = list(msg.reports)
            sent.future.set_result(sent.tensor)

    def _fail_all(self, exc: Exception) -> None:
        for sent in self._sent:
            if not sent.future.done():
                sent.future.set_exception(exc)  # type: ignore[arg-type]
        self._sent.clear()

    def advance(self) -> None:
        """This rank is done with its iteration: the next answers belong to the next one."""
        self.iteration += 1
        self.next_sizes = None

    def close(self) -> None:
        self._fail_all(RuntimeError("ServerExchange closed"))
        self.client.close()
