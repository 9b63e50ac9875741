"""The shard server's I/O loop: a ROUTER socket, a dispatch table, deferred replies.

Shard 0 also runs the coordinator. Shards k > 0 register their endpoint with shard 0 so that
workers only need shard 0's address. Each message is decoded and validated before anything
touches state; a bad message is answered with an Error and counted, never a crash.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import zmq

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from ps_common import protocol as P
from ps_common.config import JobConfig
from ps_common.datasets import dataset_from_config
from ps_common.layout import partition
from ps_common.metrics import MetricsWriter
from ps_common.models import FlatParameters, build_model
from ps_common.security import close_socket
from ps_common.transport import (Connection, TransportTimeout, advertised, bind_address, make_router,
                                 parse_request, send)
from ps_server.checkpoint import (CheckpointError, find_checkpoint, list_checkpoints, load_checkpoint,
                                  save_checkpoint)
from ps_server.coordinator import Coordinator
from ps_server.shard import ShardState
from ps_server.sync import PushRejected, get_sync_policy

log = logging.getLogger(__name__)

HEADER_MARGIN = 1 << 20


def initial_parameters(cfg: JobConfig) -> np.ndarray:
    """The job's initial flat parameter vector: same (model, seed) -> same bits everywhere."""
    model = build_model(cfg.model.name, seed=cfg.run.seed)
    return FlatParameters(model).params_numpy().copy()


@dataclass
class _PendingPull:
    ident: bytes
    worker_id: int
    min_version: int
    exact: bool = False


class ShardServer:
    def __init__(self, cfg: JobConfig, shard: int, *, host: str | None = None, port: int = 0,
                 advertise_host: str | None = None, coordinator: str | None = None,
                 run_dir: str | Path | None = None, ctx: zmq.Context | None = None,
                 resume: bool = False) -> None:
        S = cfg.cluster.num_shards
        if not 0 <= shard < S:
            raise ValueError(f"--shard must be in 0..{S - 1} (cluster.num_shards={S})")
        if shard > 0 and not coordinator:
            raise ValueError("shards other than 0 need --coordinator ENDPOINT (shard 0's address)")
        self.cfg = cfg
        self.shard_id = shard
        torch.set_num_threads(1)  # the coordinator's predictors (NARX, ARIMA) are tiny
        self.ctx = ctx or zmq.Context.instance()
        full = initial_parameters(cfg)
        self.ranges = partition(full.size, S)
        lo, hi = self.ranges[shard]
        sync_args = cfg.sync_args()
        if cfg.mode.sync == "backup":
            sync_args["leader"] = shard == 0
        self.sync = get_sync_policy(cfg.mode.sync, **sync_args)
        self.state = ShardState(
            shard, full[lo:hi].copy(), cfg.optimizer, self.sync,
            reject_nonfinite=cfg.training.reject_nonfinite,
            snapshot_every=cfg.evaluator.every_iterations if cfg.evaluator.enabled else 0)
        self.num_params = full.size
        self.max_array_bytes = (hi - lo) * 4
        self.sock, bound = make_router(
            self.ctx, bind_address(host or cfg.cluster.host, port),
            max_msg_bytes=self.max_array_bytes + HEADER_MARGIN, security=cfg.security)
        self.endpoint = advertised(bound, advertise_host)
        self.job_digest = cfg.job_digest()
        self.coordinator_endpoint = coordinator
        self.shard_endpoints: dict[int, str] = {shard: self.endpoint}
        self.pending_pulls: list[_PendingPull] = []
        self.pending_joins: list[tuple[bytes, P.Join]] = []
        self.errors_sent = 0
        self.incarnation = os.urandom(6).hex()
        self.control_token = os.urandom(8).hex()  # coordinator->shard messages must carry it
        self.shard_tokens: dict[int, str] = {}
        ck = cfg.checkpoint
        self.checkpoint_dir: Path | None = (
            Path(ck.dir) if ck.dir else (Path(run_dir) / "checkpoints" if run_dir else None))
        if self.checkpoint_dir is None and (ck.every_iterations or ck.every_seconds or resume):
            raise ValueError("checkpoints need checkpoint.dir or --run-dir")
        self.checkpoint_due: int | None = None  # a version the coordinator asked us to save at
        self.last_checkpoint_time = time.monotonic()
        self.checkpoints_written = 0
        self.resumed = False
        self.malformed = 0
        self.running = False
        self.stop_event = threading.Event()
        run_dir = Path(run_dir) if run_dir else None
        self.metrics = MetricsWriter(run_dir / "metrics" / f"shard-{shard}.jsonl" if run_dir else None)
        self.coord: Coordinator | None = None
        self.coord_metrics = MetricsWriter(run_dir / "metrics" / "coordinator.jsonl" if run_dir else None)
        if shard == 0:
            data = dataset_from_config(cfg.data, cfg.run.seed)
            manager = BatchSizeManager(cfg.mode.batch_policy, cfg.training.global_batch,
                                       min_batch=cfg.training.min_batch, max_batch=cfg.training.max_batch,
                                       policy_args=cfg.mode.batch_policy_args)
            self.coord = Coordinator(cfg, data.num_train, manager, kind=self.sync.kind)
        self.shard_links: dict[int, Connection] = {}
        self.handlers: dict[type[P.Message], Callable[[bytes, Any], None]] = {
            P.Hello: self._on_hello,
            P.RegisterShard: self._on_register_shard,
            P.Join: self._on_join,
            P.Leave: self._on_leave,
            P.Heartbeat: self._on_heartbeat,
            P.Push: self._on_push,
            P.Pull: self._on_pull,
            P.Commit: self._on_commit,
            P.CheckpointAt: self._on_checkpoint_at,
            P.Rollback: self._on_rollback,
            P.StatusRequest: self._on_status,
            P.EvalReport: self._on_eval,
            P.Shutdown: self._on_shutdown,
        }
        if resume:
            self._resume()

    # ----- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until a Shutdown message, ``stop_event``, or SIGINT/SIGTERM."""
        self.running = True
        if self.shard_id > 0:
            self._register_with_coordinator()
        try:
            next_check = time.monotonic()
            while not self.stop_event.is_set():
                if self.sock.poll(100, zmq.POLLIN):
                    self._handle(self.sock.recv_multipart(copy=False))
                    self._serve_pending()
                if self.coord is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + min(0.2, self.cfg.heartbeat.interval_s)
                    self._check_liveness()
        finally:
            self.close()

    def close(self) -> None:
        self.metrics.write(event="shutdown", version=self.state.version,
                           samples_applied=self.state.samples_applied, dropped=self.state.dropped,
                           rejected=self.state.rejected, malformed=self.malformed,
                           errors_sent=self.errors_sent)
        self.metrics.close()
        self.coord_metrics.close()
        for link in getattr(self, "shard_links", {}).values():
            link.close()
        close_socket(self.sock)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop_event.set())

    def _register_with_coordinator(self) -> None:
        assert self.coordinator_endpoint
        conn = Connection(self.ctx, self.coordinator_endpoint, timeout_s=2.0,
                              security=self.cfg.security)
        deadline = time.monotonic() + self.cfg.transport.connect_timeout_s
        try:
            while True:
                try:
                    conn.request(P.RegisterShard(shard=self.shard_id, endpoint=self.endpoint,
                                                 job_digest=self.job_digest, version=self.state.version,
                                                 resumed=self.resumed, token=self.control_token), P.Ack)
                    return
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"coordinator {self.coordinator_endpoint} did not answer within "
                            f"{self.cfg.transport.connect_timeout_s}s") from None
                    conn.close()
                    conn = Connection(self.ctx, self.coordinator_endpoint, timeout_s=2.0,
                              security=self.cfg.security)
        finally:
            conn.close()

    # ----- dispatch ------------------------------------------------------------------------
    def _handle(self, frames: list[zmq.Frame]) -> None:
        req = parse_request(frames, max_array_bytes=self.max_array_bytes, accepted=self.handlers,
                            server="shard")
        if req is None or req.malformed:
            self.malformed += 1
        if req is None:
            return
        ident, msg = req.ident, req.msg
        if msg is None:
            self._reply(ident, req.refusal)
            return
        try:
            self.handlers[type(msg)](ident, msg)
        except PushRejected as exc:
            log.warning("push rejected [%s]: %s", exc.code, exc)
            self._reply(ident, P.Error(code=exc.code, message=str(exc)))
        except _Refused as exc:
            self._reply(ident, P.Error(code=exc.code, message=str(exc)))

    def _reply(self, ident: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Error):
            self.errors_sent += 1
        try:
            send(self.sock, msg, ident)
        except zmq.ZMQError as exc:  # peer vanished (ROUTER_MANDATORY): nothing to answer
            log.info("reply to a vanished peer dropped: %s", exc)

    def _require_coordinator(self) -> Coordinator:
        if self.coord is None:
            raise _Refused("not_coordinator", f"shard {self.shard_id} is not the coordinator (shard 0)")
        return self.coord

    def _check_digest(self, digest: str) -> None:
        if digest and digest != self.job_digest:
            raise _Refused("config_mismatch",
                           f"job config digest {digest} differs from the server's {self.job_digest}: "
                           "start every process of a job with the same model/data/optimizer/"
                           "training/mode settings")

    # ----- handlers ------------------------------------------------------------------------
    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        self._reply(ident, P.HelloReply(shard=self.shard_id, num_shards=self.cfg.cluster.num_shards,
                                        job_digest=self.job_digest))

    def _on_register_shard(self, ident: bytes, msg: P.RegisterShard) -> None:
        self._require_coordinator()
        self._check_digest(msg.job_digest)
        if not 0 < msg.shard < self.cfg.cluster.num_shards:
            raise _Refused("bad_shard", f"shard index {msg.shard} out of range")
        own = self.state.version
        if msg.version != own and not msg.resumed:
            raise _Refused("needs_resume",
                           f"shard {msg.shard} is at version {msg.version} but the job is at {own}: "
                           "restart a shard of a running job with --resume")
        target = None
        if msg.resumed:
            # Even at the same version the restarted shard lost what was in flight (and may have
            # a new endpoint): everyone goes back to a checkpoint they all have, and the workers
            # join again.
            if self.checkpoint_dir is None:
                raise _Refused("no_checkpoints", "the coordinator keeps no checkpoints to roll back to")
            mine = [v for v, _ in list_checkpoints(self.checkpoint_dir, 0) if v <= min(own, msg.version)]
            if not mine:
                raise _Refused("no_common_checkpoint",
                               f"shard 0 has no checkpoint at or before version {msg.version}")
            target = mine[-1]
            self._rollback_all(target, f"shard {msg.shard} resumed from version {msg.version}")
        self.shard_endpoints[msg.shard] = msg.endpoint
        self.shard_tokens[msg.shard] = msg.token
        old = self.shard_links.pop(msg.shard, None)
        if old is not None:
            old.close()
        self.shard_links[msg.shard] = Connection(self.ctx, msg.endpoint, timeout_s=1.0,
                                                  security=self.cfg.security)
        if target is not None and target != msg.version:
            self._send_link(self.shard_links[msg.shard], P.Rollback(version=target, token=msg.token))
        log.info("shard %d registered at %s (version %d)", msg.shard, msg.endpoint, msg.version)
        self._reply(ident, P.Ack(what="register_shard"))

    def _all_shards_known(self) -> bool:
        return len(self.shard_endpoints) == self.cfg.cluster.num_shards

    def _on_join(self, ident: bytes, msg: P.Join) -> None:
        self._require_coordinator()
        self._check_digest(msg.job_digest)
        if msg.role not in ("worker", "observer"):
            raise _Refused("bad_role", f"unknown role {msg.role!r}; known: worker, observer")
        self.pending_joins.append((ident, msg))

    def _on_leave(self, ident: bytes, msg: P.Leave) -> None:
        coord = self._require_coordinator()
        if msg.worker_id in coord.workers and not coord.token_ok(msg.worker_id, msg.token):
            raise _Refused("bad_token", f"leave for worker {msg.worker_id} with a wrong token")
        self._remove_worker(msg.worker_id, f"left ({msg.reason or 'no reason given'})")
        self._reply(ident, P.Ack(what="leave"))

    def _on_heartbeat(self, ident: bytes, msg: P.Heartbeat) -> None:
        coord = self._require_coordinator()
        if msg.worker_id not in coord.workers:
            raise _Refused("unknown_worker", f"worker {msg.worker_id} is not a member (declared lost?)")
        if not coord.token_ok(msg.worker_id, msg.token):
            raise _Refused("bad_token", f"heartbeat for worker {msg.worker_id} with a wrong token")
        coord.heard_from(msg.worker_id)
        self._reply(ident, P.HeartbeatReply(incarnation=self.incarnation, version=self.state.version,
                                            stop=coord.stop))

    def _check_liveness(self) -> None:
        assert self.coord is not None
        if not self.coord.started or self.coord.stop:
            return  # after stop, workers leave on their own
        for w in self.coord.silent_workers(self.cfg.heartbeat.timeout_s):
            self._remove_worker(w, f"lost (silent for more than {self.cfg.heartbeat.timeout_s}s)")

    def _remove_worker(self, worker_id: int, reason: str) -> None:
        """Leave or loss: membership, batch re-split, and no barrier waiting for the worker."""
        coord = self.coord
        assert coord is not None
        reduced = coord.leave(worker_id, reason)
        self.sync.set_live(coord.live())
        self.coord_metrics.write(event="worker_removed", worker=worker_id, reason=reason,
                                 live=coord.live(), version=self.state.version)
        if reduced is not None:
            it = coord.iteration
            self._commit_to_shards(it, reduced)
            self._after_applies(self.state.commit(it, reduced, sum(reduced.values())))
        coord.try_start()  # re-plans if every worker of the iteration is gone and others remain
        self._serve_pending()

    def _on_push(self, ident: bytes, msg: P.Push) -> None:
        coord = self.coord
        if coord is not None and msg.worker_id not in coord.workers:
            raise _Refused("unknown_worker", f"worker {msg.worker_id} has not joined")
        if coord is not None and not coord.token_ok(msg.worker_id, msg.token):
            raise _Refused("bad_token", f"push for worker {msg.worker_id} with a wrong token")
        (grad,) = msg.arrays
        applied = self.state.push(msg.worker_id, msg.iteration, msg.batch_size, msg.expected_workers,
                                  msg.global_batch, grad, msg.lr_scale)
        if coord is not None:
            tel = msg.telemetry
            coord.record_push(WorkerReport(
                worker_id=msg.worker_id, iteration=msg.iteration, batch_size=msg.batch_size,
                compute_s=float(tel.get("compute_s", 0.0)),
                iteration_s=float(tel.get("iteration_s", 0.0)), telemetry=tel), msg.loss)
        self._after_applies(applied)

    def _check_control(self, msg: P.Message) -> None:
        if self.coord is not None:
            raise _Refused("not_follower", f"the coordinator's shard does not take {msg.TYPE} messages")
        if not hmac.compare_digest(getattr(msg, "token", ""), self.control_token):
            raise _Refused("unauthorized", f"{msg.TYPE} without this shard's control token")

    def _on_commit(self, ident: bytes, msg: P.Commit) -> None:
        self._check_control(msg)
        if len(msg.workers) != len(msg.batch_sizes) or not msg.workers:
            raise _Refused("bad_commit", "commit needs one batch size per worker")
        accepted = dict(zip(msg.workers, msg.batch_sizes))
        self._after_applies(self.state.commit(msg.iteration, accepted, sum(msg.batch_sizes)))

    def _after_applies(self, applied: list) -> None:
        """Log applied updates; on the coordinator, commit non-plan choices and plan onwards."""
        coord = self.coord
        for a in applied:
            self.metrics.write(iteration=a.iteration, version=self.state.version, samples=a.samples)
            if coord is None:
                self._maybe_checkpoint()
                continue
            if self.sync.name == "backup":
                self._commit_to_shards(a.iteration, {g.worker_id: g.batch_size for g in a.gradients})
            rec = coord.on_update(a.iteration, a.workers, a.samples)
            self.coord_metrics.write(
                iteration=rec.iteration, version=self.state.version, elapsed=rec.elapsed,
                duration=rec.duration, loss=rec.loss, epoch=rec.epoch, samples=rec.samples,
                applied_samples=rec.applied_samples, accepted=rec.accepted,
                batch_sizes={str(k): v for k, v in rec.batch_sizes.items()},
                ranges={str(k): v for k, v in rec.ranges.items()},
                workers={str(r.worker_id): dict(r.telemetry) for r in rec.reports},
                dropped=self.state.dropped, stop=coord.stop, stop_reason=coord.stop_reason,
                decision_s=coord.manager.last_decision_s)
            self._maybe_checkpoint()  # after the coordinator planned onwards: its state matches

    # ----- checkpoints ----------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        """Every shard saves at multiples of every_iterations (consistent by construction); for
        every_seconds the coordinator picks a version two ahead and tells the other shards,
        which cannot have reached it yet."""
        ck = self.cfg.checkpoint
        v = self.state.version
        if (ck.every_iterations and v % ck.every_iterations == 0) or self.checkpoint_due == v:
            self.checkpoint_due = None
            self.write_checkpoint()
        if (self.coord is not None and ck.every_seconds and self.checkpoint_due is None
                and time.monotonic() - self.last_checkpoint_time >= ck.every_seconds):
            self.checkpoint_due = v + 2
            for k, link in self.shard_links.items():
                self._send_link(link, P.CheckpointAt(version=v + 2, token=self.shard_tokens.get(k, "")))

    def write_checkpoint(self) -> Path:
        assert self.checkpoint_dir is not None
        meta = {**self.state.state_meta(), "shard": self.shard_id, "num_params": self.num_params,
                "job_digest": self.job_digest}
        if self.coord is not None:
            meta["coordinator"] = self.coord.state_dict()
            meta["shard_endpoints"] = {str(k): ep for k, ep in self.shard_endpoints.items()}
            meta["shard_tokens"] = {str(k): t for k, t in self.shard_tokens.items()}
        path = save_checkpoint(self.checkpoint_dir, self.shard_id, self.state.version,
                               self.state.state_arrays(), meta, keep=self.cfg.checkpoint.keep)
        self.last_checkpoint_time = time.monotonic()
        self.checkpoints_written += 1
        self.metrics.write(event="checkpoint", version=self.state.version, path=str(path))
        return path

    def _restore(self, version: int | None) -> dict:
        assert self.checkpoint_dir is not None
        path = find_checkpoint(self.checkpoint_dir, self.shard_id, version)
        arrays, meta = load_checkpoint(path)
        if meta.get("job_digest") != self.job_digest:
            raise CheckpointError(f"{path} belongs to another job (digest {meta.get('job_digest')})")
        self.state.restore(arrays, meta)
        self.pending_pulls = []
        self.checkpoint_due = None
        if self.coord is not None:
            self.coord.load_state_dict(meta["coordinator"])
            self.incarnation = os.urandom(6).hex()  # workers notice and join again
        self.metrics.write(event="restored", version=self.state.version, path=str(path))
        log.info("shard %d restored version %d from %s", self.shard_id, self.state.version, path)
        return meta

    def _resume(self) -> None:
        """``--resume``: the newest checkpoint; shard 0 also rolls the other shards back to it."""
        meta = self._restore(None)
        self.resumed = True
        if self.coord is not None:
            for k, ep in meta.get("shard_endpoints", {}).items():
                if int(k) != 0:
                    link = Connection(self.ctx, ep, timeout_s=1.0, security=self.cfg.security)
                    token = meta.get("shard_tokens", {}).get(k, "")
                    self._send_link(link, P.Rollback(version=self.state.version, token=token))
                    link.close(linger_ms=2000)

    def _rollback_all(self, version: int, reason: str) -> None:
        log.warning("rolling the job back to version %d: %s", version, reason)
        self._restore(version)
        self.coord_metrics.write(event="rollback", version=version, reason=reason)
        for k, link in self.shard_links.items():
            self._send_link(link, P.Rollback(version=version, token=self.shard_tokens.get(k, "")))

    def _on_checkpoint_at(self, ident: bytes, msg: P.CheckpointAt) -> None:
        self._check_control(msg)
        if msg.version == self.state.version:
            self.write_checkpoint()
        elif msg.version > self.state.version:
            self.checkpoint_due = msg.version
        else:
            log.warning("checkpoint for version %d asked at version %d: skipped", msg.version,
                        self.state.version)

    def _on_rollback(self, ident: bytes, msg: P.Rollback) -> None:
        self._check_control(msg)
        try:
            self._restore(msg.version)
        except CheckpointError as exc:
            log.error("cannot roll back: %s; stopping this shard to avoid inconsistent parameters", exc)
            self.stop_event.set()

    def _send_link(self, link: Connection, msg: P.Message) -> None:
        """Coordinator -> shard control message; a dead shard must not stall the coordinator."""
        try:
            link.send(msg)
        except TransportTimeout as exc:
            log.warning("control message %s not sent: %s", msg.TYPE, exc)

    def _commit_to_shards(self, iteration: int, accepted: dict[int, int]) -> None:
        workers = sorted(accepted)
        for k, link in self.shard_links.items():
            self._send_link(link, P.Commit(iteration=iteration, workers=workers, token=self.shard_tokens.get(k, ""),
                                           batch_sizes=[accepted[w] for w in workers]))

    def _on_pull(self, ident: bytes, msg: P.Pull) -> None:
        self.pending_pulls.append(_PendingPull(ident, msg.worker_id, msg.min_version, msg.exact))

    def _on_status(self, ident: bytes, msg: P.StatusRequest) -> None:
        coord = self._require_coordinator()
        self._reply(ident, P.Status(
            version=self.state.version, iterations=coord.iterations_done(), epoch=coord.cursor.epoch,
            samples=coord.cursor.state.samples_served, workers=len(coord.workers),
            stop=coord.stop, stop_reason=coord.stop_reason, started=coord.started,
            elapsed=coord.elapsed(), last_accuracy=coord.last_accuracy))

    def _on_eval(self, ident: bytes, msg: P.EvalReport) -> None:
        coord = self._require_coordinator()
        self._check_job(msg.job_digest)
        coord.on_eval(msg.accuracy)
        t = self.cfg.training.target_accuracy
        if t is not None and msg.accuracy >= t:
            coord.request_stop(f"reached target_accuracy={t} (version {msg.version})")
        self._reply(ident, P.Ack(what="eval_report"))

    def _check_job(self, digest: str) -> None:
        if not hmac.compare_digest(digest, self.job_digest):
            raise _Refused("unauthorized", "this request must carry the job's config digest")

    def _on_shutdown(self, ident: bytes, msg: P.Shutdown) -> None:
        self._check_job(msg.job_digest)
        log.info("shutdown requested: %s", msg.reason)
        self._reply(ident, P.Ack(what="shutdown"))
        self.stop_event.set()

    # ----- deferred replies ----------------------------------------------------------------
    def _serve_pending(self) -> None:
        coord = self.coord
        if coord is not None:
            for ev in coord.drain_events():
                self.coord_metrics.write(**ev)
        if coord is not None and self.pending_joins and self._all_shards_known():
            for ident, join in self.pending_joins:
                wid = coord.join(join.name, join.device) if join.role == "worker" else -1
                # Round modes start a worker at the current version; async ones at its clock.
                start = coord.workers[wid].clock if wid >= 0 and self.sync.kind == "async" \
                    else self.state.version
                self._reply(ident, P.Welcome(
                    worker_id=wid,
                    shard_endpoints=[self.shard_endpoints[k] for k in range(self.cfg.cluster.num_shards)],
                    shard_ranges=[list(r) for r in self.ranges], num_params=self.num_params,
                    version=start, job=self.cfg.job_spec(),
                    token=coord.workers[wid].token if wid >= 0 else ""))
            self.pending_joins = []
            self.sync.set_live(coord.live())
            coord.try_start()
        if not self.pending_pulls:
            return
        still = []
        for p in self.pending_pulls:
            reply = self._pull_reply(p)
            if reply is None:
                still.append(p)
            else:
                self._reply(p.ident, reply)
        self.pending_pulls = still

    def _pull_reply(self, p: _PendingPull) -> P.Params | P.Error | None:
        st = self.state
        coord = self.coord
        stop = coord is not None and coord.stop
        if p.exact:
            if st.version < p.min_version:
                if stop:
                    return P.Error(code="beyond_final", message=f"the run stopped at version {st.version}")
                return None
            snap = st.snapshots.get(p.min_version)
            if snap is None:
                return P.Error(code="snapshot_gone",
                               message=f"no snapshot of version {p.min_version} (kept: {sorted(st.snapshots)})")
            return P.Params(shard=self.shard_id, version=p.min_version, version_time=snap[1],
                            samples=snap[2], stop=stop, arrays=[snap[0]])
        if not stop and not st.sync.pull_ready(st.version, p.worker_id, p.min_version):
            return None
        assignment = None
        if coord is not None and p.worker_id >= 0 and not stop:
            # Round modes hand out the plan of the current version; async modes cut the
            # worker's next assignment for the clock it asked to start.
            key = st.version if self.sync.kind == "round" else p.min_version
            assignment = coord.assignment(p.worker_id, key)
            if assignment is None:
                return None
        return P.Params(shard=self.shard_id, version=st.version, version_time=st.version_time,
                        samples=st.samples_applied, stop=stop, assignment=assignment,
                        arrays=[st.params])


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
