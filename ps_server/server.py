"""The shard server: a message loop around one shard's state.

The loop only moves messages (:mod:`ps_server.router`); what a shard does beyond holding
gradients and answering pulls depends on its role: shard 0 leads (:mod:`ps_server.lead`: the
coordinator decides every commit), the others follow (:mod:`ps_server.follow`: they apply the
commits, in order, that come down their link).

The path of one round-mode iteration t with S shards:

1. each worker pushes its gradient slices (``Push`` with ``pull``) to every shard;
2. a follower checks the push against t's plan, holds the gradient and tells the coordinator
   (``Have``); shard 0 notes its own slice directly;
3. once the policy's set is complete on every shard, the coordinator sends ``Commit(t)`` (with
   the plan of t+1) to every follower and applies it itself;
4. each shard answers the waiting pushes with its parameters at version t+1; shard 0's answer
   carries the worker's assignment for t+1.

Slow work (checkpoint writes) runs on a thread; liveness is judged only when no message is
queued, so a stall of the loop cannot declare a worker lost whose heartbeats are waiting.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from ps_common import protocol as P
from ps_common.cgroup_cpu import usable_cores
from ps_common.cli_util import StopFlag
from ps_common.config import JobConfig
from ps_common.errors import UsageError
from ps_common.heap import keep_freed_memory
from ps_common.metrics import MetricsWriter, existing_for
from ps_common.open_files import ensure_open_files, server_open_files
from ps_common.security.sockets import close_socket
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts
from ps_common.transport import WILDCARD_HOSTS, advertised, bind_address, make_router
from ps_ml.models import FlatParameters, build_model
from ps_server.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    drop_checkpoints_after,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ps_server.follow import Follow
from ps_server.layout import partition
from ps_server.lead import Lead
from ps_server.optimizer import block_elements
from ps_server.params_parts import PartCutter, answer_part_elements
from ps_server.pulls import PendingPull, PendingPulls
from ps_server.roles import SHARD_PERMISSIONS
from ps_server.router import Limits, Refused, RouterLoop
from ps_server.shard import GradientRejected, ShardState, Snapshot
from ps_server.sync import sync_policy_for
from ps_server.threads import WAIT_POLICY

log = logging.getLogger(__name__)

HEADER_MARGIN = 1 << 20


def initial_parameters(cfg: JobConfig) -> np.ndarray:
    """The job's initial flat parameter vector: same (model, seed) -> same bits everywhere."""
    model = build_model(cfg.model.name, seed=cfg.run.seed)
    return FlatParameters(model).params_numpy().copy()


def _is_loopback(host: str) -> bool:
    if host.startswith("ipc://"):
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
                 resume: bool | str = False, overwrite: bool = False,
                 timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        S = cfg.cluster.num_shards
        if not 0 <= shard < S:
            raise UsageError(f"--shard must be in 0..{S - 1} (cluster.num_shards={S})")
        if shard > 0 and not coordinator:
            raise UsageError("shards other than 0 need --coordinator ENDPOINT (shard 0's address)")
        if cfg.security.mechanism == "none":
            raise UsageError("no credentials: set security.secret_file (a job secret: `ps-keys secret "
                             "FILE`; ps-launch makes one per run) or turn on security.curve")
        self.cfg = cfg
        self.timeouts = timeouts
        self.shard_id = shard
        # Before any socket: a run directory holding an earlier run is refused here (metrics of
        # two runs in one file would be summed as one run's), unless resumed or overwritten.
        self.run_dir = Path(run_dir) if run_dir else None
        ck = cfg.checkpoint
        self.checkpoint_dir: Path | None = (
            Path(ck.dir) if ck.dir else (self.run_dir / "checkpoints" if self.run_dir else None))
        if resume == "auto":  # a restarted container or pod: go on from a checkpoint if it has one
            resume = self.checkpoint_dir is not None and bool(list_checkpoints(self.checkpoint_dir, shard))
        elif not isinstance(resume, bool):
            raise UsageError(f"resume must be True, False or 'auto', got {resume!r}")
        self.metrics_existing = existing_for(resume=resume, overwrite=overwrite)
        self.metrics = MetricsWriter(self.run_dir / "metrics" / f"shard-{shard}.jsonl" if self.run_dir else None,
                                     self.metrics_existing)
        # The update and the finiteness sum split over cluster.shard_threads; the coordinator's
        # predictors (NARX, ARIMA) are too small for torch to split, whatever the setting.
        torch.set_num_threads(cfg.cluster.shard_threads)
        if cfg.cluster.shard_threads > 1 and cfg.cluster.shard_threads > (cores := usable_cores()):
            log.warning("cluster.shard_threads is %d but shard %d may use %g cores: its update's "
                        "threads will take turns, slower than %d", cfg.cluster.shard_threads, shard,
                        cores, max(1, int(cores)))
        keep_freed_memory()       # every push is a slice of the model, every reply too (ps_common.heap)
        self.ctx = ctx or zmq.Context.instance()
        full = initial_parameters(cfg)
        self.ranges = partition(full.size, S)
        lo, hi = self.ranges[shard]
        self.num_params = full.size
        self.policy = sync_policy_for(cfg)
        self.state = ShardState(
            shard, full[lo:hi].copy(), cfg.optimizer, reject_nonfinite=cfg.training.reject_nonfinite,
            snapshot_every=cfg.evaluator.every_iterations if cfg.evaluator.enabled else 0,
            max_snapshots=cfg.evaluator.snapshots)
        t = cfg.transport
        ensure_open_files(server_open_files(cfg.cluster.num_workers, shard),
                          f"shard {shard} with {cfg.cluster.num_workers} workers")
        bind_host = host or cfg.cluster.host
        if bind_host in WILDCARD_HOSTS and not advertise_host:
            raise UsageError(f"shard {shard} would bind every interface ({bind_host}) and tell workers and "
                             f"other shards to dial tcp://{bind_host}:PORT, which no machine can: pass "
                             "--advertise HOST, the name or address they reach this machine at")
        self.sock, bound = make_router(self.ctx, bind_address(bind_host, port),
                                       max_msg_bytes=(hi - lo) * 4 + HEADER_MARGIN,
                                       security=cfg.security, hwm=t.hwm)
        self.endpoint = advertised(bound, advertise_host)
        if not cfg.security.curve and not _is_loopback(bind_host):
            log.warning("!!! shard %d binds %s WITHOUT CURVE: traffic (gradients, parameters and the "
                        "job secret's role passwords) crosses the network in the clear; anyone on "
                        "the path can read or alter it. Turn on security.curve for multi-host runs. !!!",
                        shard, bind_host)
        self.pulls = PendingPulls(t.max_pending_pulls_per_peer, t.max_pending_pulls)
        self.part_elems = answer_part_elements(hi - lo, t.params_part_bytes, t.hwm)
        self.job_digest = cfg.job_digest()
        self.incarnation = os.urandom(6).hex()
        self.stop_event = StopFlag()
        self.exit_code = 0
        self.finished = False
        self.resumed = False
        self._dirty = True  # pulls may be answerable
        if self.checkpoint_dir is None and (ck.every_iterations or ck.every_seconds or resume):
            raise UsageError("checkpoints need checkpoint.dir or --run-dir")
        self.checkpointer = (CheckpointWriter(self.checkpoint_dir, shard, ck.keep)
                             if self.checkpoint_dir is not None else None)
        self.last_checkpoint_time = time.monotonic()
        self.role: Lead | Follow = Lead(self) if shard == 0 else Follow(self, coordinator or "")
        self.router = RouterLoop(self.sock, {**self._handlers(), **self.role.handlers()}, server=f"shard {shard}",
                                 limits=Limits(max_frames=t.max_frames, max_array_bytes=(hi - lo) * 4),
                                 permissions=SHARD_PERMISSIONS)
        self.counters = self.router.counters
        if resume:
            meta = self.restore(None)
            self.resumed = True
            self.role.resumed(meta)

    def _handlers(self) -> dict[type, Any]:
        return {P.Hello: self._on_hello, P.StatusRequest: self._on_status, P.Push: self._on_push,
                P.Pull: self._on_pull, P.Shutdown: self._on_shutdown}

    def router_reply(self, ident: bytes, msg: P.Message) -> bool:
        return self.router.reply(ident, msg)

    # ----- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until the job has finished (or Shutdown, ``stop_event``, SIGINT/SIGTERM)."""
        self.role.start()
        try:
            next_tick = time.monotonic()
            polled: object = object()  # the link socket the poller watches (None: none)
            poller = zmq.Poller()
            while not self.stop_event.is_set():
                link = self.role.link_socket()
                if link is not polled:
                    poller = zmq.Poller()
                    poller.register(self.sock, zmq.POLLIN)
                    if link is not None:
                        poller.register(link, zmq.POLLIN)
                    polled = link
                events = dict(poller.poll(int(self.timeouts.loop_poll_s * 1000)))
                if link is not None and link in events:
                    self.role.on_link_messages()  # type: ignore[union-attr]
                if self.sock in events:
                    self.router.poll(0)
                self.role.after_messages()
                if self._dirty:
                    self.serve_pulls()
                self.state.finish_update()  # a commit nobody waited for: its update now, not later
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.timeouts.tick_s
                    self.role.tick(time.monotonic())
        finally:
            self.close()

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close(self.timeouts)
        self.metrics.write(event="shutdown", version=self.state.version, log_hash=self.state.log_hash,
                           samples_applied=self.state.samples_applied, dropped=self.state.dropped,
                           counters=dict(self.counters), finished=self.finished,
                           timings=self.router.timings.as_dict(), torch_threads=torch.get_num_threads(),
                           omp_wait_policy=os.environ.get(WAIT_POLICY))
        self.metrics.close()
        self.role.close()
        close_socket(self.sock)

    def install_signal_handlers(self) -> None:
        self.stop_event.install((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

    def fail(self, why: str) -> None:
        """This shard cannot go on without risking a different history: stop it, loudly."""
        log.error("%s", why)
        self.exit_code = 3
        self.stop_event.set()

    def finish(self, reason: str) -> None:
        """Every shard holds the final version: save it, tell the followers, exit."""
        if self.finished:
            return
        self.finished = True
        self.role.finishing(reason)
        self._write_final()
        self.metrics.write(event="finished", version=self.state.version, log_hash=self.state.log_hash,
                           reason=reason)
        log.info("shard %d finished at version %d (%s): %s", self.shard_id, self.state.version,
                 self.state.log_hash, reason)
        time.sleep(self.timeouts.finish_linger_s)  # the last messages leave before the sockets close
        self.stop_event.set()

    def _write_final(self) -> None:
        if self.run_dir is None:
            return
        meta = {**self.state.state_meta(), "shard": self.shard_id, "num_params": self.num_params,
                "range": list(self.ranges[self.shard_id]), "job_digest": self.job_digest,
                "stop_reason": self.role.stop_reason()}
        save_checkpoint(self.run_dir / "final", self.shard_id, self.state.version,
                        self.state.state_arrays(), meta, keep=1)

    # ----- handlers every shard has -------------------------------------------------------------
    def _on_hello(self, ident: bytes, role: str, msg: P.Hello) -> P.Message:
        return P.HelloReply(shard=self.shard_id, num_shards=self.cfg.cluster.num_shards)

    def _on_status(self, ident: bytes, role: str, msg: P.StatusRequest) -> P.Message:
        st = self.state
        return P.Status(shard=self.shard_id, version=st.version, log_hash=st.log_hash,
                        counters={k: int(v) for k, v in self.counters.items()}, **self.role.status())

    def _on_shutdown(self, ident: bytes, role: str, msg: P.Shutdown) -> P.Message | None:
        """The operator ends the job: on shard 0 by the normal stop (every shard ends at the same
        final version, saved); on a follower, this process only, at once."""
        log.info("shutdown requested by the operator: %s", msg.reason)
        reply = self.role.shutdown(msg.reason)
        if reply is not None:
            return reply
        self.router.reply(ident, P.Ack(what="shutdown"))
        self.stop_event.set()
        return None

    def _on_push(self, ident: bytes, role: str, msg: P.Push) -> None:
        late = self.role.check_push(msg)
        if msg.pull:
            self.pulls.check_room(ident, msg.worker_id)  # a refused push must hold nothing
        if late:
            self.counters["pushes_late"] += 1
        elif not self.role.stopped():
            try:
                self.state.receive(msg.worker_id, msg.iteration, msg.batch_size, msg.arrays[0])
            except GradientRejected as exc:
                raise Refused(exc.code, str(exc)) from None
            self.role.accepted_push(msg)
        if msg.pull:
            self.pulls.add(PendingPull(ident, msg.worker_id, msg.iteration + 1, after_push=not late))
            self._dirty = True
        return None

    def largest_batch(self) -> int:
        """The largest batch any assignment can carry (backup workers get a share of X/N)."""
        X = self.cfg.training.global_batch
        if self.cfg.elastic.keep == "worker_batch":
            X = max(X, (self.cfg.elastic.worker_batch or X) * 4096)
        return X * max(1, self.cfg.cluster.num_workers)

    def _on_pull(self, ident: bytes, role: str, msg: P.Pull) -> None:
        if msg.worker_id >= 0:
            if role != "worker":
                raise Refused("forbidden", "only workers pull with a worker id")
            self.role.check_pull_token(msg.worker_id, msg.token)
        self.pulls.add(PendingPull(ident, msg.worker_id, msg.min_version, msg.exact))
        self._dirty = True
        return None

    # ----- answering pulls ------------------------------------------------------------------------
    def pulls_changed(self) -> None:
        self._dirty = True

    def serve_pulls(self) -> None:
        """Answer every pull that can be answered now. Right after a commit, the new version's
        parameters go out in parts (``transport.params_part_bytes``), each sent as soon as the
        update has computed it, to every pull that waited for that version."""
        self._dirty = False
        st = self.state
        ready = self.pulls.take_ready(self._pull_reply)
        streamed: list[tuple[PendingPull, P.Params]] = []
        if st.updating and 0 < self.part_elems < st.size:
            buf = st.newest_params
            whole: list[tuple[PendingPull, P.Message]] = []
            for p, r in ready:
                if isinstance(r, P.Params) and r.arrays[0] is buf:
                    streamed.append((p, r))
                else:
                    whole.append((p, r))
            ready = whole
        else:
            st.finish_update()  # a whole reply is sent zero-copy: its array must be final
        for p, reply in ready:
            self.router.reply(p.ident, reply)
            self.role.answered(p, reply)
        if streamed:
            self._stream(streamed)
        st.finish_update()

    def _stream(self, answers: list[tuple[PendingPull, P.Params]]) -> None:
        """Finish the pending update, sending each waiting pull every part of the new slice as
        soon as it is final. A pull whose part could not be sent (its peer gone or not reading)
        gets no more: its worker waits for its deadline, as for a whole reply dropped."""
        st = self.state
        buf = st.newest_params
        cutter = PartCutter(st.size, self.part_elems)
        live = [True] * len(answers)
        router = self.router

        def send_ready(end: int) -> None:
            for lo, hi in cutter.ready(end):
                # Only the first part differs between workers (their assignments): a later one is
                # encoded once per header and its frames go to every worker.
                shared: dict[tuple, list] = {}
                for i, (p, r) in enumerate(answers):
                    if not live[i]:
                        continue
                    if lo == 0:
                        live[i] = router.reply(p.ident, dataclasses.replace(
                            r, offset=0, parts=cutter.count, arrays=[buf[lo:hi]]))
                        continue
                    key = (r.version, r.version_time, r.samples, r.stop, r.log_hash)
                    frames = shared.get(key)
                    if frames is None:
                        frames = shared[key] = P.encode(dataclasses.replace(
                            r, offset=lo, parts=cutter.count, arrays=[buf[lo:hi]], assignment=None))
                    live[i] = router.send_encoded(p.ident, frames, P.Params.TYPE)

        # Blocks no larger than a part, so that the first part leaves after a part's worth of
        # the update (with many threads the optimizer's own blocks hold most of a slice).
        st.finish_update(send_ready, block=min(block_elements(), self.part_elems))
        for p, reply in answers:
            self.role.answered(p, reply)

    def _pull_reply(self, p: PendingPull) -> P.Message | None:
        st = self.state
        stop = self.role.stopped()
        if p.exact:
            if st.version < p.min_version:
                if stop:
                    return P.Error(code="beyond_final", message=f"the run stopped at version {st.version}")
                return None
            snap = st.snapshot_at(p.min_version)
            if snap is None:
                if p.min_version != st.version:
                    return P.Error(code="snapshot_gone",
                                   message=f"no snapshot of version {p.min_version} (kept: {sorted(st.snapshots)})")
                snap = Snapshot(st.params, st.version_time, st.samples_applied, st.log_hash)
            # the version's own log hash, an older snapshot's too (before 2026-11-28 only the
            # current version's: a measurement of an older one could not prove its history)
            return P.Params(shard=self.shard_id, version=p.min_version, version_time=snap.version_time,
                            samples=snap.samples, stop=stop, log_hash=snap.log_hash, arrays=[snap.params])
        assignment = None
        if not stop:
            if not self.policy.pull_answerable(version=st.version, min_version=p.min_version,
                                               settled=st.settled.get(p.worker_id, 0), after_push=p.after_push):
                return None
            if p.worker_id >= 0:
                if isinstance(self.role, Lead):  # only shard 0 hands out assignments
                    got = self.role.assignment(p)
                    if got is None or isinstance(got, P.Error):
                        return got  # wait (no assignment due yet), or the refusal
                    assignment = got
                elif not self.role.may_answer(p):
                    return None  # SSP: the slowest worker is too far behind (shard 0's Clocks)
        return P.Params(shard=self.shard_id, version=st.version, version_time=st.version_time,
                        samples=st.samples_applied, stop=stop, assignment=assignment,
                        log_hash=st.log_hash, arrays=[st.newest_params])

    # ----- checkpoints ----------------------------------------------------------------------------
    def write_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        meta = {**self.state.state_meta(), "shard": self.shard_id, "num_params": self.num_params,
                "job_digest": self.job_digest, **self.role.checkpoint_meta()}
        self.checkpointer.submit(self.state.version, self.state.state_arrays(), meta)
        self.last_checkpoint_time = time.monotonic()
        self.metrics.write(event="checkpoint", version=self.state.version, log_hash=self.state.log_hash)

    def restore(self, version: int | None, expect_log_hash: str = "") -> dict:
        """Back to this shard's checkpoint at ``version`` (the newest if None); waiting pulls are
        answered with ``rolled_back`` so their workers join again. With ``expect_log_hash`` (shard
        0's at that version) a checkpoint of another history raises CheckpointError and changes
        nothing: restoring it would put this shard's parameters out of step with the others'."""
        assert self.checkpoint_dir is not None
        if self.checkpointer is not None:
            self.checkpointer.flush()
        path = find_checkpoint(self.checkpoint_dir, self.shard_id, version)
        arrays, meta = load_checkpoint(path)
        if meta.get("job_digest") != self.job_digest:
            raise CheckpointError(f"{path} belongs to another job (digest {meta.get('job_digest')})")
        if expect_log_hash and meta.get("log_hash") != expect_log_hash:
            raise CheckpointError(f"{path} holds another history than shard 0's at version {version} "
                                  f"(log hash {meta.get('log_hash')} vs {expect_log_hash})")
        self.state.restore(arrays, meta)
        self._went_back(version, meta, str(path))
        return meta

    def rewind(self, version: int, log_hash: str) -> bool:
        """A follower told to go back to ``version`` of the history ``log_hash`` whose checkpoint
        there it cannot read: if it is at exactly that version of that history (equal hashes
        mean equal histories), it goes back from memory, to what the checkpoint holds, and
        returns True. Otherwise nothing changes (False). Not shard 0: its role restores its
        coordinator from the checkpoint's record."""
        if self.shard_id == 0:
            raise RuntimeError("shard 0 goes back only to a checkpoint: its coordinator's state is in its record")
        st = self.state
        if (st.version, st.log_hash) != (version, log_hash):
            return False
        st.rewind()
        self._went_back(version, {}, "memory")
        return True

    def _went_back(self, version: int | None, meta: dict, source: str) -> None:
        """After a restore or a rewind: the abandoned history's checkpoints deleted, waiting
        pulls answered ``rolled_back``, the role told."""
        assert self.checkpoint_dir is not None
        if version is not None and (dropped := drop_checkpoints_after(self.checkpoint_dir, self.shard_id, version)):
            self.metrics.write(event="checkpoints_dropped", versions=dropped)
            log.info("shard %d dropped the checkpoints of the abandoned history: versions %s",
                     self.shard_id, dropped)
        for p in self.pulls.clear():
            self.router_reply(p.ident, P.Error(code="rolled_back",
                                               message=f"the job went back to version {self.state.version}"))
        self.role.restored(meta)
        self.metrics.write(event="restored", version=self.state.version, log_hash=self.state.log_hash,
                           path=source)
        log.info("shard %d restored version %d from %s", self.shard_id, self.state.version, source)
