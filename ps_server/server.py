"""The shard server: a message loop around one shard's state (shard 0 also coordinates).

The loop only moves messages (:mod:`ps_server.router`). What to apply is decided by the
coordinator (:mod:`ps_server.coordinator`) and nowhere else; followers apply the commits it
sends them, in order, over their link (:mod:`ps_server.control`); pulls wait in a bounded queue
(:mod:`ps_server.pulls`) until the version they ask for exists.

The path of one round-mode iteration t with S shards:

1. each worker pushes its gradient slices (``Push`` with ``pull``) to every shard;
2. a follower checks the push against t's plan, holds the gradient and tells the coordinator
   (``Have``); shard 0 notes its own slice directly;
3. once the policy's set is complete on every shard, the coordinator sends ``Commit(t)`` (with
   the plan of t+1) to every follower and applies it itself;
4. each shard answers the waiting pushes with its parameters at version t+1; shard 0's answer
   carries the worker's assignment for t+1.

Slow work (checkpoint writes) runs on threads; liveness is judged only when no message is
queued, so a stall of the loop cannot declare a worker lost whose heartbeats are waiting.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from ps_common import protocol as P
from ps_common.config import JobConfig
from ps_common.datasets import dataset_from_config
from ps_common.faults import fault
from ps_common.layout import partition
from ps_common.metrics import MetricsWriter
from ps_common.models import FlatParameters, build_model
from ps_common.security import close_socket
from ps_common.transport import advertised, bind_address, make_router
from ps_server.checkpoint import (CheckpointError, CheckpointWriter, find_checkpoint, list_checkpoints,
                                  load_checkpoint, save_checkpoint)
from ps_server.control import CoordinatorLink, Followers
from ps_server.coordinator import CommitDecision, Coordinator, member_token
from ps_server.pulls import PendingPull, PendingPulls
from ps_server.roles import SHARD_PERMISSIONS
from ps_server.router import Limits, Refused, RouterLoop
from ps_server.shard import GradientRejected, MissingGradient, ShardState, next_log_hash
from ps_server.sync import get_sync_policy

log = logging.getLogger(__name__)

HEADER_MARGIN = 1 << 20
MAX_PENDING_JOINS = 1024


def initial_parameters(cfg: JobConfig) -> np.ndarray:
    """The job's initial flat parameter vector: same (model, seed) -> same bits everywhere."""
    model = build_model(cfg.model.name, seed=cfg.run.seed)
    return FlatParameters(model).params_numpy().copy()


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


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
        if cfg.security.mechanism == "none":
            raise ValueError("no credentials: set security.secret_file (a job secret: `ps-keys secret "
                             "FILE`; ps-launch makes one per run) or turn on security.curve")
        self.cfg = cfg
        self.shard_id = shard
        torch.set_num_threads(1)  # the coordinator's predictors (NARX, ARIMA) are tiny
        self.ctx = ctx or zmq.Context.instance()
        full = initial_parameters(cfg)
        self.ranges = partition(full.size, S)
        lo, hi = self.ranges[shard]
        self.policy = get_sync_policy(cfg.mode.sync, **cfg.sync_args())
        self.state = ShardState(
            shard, full[lo:hi].copy(), cfg.optimizer, reject_nonfinite=cfg.training.reject_nonfinite,
            snapshot_every=cfg.evaluator.every_iterations if cfg.evaluator.enabled else 0)
        self.num_params = full.size
        t = cfg.transport
        bind_host = host or cfg.cluster.host
        self.sock, bound = make_router(self.ctx, bind_address(bind_host, port),
                                       max_msg_bytes=(hi - lo) * 4 + HEADER_MARGIN,
                                       security=cfg.security, hwm=t.hwm)
        self.endpoint = advertised(bound, advertise_host)
        if not cfg.security.curve and not _is_loopback(bind_host):
            log.warning("!!! shard %d binds %s WITHOUT CURVE: traffic (gradients, parameters and the "
                        "job secret's role passwords) crosses the network in the clear; anyone on "
                        "the path can read or alter it. Turn on security.curve for multi-host runs. !!!",
                        shard, bind_host)
        self.router = RouterLoop(self.sock, self._handlers(), server=f"shard {shard}",
                                 limits=Limits(max_frames=t.max_frames, max_array_bytes=(hi - lo) * 4),
                                 permissions=SHARD_PERMISSIONS)
        self.counters = self.router.counters
        self.pulls = PendingPulls(t.max_pending_pulls_per_peer, t.max_pending_pulls)
        self.job_digest = cfg.job_digest()
        self.coordinator_endpoint = coordinator
        self.incarnation = os.urandom(6).hex()
        self.stop_event = threading.Event()
        self.exit_code = 0
        self.finished = False
        self.run_dir = Path(run_dir) if run_dir else None
        self.metrics = MetricsWriter(self.run_dir / "metrics" / f"shard-{shard}.jsonl" if self.run_dir else None)
        ck = cfg.checkpoint
        self.checkpoint_dir: Path | None = (
            Path(ck.dir) if ck.dir else (self.run_dir / "checkpoints" if self.run_dir else None))
        if self.checkpoint_dir is None and (ck.every_iterations or ck.every_seconds or resume):
            raise ValueError("checkpoints need checkpoint.dir or --run-dir")
        self.checkpointer = (CheckpointWriter(self.checkpoint_dir, shard, ck.keep)
                             if self.checkpoint_dir is not None else None)
        self.last_checkpoint_time = time.monotonic()
        self.resumed = False
        self._dirty = True  # pulls may be answerable
        self._stall_done = False
        # follower state
        self.link: CoordinatorLink | None = None
        self.member_key = ""
        self.plan: P.Plan | None = None
        self.last_iteration = -1  # round modes: the last committed iteration
        self.stop_version = -1
        self.stop_reason = ""
        self._haves: list[list[int]] = []
        self._next_sync = 0.0
        self._relink_to: str | None = None
        # coordinator state
        self.coord: Coordinator | None = None
        self.followers: Followers | None = None
        self.shard_endpoints: dict[int, str] = {shard: self.endpoint}
        self.pending_joins: list[tuple[bytes, str, P.Join]] = []
        self.coord_metrics = MetricsWriter(
            self.run_dir / "metrics" / "coordinator.jsonl" if self.run_dir and shard == 0 else None)
        self.stop_announced = False
        self.stop_time = 0.0
        self._checkpoint_next_commit = False
        if shard == 0:
            data = dataset_from_config(cfg.data, cfg.run.seed)
            manager = BatchSizeManager(cfg.mode.batch_policy, cfg.training.global_batch,
                                       min_batch=cfg.training.min_batch, max_batch=cfg.training.max_batch,
                                       policy_args=cfg.mode.batch_policy_args)
            self.coord = Coordinator(cfg, data.num_train, manager, self.policy, num_shards=S)
            self.followers = Followers(self.router.reply)
        if resume:
            self._resume()

    def _handlers(self) -> dict[type, Any]:
        return {
            P.Hello: self._on_hello, P.StatusRequest: self._on_status, P.Join: self._on_join,
            P.Heartbeat: self._on_heartbeat, P.Leave: self._on_leave, P.Push: self._on_push,
            P.Pull: self._on_pull, P.EvalReport: self._on_eval, P.Shutdown: self._on_shutdown,
            P.RegisterShard: self._on_register_shard, P.Have: self._on_have,
            P.ShardSync: self._on_shard_sync, P.Rollback: self._on_rollback,
        }

    # ----- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until the job has finished (or Shutdown, ``stop_event``, SIGINT/SIGTERM)."""
        if self.shard_id > 0:
            self._connect_to_coordinator(self.coordinator_endpoint)
        try:
            next_tick = time.monotonic()
            polled: object = object()  # the link socket the poller watches (None: no link)
            poller = zmq.Poller()
            while not self.stop_event.is_set():
                if self._relink_to is not None:
                    self._connect_to_coordinator(self._relink_to)
                    self._relink_to = None
                current = self.link.sock if self.link is not None else None
                if current is not polled:
                    poller = zmq.Poller()
                    poller.register(self.sock, zmq.POLLIN)
                    if current is not None:
                        poller.register(current, zmq.POLLIN)
                    polled = current
                events = dict(poller.poll(50))
                if self.link is not None and self.link.sock in events:
                    self._on_link_messages(self.link.receive())
                if self.sock in events:
                    self.router.poll(0)
                self._after_messages()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 0.1
                    self._tick()
        finally:
            self.close()

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.write(event="shutdown", version=self.state.version, log_hash=self.state.log_hash,
                           samples_applied=self.state.samples_applied, dropped=self.state.dropped,
                           counters=dict(self.counters), finished=self.finished)
        self.metrics.close()
        self.coord_metrics.close()
        if self.link is not None:
            self.link.close()
        close_socket(self.sock)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop_event.set())

    def _after_messages(self) -> None:
        """Carry out what the messages just handled led to: commits, Have reports, answers."""
        if self.coord is not None:
            self._advance()
        elif self._haves and self.link is not None:
            self.link.send(P.Have(shard=self.shard_id, entries=self._haves))
            self._haves = []
        if self._dirty:
            self._dirty = False
            self._serve_pulls()

    def _tick(self) -> None:
        """Timers: liveness, wall-clock stop, follower sync, the end of the job."""
        now = time.monotonic()
        if self.coord is not None:
            coord = self.coord
            stall = fault("coordinator_stall")
            if stall and not self._stall_done and self.state.version >= int(stall["version"]):
                self._stall_done = True
                log.warning("fault injection: coordinator loop stalls %.1fs", float(stall["seconds"]))
                time.sleep(float(stall["seconds"]))
                return  # heartbeats queued during the stall are read before anyone is judged
            if coord.started and not coord.stop and not self.router.pending():
                for w in coord.silent_workers(self.cfg.heartbeat.timeout_s):
                    self._remove_worker(w, f"lost (silent for more than {self.cfg.heartbeat.timeout_s}s)")
            if coord.check_time():
                self._advance()
            ck = self.cfg.checkpoint
            if (ck.every_seconds and coord.started and not coord.stop
                    and now - self.last_checkpoint_time >= ck.every_seconds):
                self._checkpoint_next_commit = True
            if coord.stop and self._job_collected(now):
                self._finish("every worker and the evaluator have the final version"
                             if coord.everyone_knows_stop() else
                             f"finish_timeout_s={self.cfg.training.finish_timeout_s} passed")
        elif self.link is not None:
            if now >= self._next_sync:
                self._send_sync()
            if self.stop_version >= 0 and self.link.silent_s() > self.cfg.transport.timeout_s:
                log.warning("the coordinator is gone after the stop: finishing")
                self._finish("coordinator gone after the stop")

    def _job_collected(self, now: float) -> bool:
        assert self.coord is not None
        if not self.stop_announced:
            return False
        if self.coord.everyone_knows_stop():
            return True
        return now - self.stop_time > self.cfg.training.finish_timeout_s

    def _finish(self, reason: str) -> None:
        """Every shard holds the final version: save it, tell the followers, exit."""
        if self.finished:
            return
        self.finished = True
        if self.followers is not None:
            self.followers.broadcast(P.Finish(reason=reason))
        self._write_final()
        self.metrics.write(event="finished", version=self.state.version, log_hash=self.state.log_hash,
                           reason=reason)
        log.info("shard %d finished at version %d (%s): %s", self.shard_id, self.state.version,
                 self.state.log_hash, reason)
        if self.link is not None or self.followers is not None:
            time.sleep(0.2)  # let the Finish leave before the socket closes (linger 0)
        self.stop_event.set()

    def _write_final(self) -> None:
        if self.run_dir is None:
            return
        meta = {**self.state.state_meta(), "shard": self.shard_id, "num_params": self.num_params,
                "range": list(self.ranges[self.shard_id]), "job_digest": self.job_digest,
                "stop_reason": self.stop_reason or (self.coord.stop_reason if self.coord else "")}
        save_checkpoint(self.run_dir / "final", self.shard_id, self.state.version,
                        self.state.state_arrays(), meta, keep=1)

    # ----- handlers shared by every shard ----------------------------------------------------
    def _on_hello(self, ident: bytes, role: str, msg: P.Hello) -> P.Message:
        return P.HelloReply(shard=self.shard_id, num_shards=self.cfg.cluster.num_shards)

    def _on_status(self, ident: bytes, role: str, msg: P.StatusRequest) -> P.Message:
        st = self.state
        base = dict(shard=self.shard_id, version=st.version, log_hash=st.log_hash,
                    counters={k: int(v) for k, v in self.counters.items()})
        coord = self.coord
        if coord is None:
            return P.Status(stop=self._stopped(), stop_reason=self.stop_reason, **base)
        return P.Status(iterations=coord.iterations_done(), epoch=coord.cursor.epoch,
                        samples=coord.cursor.state.samples_served, workers=len(coord.workers),
                        stop=coord.stop, stop_reason=coord.stop_reason, started=coord.started,
                        elapsed=coord.elapsed(), last_accuracy=coord.last_accuracy, **base)

    def _on_shutdown(self, ident: bytes, role: str, msg: P.Shutdown) -> P.Message | None:
        """The operator ends the job: on shard 0 by the normal stop (every shard ends at the
        same final version, saved); on a follower, this process only, at once."""
        log.info("shutdown requested by the operator: %s", msg.reason)
        if self.coord is not None and not self.finished:
            self.coord.request_stop(f"operator shutdown: {msg.reason}")
            self._advance()
            return P.Ack(what="shutdown")
        self.router.reply(ident, P.Ack(what="shutdown"))
        self.stop_event.set()
        return None

    def _on_push(self, ident: bytes, role: str, msg: P.Push) -> P.Message | None:
        (grad,) = msg.arrays
        tel = msg.telemetry
        if len(tel) > self.cfg.transport.max_telemetry_keys:
            raise Refused("too_many_keys", f"telemetry has {len(tel)} entries, at most "
                                           f"{self.cfg.transport.max_telemetry_keys} are accepted")
        late = self._check_push(msg)
        if late:
            self.counters["pushes_late"] += 1
        elif not self._stopped():
            try:
                self.state.receive(msg.worker_id, msg.iteration, msg.batch_size, grad)
            except GradientRejected as exc:
                raise Refused(exc.code, str(exc)) from None
            if self.coord is not None:
                self.coord.on_gradient(0, msg.worker_id, msg.iteration, msg.batch_size)
                self.coord.record_report(WorkerReport(
                    worker_id=msg.worker_id, iteration=msg.iteration, batch_size=msg.batch_size,
                    compute_s=float(tel.get("compute_s", 0.0)), iteration_s=float(tel.get("iteration_s", 0.0)),
                    telemetry=dict(tel)), msg.loss)
            else:
                self._haves.append([msg.worker_id, msg.iteration, msg.batch_size])
        if msg.pull:
            self.pulls.add(PendingPull(ident, msg.worker_id, msg.iteration + 1, after_push=not late))
            self._dirty = True
        return None

    def _check_push(self, msg: P.Push) -> bool:
        """Refuse a push this shard must not hold; True for a late one (dropped, not refused)."""
        w, t, x = msg.worker_id, msg.iteration, msg.batch_size
        coord = self.coord
        if coord is not None:
            if not coord.token_ok(w, msg.token):
                raise Refused("unauthorized", f"push for worker {w} without its membership token")
            if coord.stop:
                return True
            expected = coord.expected(w, t)
            if expected is None:
                if self.policy.round_based and t < coord.iteration:
                    return True
                raise Refused("not_planned", f"no assignment of worker {w} for iteration {t}")
            if expected != x:
                raise Refused("bad_batch", f"worker {w} was assigned {expected} samples for "
                                           f"iteration {t}, the push says {x}")
            return False
        if not self.member_key or not hmac.compare_digest(member_token(self.member_key, w), msg.token):
            raise Refused("unauthorized", f"push for worker {w} without its membership token")
        if self._stopped():
            return True
        if not 1 <= x <= self._max_batch():
            raise Refused("bad_batch", f"batch size {x} outside 1..{self._max_batch()}")
        if self.policy.round_based:
            if t <= self.last_iteration:
                return True
            plan = self.plan
            if plan is None or plan.iteration != t:
                raise Refused("not_planned", f"no plan for iteration {t} here "
                                             f"(collecting {plan.iteration if plan else 'nothing'})")
            try:
                planned = plan.batch_sizes[plan.workers.index(w)]
            except ValueError:
                raise Refused("not_planned", f"worker {w} is not in iteration {t}'s plan") from None
            if planned != x:
                raise Refused("bad_batch", f"worker {w} was planned {planned} samples for "
                                           f"iteration {t}, the push says {x}")
        return False

    def _max_batch(self) -> int:
        """The largest batch any assignment can carry (backup workers get a share of X/N)."""
        X = self.cfg.training.global_batch
        if self.cfg.elastic.keep == "worker_batch":
            X = max(X, (self.cfg.elastic.worker_batch or X) * 4096)
        return X * max(1, self.cfg.cluster.num_workers)

    def _on_pull(self, ident: bytes, role: str, msg: P.Pull) -> P.Message | None:
        if msg.worker_id >= 0:
            if role != "worker":
                raise Refused("forbidden", "only workers pull with a worker id")
            if self.coord is not None:
                self._member(msg.worker_id, msg.token)
            elif not self.member_key or not hmac.compare_digest(
                    member_token(self.member_key, msg.worker_id), msg.token):
                raise Refused("unauthorized", f"pull for worker {msg.worker_id} without its membership token")
        self.pulls.add(PendingPull(ident, msg.worker_id, msg.min_version, msg.exact))
        self._dirty = True
        return None

    def _stopped(self) -> bool:
        if self.coord is not None:
            return self.coord.stop
        return self.stop_version >= 0 and self.state.version >= self.stop_version

    def _serve_pulls(self) -> None:
        for p, reply in self.pulls.take_ready(self._pull_reply):
            self.router.reply(p.ident, reply)
            if (self.coord is not None and p.worker_id >= 0 and isinstance(reply, P.Params)
                    and reply.stop):
                self.coord.told_stop(p.worker_id)

    def _pull_reply(self, p: PendingPull) -> P.Message | None:
        st = self.state
        stop = self._stopped()
        if p.exact:
            if st.version < p.min_version:
                if stop:
                    return P.Error(code="beyond_final", message=f"the run stopped at version {st.version}")
                return None
            snap = st.snapshots.get(p.min_version)
            if snap is None:
                if p.min_version == st.version:
                    snap = (st.params, st.version_time, st.samples_applied)
                else:
                    return P.Error(code="snapshot_gone",
                                   message=f"no snapshot of version {p.min_version} (kept: {sorted(st.snapshots)})")
            return P.Params(shard=self.shard_id, version=p.min_version, version_time=snap[1],
                            samples=snap[2], stop=stop, log_hash=st.log_hash if p.min_version == st.version else "",
                            arrays=[snap[0]])
        assignment = None
        if not stop:
            if self.policy.round_based and st.version < p.min_version:
                return None
            if p.after_push and not self.policy.round_based and st.settled.get(p.worker_id, 0) < p.min_version:
                return None
            coord = self.coord
            if coord is not None and p.worker_id >= 0:
                if p.worker_id not in coord.workers:
                    return P.Error(code="unknown_worker", message=f"worker {p.worker_id} is not a member")
                key = st.version if self.policy.round_based else p.min_version
                assignment = coord.assignment(p.worker_id, key)
                if assignment is None:
                    return None
        return P.Params(shard=self.shard_id, version=st.version, version_time=st.version_time,
                        samples=st.samples_applied, stop=stop, assignment=assignment,
                        log_hash=st.log_hash, arrays=[st.params])

    # ----- coordinator: membership ------------------------------------------------------------
    def _coordinator(self) -> Coordinator:
        if self.coord is None:
            raise Refused("not_coordinator", f"shard {self.shard_id} is not the coordinator (shard 0)")
        return self.coord

    def _check_digest(self, digest: str) -> None:
        if not hmac.compare_digest(digest, self.job_digest):
            raise Refused("config_mismatch",
                          f"job config digest {digest!r} differs from the server's {self.job_digest}: "
                          "start every process of a job with the same model/data/optimizer/"
                          "training/mode settings")

    def _on_join(self, ident: bytes, role: str, msg: P.Join) -> P.Message | None:
        self._coordinator()
        self._check_digest(msg.job_digest)
        if len(self.pending_joins) >= MAX_PENDING_JOINS:
            raise Refused("busy", "too many joins are waiting for the shards to register")
        self.pending_joins.append((ident, role, msg))
        self._admit_joins()
        return None

    def _admit_joins(self) -> None:
        coord = self.coord
        assert coord is not None
        if not self.pending_joins or len(self.shard_endpoints) < self.cfg.cluster.num_shards:
            return
        for ident, role, join in self.pending_joins:
            wid = coord.join(join.name, join.instance, join.device) if role == "worker" else -1
            start = (coord.workers[wid].clock if wid >= 0 and not self.policy.round_based
                     else self.state.version)
            self.router.reply(ident, P.Welcome(
                worker_id=wid,
                shard_endpoints=[self.shard_endpoints[k] for k in range(self.cfg.cluster.num_shards)],
                shard_ranges=[list(r) for r in self.ranges], num_params=self.num_params,
                version=start, job=self.cfg.job_spec(), token=coord.token(wid) if wid >= 0 else ""))
        self.pending_joins = []
        self._announce_plan(coord.try_start())
        self._dirty = True

    def _member(self, worker_id: int, token: str) -> Coordinator:
        coord = self._coordinator()
        if worker_id not in coord.workers:
            raise Refused("unknown_worker", f"worker {worker_id} is not a member (declared lost?)")
        if not coord.token_ok(worker_id, token):
            raise Refused("unauthorized", f"worker {worker_id}'s membership token is wrong")
        return coord

    def _on_heartbeat(self, ident: bytes, role: str, msg: P.Heartbeat) -> P.Message:
        coord = self._member(msg.worker_id, msg.token)
        coord.heard_from(msg.worker_id)
        return P.HeartbeatReply(incarnation=self.incarnation, version=self.state.version, stop=coord.stop)

    def _on_leave(self, ident: bytes, role: str, msg: P.Leave) -> P.Message:
        self._member(msg.worker_id, msg.token)
        self._remove_worker(msg.worker_id, f"left ({msg.reason or 'no reason given'})")
        return P.Ack(what="leave")

    def _remove_worker(self, worker_id: int, reason: str) -> None:
        coord = self.coord
        assert coord is not None
        coord.leave(worker_id, reason)
        self.coord_metrics.write(event="worker_removed", worker=worker_id, reason=reason,
                                 live=coord.live(), version=self.state.version)
        self._advance()
        self._announce_plan(coord.try_start())
        self._dirty = True

    def _on_eval(self, ident: bytes, role: str, msg: P.EvalReport) -> P.Message:
        coord = self._coordinator()
        coord.on_eval(msg.accuracy, final=msg.final)
        t = self.cfg.training.target_accuracy
        if t is not None and msg.accuracy >= t:
            coord.request_stop(f"reached target_accuracy={t} (version {msg.version})")
        return P.Ack(what="eval_report")

    # ----- coordinator: commits ---------------------------------------------------------------
    def _advance(self) -> None:
        """Carry out the commits the coordinator decided, then announce a stop."""
        coord = self.coord
        assert coord is not None and self.followers is not None
        records = []
        for d in coord.decide():
            records.append(self._commit(d))
        if coord.stop and not self.stop_announced:
            self.stop_announced = True
            self.stop_time = time.monotonic()
            self.stop_version = coord.stop_version
            self.stop_reason = coord.stop_reason
            self.followers.broadcast(P.Stop(version=coord.stop_version, reason=coord.stop_reason))
            self.state.drop([k[:2] for k in self.state.holds()])
            self.coord_metrics.write(event="stop", version=coord.stop_version, reason=coord.stop_reason)
            self._dirty = True
        if records:
            self._serve_pulls()  # answer the workers before writing anything down
            self._dirty = False
            for d in records:
                self._log_commit(d)
        for ev in coord.drain_events():
            self.coord_metrics.write(**ev)

    def _commit(self, d: CommitDecision) -> CommitDecision:
        st = self.state
        ck = self.cfg.checkpoint
        checkpoint = self._checkpoint_next_commit or bool(
            ck.every_iterations and d.version % ck.every_iterations == 0)
        self._checkpoint_next_commit = False
        d.checkpoint = checkpoint
        msg = P.Commit(version=d.version, iteration=d.iteration, entries=d.entries, lr_scale=d.lr_scale,
                       drops=d.drops, next_plan=d.next_plan, checkpoint=checkpoint,
                       log_hash=next_log_hash(st.log_hash, d.version, d.iteration, d.entries, d.lr_scale))
        assert self.followers is not None
        self.followers.broadcast(msg)  # first: the followers apply in parallel with us
        applied = st.apply(d.iteration, d.entries, d.lr_scale)
        if applied.version != d.version or applied.log_hash != msg.log_hash:
            raise RuntimeError(f"coordinator state out of step: applied {applied.version}/{applied.log_hash}, "
                               f"decided {d.version}/{msg.log_hash}")
        st.drop(d.drops)
        if self.policy.round_based:
            st.drop_through(d.iteration)
        if checkpoint:
            self._write_checkpoint()
        self._dirty = True
        return d

    def _log_commit(self, d: CommitDecision) -> None:
        coord = self.coord
        assert coord is not None
        rec = d.record
        self.metrics.write(version=d.version, iteration=d.iteration, entries=d.entries,
                           lr_scale=d.lr_scale, samples=sum(x for _, x in d.entries),
                           log_hash=self.state.log_hash if d.version == self.state.version else None)
        self.coord_metrics.write(
            iteration=rec.iteration, version=rec.version, elapsed=rec.elapsed, duration=rec.duration,
            loss=rec.loss, epoch=rec.epoch, samples=rec.samples, applied_samples=rec.applied_samples,
            accepted=rec.accepted, batch_sizes={str(k): v for k, v in rec.batch_sizes.items()},
            ranges={str(k): v for k, v in rec.ranges.items()},
            workers={str(r.worker_id): dict(r.telemetry) for r in rec.reports},
            dropped=self.state.dropped, drops=d.drops, stop=coord.stop, stop_reason=coord.stop_reason,
            decision_s=coord.manager.last_decision_s)

    def _announce_plan(self, plan: P.Plan | None) -> None:
        if plan is not None and self.followers is not None:
            self.followers.broadcast(P.PlanMessage(plan=plan))
            self._dirty = True

    # ----- coordinator: the follower shards ----------------------------------------------------
    def _on_register_shard(self, ident: bytes, role: str, msg: P.RegisterShard) -> P.Message:
        coord = self._coordinator()
        assert self.followers is not None
        self._check_digest(msg.job_digest)
        if not 0 < msg.shard < self.cfg.cluster.num_shards:
            raise Refused("bad_shard", f"shard index {msg.shard} out of range")
        own = self.state.version
        if msg.version != own and not msg.resumed:
            raise Refused("needs_resume",
                          f"shard {msg.shard} is at version {msg.version} but the job is at {own}: "
                          "restart a shard of a running job with --resume")
        target = None
        if msg.resumed:
            # Even at the same version the restarted shard lost the gradients it held: everyone
            # goes back to a checkpoint they all have, and the workers join again.
            if self.checkpoint_dir is None:
                raise Refused("no_checkpoints", "the coordinator keeps no checkpoints to roll back to")
            if self.checkpointer is not None:
                self.checkpointer.flush()
            mine = [v for v, _ in list_checkpoints(self.checkpoint_dir, 0) if v <= min(own, msg.version)]
            if not mine:
                raise Refused("no_common_checkpoint",
                              f"shard 0 has no checkpoint at or before version {msg.version}")
            target = mine[-1]
            self._rollback_all(target, f"shard {msg.shard} resumed from version {msg.version}")
        elif coord.started and msg.shard in self.followers.peers:
            log.warning("shard %d registered again at the same version", msg.shard)
        self.shard_endpoints[msg.shard] = msg.endpoint
        self.followers.register(msg.shard, ident, msg.endpoint, msg.version)
        if target is not None and target != msg.version:
            self.followers.send(msg.shard, P.Rollback(version=target))
        log.info("shard %d registered at %s (version %d)", msg.shard, msg.endpoint, msg.version)
        self.coord_metrics.write(event="shard_registered", shard=msg.shard, endpoint=msg.endpoint,
                                 version=msg.version, resumed=msg.resumed)
        reply = P.Registered(member_key=coord.member_key, incarnation=self.incarnation,
                             version=self.state.version, plan=coord.current_plan(),
                             stop_version=coord.stop_version)
        self.router.reply(ident, reply)
        self._admit_joins()
        return None

    def _follower(self, ident: bytes, shard: int, version: int | None = None):
        assert self.followers is not None
        peer = self.followers.seen(shard, ident, version)
        if peer is None:
            raise Refused("unregistered", f"shard {shard} has not registered")
        return peer

    def _on_have(self, ident: bytes, role: str, msg: P.Have) -> None:
        coord = self._coordinator()
        self._follower(ident, msg.shard)
        for e in msg.entries:
            if len(e) == 3:
                coord.on_gradient(msg.shard, e[0], e[1], e[2])
        return None

    def _on_shard_sync(self, ident: bytes, role: str, msg: P.ShardSync) -> None:
        """A follower's beat: catch it up, or roll it back when its history differs."""
        coord = self._coordinator()
        assert self.followers is not None
        self._follower(ident, msg.shard, msg.version)
        own = self.state.version
        if msg.version < own:
            missing = self.followers.commits_after(msg.version)
            if missing is None:
                self._realign(msg.shard, msg.version, "too far behind to catch up")
                return None
            for c in missing:
                self.followers.send(msg.shard, c)
        elif msg.version > own:
            self._realign(msg.shard, msg.version, "ahead of the coordinator")
            return None
        elif msg.log_hash != self.state.log_hash:
            self._realign(msg.shard, msg.version, f"history differs ({msg.log_hash} vs {self.state.log_hash})")
            return None
        else:
            for e in msg.entries:
                if len(e) == 3:
                    coord.on_gradient(msg.shard, e[0], e[1], e[2])
        plan = coord.current_plan()
        if plan is not None:
            self.followers.send(msg.shard, P.PlanMessage(plan=plan))
        if coord.stop:
            self.followers.send(msg.shard, P.Stop(version=coord.stop_version, reason=coord.stop_reason))
        return None

    def _realign(self, shard: int, version: int, why: str) -> None:
        """A follower whose history cannot be replayed: everyone back to a common checkpoint."""
        log.error("shard %d at version %d: %s", shard, version, why)
        common = []
        if self.checkpoint_dir is not None:
            if self.checkpointer is not None:
                self.checkpointer.flush()
            common = [v for v, _ in list_checkpoints(self.checkpoint_dir, 0) if v <= min(version, self.state.version)]
        if not common:
            assert self.coord is not None
            self.coord.request_stop(f"shard {shard} diverged ({why}) and no checkpoint is common")
            self._advance()
            return
        self._rollback_all(common[-1], f"shard {shard} {why}")

    # ----- checkpoints ----------------------------------------------------------------------
    def _write_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        meta = {**self.state.state_meta(), "shard": self.shard_id, "num_params": self.num_params,
                "job_digest": self.job_digest}
        if self.coord is not None:
            meta["coordinator"] = self.coord.state_dict()
            meta["shard_endpoints"] = {str(k): ep for k, ep in self.shard_endpoints.items()}
        self.checkpointer.submit(self.state.version, self.state.state_arrays(), meta)
        self.last_checkpoint_time = time.monotonic()
        self.metrics.write(event="checkpoint", version=self.state.version, log_hash=self.state.log_hash)

    def _restore(self, version: int | None) -> dict:
        assert self.checkpoint_dir is not None
        if self.checkpointer is not None:
            self.checkpointer.flush()
        path = find_checkpoint(self.checkpoint_dir, self.shard_id, version)
        arrays, meta = load_checkpoint(path)
        if meta.get("job_digest") != self.job_digest:
            raise CheckpointError(f"{path} belongs to another job (digest {meta.get('job_digest')})")
        self.state.restore(arrays, meta)
        for p in self.pulls.clear():
            self.router.reply(p.ident, P.Error(code="rolled_back",
                                               message=f"the job went back to version {self.state.version}"))
        self.plan, self.last_iteration = None, -1
        self.stop_version, self.stop_reason = -1, ""
        if self.coord is not None:
            self.coord.load_state_dict(meta["coordinator"])
            self.incarnation = os.urandom(6).hex()  # workers notice and join again
            self.stop_announced = False
            if self.followers is not None:
                self.followers.clear_log()
        self.metrics.write(event="restored", version=self.state.version, log_hash=self.state.log_hash,
                           path=str(path))
        log.info("shard %d restored version %d from %s", self.shard_id, self.state.version, path)
        return meta

    def _resume(self) -> None:
        """``--resume``: the newest checkpoint; a resumed shard 0 moves the followers back to it
        and tells them where it now listens."""
        meta = self._restore(None)
        self.resumed = True
        if self.coord is not None:
            from ps_common.transport import Connection

            for k, ep in meta.get("shard_endpoints", {}).items():
                if int(k) == 0:
                    continue
                conn = Connection(self.ctx, ep, role="shard", security=self.cfg.security, timeout_s=2.0)
                try:
                    conn.request(P.Rollback(version=self.state.version, coordinator=self.endpoint),
                                 P.Ack, timeout_s=5.0)
                except Exception as exc:  # a follower that is gone registers when it is back
                    log.warning("shard %s at %s not told to roll back: %s", k, ep, exc)
                finally:
                    conn.close()

    def _rollback_all(self, version: int, reason: str) -> None:
        log.warning("rolling the job back to version %d: %s", version, reason)
        self._restore(version)
        self.coord_metrics.write(event="rollback", version=version, reason=reason)
        assert self.followers is not None
        self.followers.broadcast(P.Rollback(version=version))

    # ----- follower: the link to the coordinator ------------------------------------------------
    def _connect_to_coordinator(self, endpoint: str | None) -> None:
        assert endpoint
        if self.link is not None:
            self.link.close()
        self.link = CoordinatorLink(self.ctx, endpoint, security=self.cfg.security, hwm=self.cfg.transport.hwm,
                                    timeout_s=self.cfg.transport.timeout_s)
        reg = self.link.register(P.RegisterShard(
            shard=self.shard_id, endpoint=self.endpoint, job_digest=self.job_digest,
            version=self.state.version, log_hash=self.state.log_hash, resumed=self.resumed),
            self.cfg.transport.connect_timeout_s)
        self.member_key = reg.member_key
        self.stop_version = reg.stop_version
        self._set_plan(reg.plan)
        self._next_sync = time.monotonic() + self.cfg.transport.shard_sync_s

    def _send_sync(self) -> None:
        assert self.link is not None
        self.link.send(P.ShardSync(shard=self.shard_id, version=self.state.version,
                                   log_hash=self.state.log_hash, entries=self.state.holds()[:4096]))
        self._next_sync = time.monotonic() + self.cfg.transport.shard_sync_s

    def _set_plan(self, plan: P.Plan | None) -> None:
        if plan is not None and plan.iteration > self.last_iteration and (
                self.plan is None or plan.iteration >= self.plan.iteration):
            self.plan = plan
            self._dirty = True

    def _on_link_messages(self, msgs: list[P.Message]) -> None:
        for msg in msgs:
            if isinstance(msg, P.Commit):
                self._apply_commit(msg)
            elif isinstance(msg, P.PlanMessage):
                self._set_plan(msg.plan)
            elif isinstance(msg, P.Stop):
                self.stop_version, self.stop_reason = msg.version, msg.reason
                self._dirty = True
            elif isinstance(msg, P.Rollback):
                self._follower_rollback(msg.version)
            elif isinstance(msg, P.Finish):
                self._finish(msg.reason)
            elif isinstance(msg, P.Error):
                log.error("the coordinator refused: [%s] %s", msg.code, msg.message)
        if self._stopped() and self.state.held:
            self.state.drop([k[:2] for k in self.state.holds()])

    def _apply_commit(self, msg: P.Commit) -> None:
        st = self.state
        if msg.version <= st.version:
            return  # a repeat sent while catching up
        if msg.version != st.version + 1:
            log.warning("commit %d while at version %d: asking to catch up", msg.version, st.version)
            self._send_sync()
            return
        try:
            applied = st.apply(msg.iteration, msg.entries, msg.lr_scale)
        except MissingGradient as exc:
            log.error("%s; stopping this shard rather than diverge", exc)
            self.exit_code = 3
            self.stop_event.set()
            return
        if applied.log_hash != msg.log_hash:
            log.error("history differs from the coordinator's at version %d (%s vs %s): stopping",
                      applied.version, applied.log_hash, msg.log_hash)
            self.exit_code = 3
            self.stop_event.set()
            return
        st.drop(msg.drops)
        if self.policy.round_based:
            self.last_iteration = msg.iteration
            st.drop_through(msg.iteration)
            if self.plan is not None and self.plan.iteration <= msg.iteration:
                self.plan = None
            self._set_plan(msg.next_plan)
        self._dirty = True
        self._serve_pulls()
        self._dirty = False
        ck = self.cfg.checkpoint
        if msg.checkpoint or (ck.every_iterations and st.version % ck.every_iterations == 0):
            self._write_checkpoint()
        self.metrics.write(version=applied.version, iteration=applied.iteration, entries=applied.entries,
                           lr_scale=msg.lr_scale, samples=applied.samples, log_hash=applied.log_hash)

    def _on_rollback(self, ident: bytes, role: str, msg: P.Rollback) -> P.Message:
        """A restarted shard 0 (``--resume``) moves this follower back and to its new address."""
        if self.coord is not None:
            raise Refused("not_follower", "the coordinator's shard takes no rollback orders")
        self._follower_rollback(msg.version)
        self._relink_to = msg.coordinator or self.coordinator_endpoint
        self.coordinator_endpoint = self._relink_to
        return P.Ack(what="rollback")

    def _follower_rollback(self, version: int) -> None:
        try:
            self._restore(version)
        except CheckpointError as exc:
            log.error("cannot roll back: %s; stopping this shard to avoid inconsistent parameters", exc)
            self.exit_code = 3
            self.stop_event.set()
