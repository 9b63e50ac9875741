"""Shard 0's part of the server: it runs the coordinator and leads the followers.

What comes in: joins, heartbeats, leaves and evaluator reports; pushes (shard 0's own slice and
the worker's telemetry); the followers' registrations, ``Have`` reports and ``ShardSync`` beats.
What goes out: ``Commit``/``Plan``/``Stop``/``Rollback``/``Finish`` down each follower's link,
and the pull answers that carry assignments. The decisions themselves are the coordinator's
(:mod:`ps_server.coordinator`); this module carries them out in the order that keeps every
shard in step: commit to the followers first, apply locally, answer the waiting workers, and
only then write anything down.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from ps_common import protocol as P
from ps_common.faults import fault
from ps_common.metrics import MetricsWriter
from ps_common.report import Telemetry
from ps_ml.datasets import dataset_from_config
from ps_server.checkpoint import checkpoint_hashes
from ps_server.control import Follower, Followers
from ps_server.coordinator import CommitDecision, Coordinator, JoinRefused, NotReassigned
from ps_server.pulls import PendingPull
from ps_server.router import Refused, worth_logging
from ps_server.shard import next_log_hash

if TYPE_CHECKING:
    from ps_server.server import ShardServer

log = logging.getLogger(__name__)
#: a push without a report: nothing measured (with its row, as a received report has)
_NOT_MEASURED = Telemetry.from_checked({})

#: Longest worker name, instance, device or leave reason taken in (they go into logs, records,
#: checkpoints and the memory caps' keys).
MAX_TEXT = 256

MAX_PENDING_JOINS = 1024


class Lead:
    """The coordinator's role in a shard server (shard 0)."""


    def __init__(self, server: "ShardServer") -> None:
        self.server = server
        cfg = server.cfg
        self.cfg = cfg
        data = dataset_from_config(cfg.data, cfg.run.seed)
        manager = BatchSizeManager(cfg.mode.batch_policy, cfg.training.global_batch,
                                   min_batch=cfg.training.min_batch, max_batch=cfg.training.max_batch,
                                   policy_args=cfg.mode.batch_policy_args,
                                   memory_caps=cfg.training.memory_caps, oom_margin=cfg.training.oom_margin)
        self.coord = Coordinator(cfg, data.num_train, manager, server.policy, num_shards=cfg.cluster.num_shards)
        self.followers = Followers(server.router_reply)
        self.shard_endpoints: dict[int, str] = {0: server.endpoint}
        self.pending_joins: list[tuple[bytes, str, P.Join]] = []
        self.claims: dict[str, int] = {}  # follower instance -> index (dmlc: servers have none)
        self.metrics = MetricsWriter(server.run_dir / "metrics" / "coordinator.jsonl" if server.run_dir else None,
                                     server.metrics_existing)
        self.stop_announced = False
        self.stop_time = 0.0
        #: the slowest clock the followers were last told (SSP's ``Clocks``; None: tell them)
        self._clocks_sent: int | None = None
        #: the number of the last Rollback sent to a follower; it starts at the clock's
        #: milliseconds (and above the one a resumed checkpoint saved: ``resumed``), so a
        #: restarted shard 0 counts on above its previous process and the beats queued for that
        #: process are told from its own followers' (see _on_shard_sync)
        self.rollback_epoch = int(time.time() * 1000)
        self.checkpoint_next_commit = False
        self._stall_done = False

    # ----- the hooks the server calls ---------------------------------------------------------
    def handlers(self) -> dict[type, Any]:
        return {P.Join: self._on_join, P.Heartbeat: self._on_heartbeat, P.Leave: self._on_leave,
                P.EvalReport: self._on_eval, P.RegisterShard: self._on_register_shard,
                P.ClaimShard: self._on_claim_shard,
                P.Have: self._on_have, P.ShardSync: self._on_shard_sync,
                P.OutOfMemory: self._on_out_of_memory, P.TakeChunk: self._on_take_chunk}

    def link_socket(self):
        return None

    def start(self) -> None:
        pass

    def stopped(self) -> bool:
        return self.coord.stop

    def stop_reason(self) -> str:
        return self.coord.stop_reason

    def check_push(self, msg: P.Push) -> bool:
        """Refuse a push that is not due; True for a late one (dropped, not refused)."""
        coord = self.coord
        w, t, x = msg.worker_id, msg.iteration, msg.batch_size
        if not coord.token_ok(w, msg.token):
            raise Refused("unauthorized", f"push for worker {w} without its membership token")
        if coord.stop:
            return True
        expected = coord.expected(w, t)
        if expected is None:
            if self.server.policy.plans_rounds and t < coord.iteration:
                return True  # its iteration is closed
            raise Refused("not_planned", f"no assignment of worker {w} for iteration {t}")
        if expected != x:
            raise Refused("bad_batch", f"worker {w} was assigned {expected} samples for "
                                       f"iteration {t}, the push says {x}")
        return False

    def accepted_push(self, msg: P.Push) -> None:
        self.coord.record_report(WorkerReport.received(
            msg.worker_id, msg.iteration, msg.batch_size, msg.telemetry or _NOT_MEASURED), msg.loss)
        self.coord.on_gradient(0, msg.worker_id, msg.iteration, msg.batch_size)

    def check_pull_token(self, worker_id: int, token: str) -> None:
        self._member(worker_id, token)

    def assignment(self, p: PendingPull) -> P.Error | P.Assignment | None:
        """What a worker's answered pull carries: its assignment, an Error, or None to wait."""
        coord = self.coord
        if p.worker_id not in coord.members:
            return P.Error(code="unknown_worker", message=f"worker {p.worker_id} is not a member")
        key = self.server.policy.assignment_key(self.server.state.version, p.min_version)
        return coord.assignment(p.worker_id, key)

    def answered(self, p: PendingPull, reply: P.Message) -> None:
        if p.worker_id >= 0 and isinstance(reply, P.Params):
            if reply.stop:
                self.coord.told_stop(p.worker_id)
            elif reply.assignment is not None:
                self.coord.assignment_answered(p.worker_id, reply.assignment.iteration)

    def status(self) -> dict[str, Any]:
        c = self.coord
        return dict(iterations=c.iterations_done(), epoch=c.cursor.epoch, samples=c.cursor.state.samples_served,
                    workers=len(c.members), stop=c.stop, stop_reason=c.stop_reason, started=c.started,
                    elapsed=c.elapsed(), last_accuracy=c.last_accuracy)

    def shutdown(self, reason: str) -> P.Message | None:
        """The operator ends the job by the normal stop: one final version on every shard."""
        if self.server.finished:
            return None
        self.coord.request_stop(f"operator shutdown: {reason}")
        self.advance()
        return P.Ack(what="shutdown")

    def after_messages(self) -> None:
        self.advance()
        # at once, not at the next tick: an evaluator told eval_final_done has exited, and a
        # rollback in between would wait for a final measurement nobody takes
        if self._everyone_knows():
            self.server.finish("every worker and the evaluator have the final version")

    def _everyone_knows(self) -> bool:
        """The stop is announced, and every worker and the evaluator have the final version."""
        return self.coord.stop and self.stop_announced and self.coord.everyone_knows_stop()

    def tick(self, now: float) -> None:
        """Liveness, the wall-clock stop, checkpoint orders, the end of the job."""
        coord, server = self.coord, self.server
        stall = fault("coordinator_stall")
        if stall and not self._stall_done and server.state.version >= int(stall["version"]):
            self._stall_done = True
            log.warning("fault injection: coordinator loop stalls %.1fs", float(stall["seconds"]))
            time.sleep(float(stall["seconds"]))
            return  # heartbeats queued during the stall are read before anyone is judged
        if coord.started and not coord.stop and not server.router.pending():
            for w in coord.silent_workers(self.cfg.heartbeat.timeout_s):
                self.remove_worker(w, f"lost (silent for more than {self.cfg.heartbeat.timeout_s}s)")
        if coord.check_pause():  # the evaluator never reported: the waiting workers go on
            server.pulls_changed()
        if coord.check_time():
            self.advance()
        self._explain_long_waits(now)
        ck = self.cfg.checkpoint
        if (ck.every_seconds and coord.started and not coord.stop
                and now - server.last_checkpoint_time >= ck.every_seconds):
            self.checkpoint_next_commit = True
        if self._everyone_knows():
            server.finish("every worker and the evaluator have the final version")
        elif coord.stop and self.stop_announced and now - self.stop_time > self.cfg.training.finish_timeout_s:
            server.finish(f"finish_timeout_s={self.cfg.training.finish_timeout_s} passed")

    def _explain_long_waits(self, now: float) -> None:
        """A member's pull unanswered for longer than the heartbeat timeout is logged once, with
        why it waits: a worker that times out on it later leaves a trace of the cause here."""
        server = self.server
        patience = max(self.cfg.heartbeat.timeout_s, self.cfg.transport.timeout_s / 4)
        for p in server.pulls.waiting_longer_than(patience, now):
            if p.worker_id < 0:
                continue
            version = server.state.version
            if server.policy.plans_rounds and version < p.min_version:
                why = f"the shard is at version {version}"
            else:
                key = server.policy.assignment_key(version, p.min_version)
                why = self.coord.waiting_reason(p.worker_id, key, version)
            log.warning("worker %d's pull (min_version %d) has waited %.1fs: %s", p.worker_id, p.min_version,
                        now - p.since, why)

    def finishing(self, reason: str) -> None:
        self.followers.broadcast(P.Finish(reason=reason))

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"coordinator": self.coord.state_dict(), "rollback_epoch": self.rollback_epoch,
                "shard_endpoints": {str(k): ep for k, ep in self.shard_endpoints.items()},
                "shard_claims": dict(self.claims)}

    def restored(self, meta: dict) -> None:
        self.coord.load_state_dict(meta["coordinator"])
        # A resumed shard 0 gives each named dmlc server the index it had (older checkpoints:
        # none); after an in-process rollback, claims made since the checkpoint stand.
        S = self.cfg.cluster.num_shards
        for name, k in meta.get("shard_claims", {}).items():
            if str(name) not in self.claims and 0 < int(k) < S and int(k) not in self.claims.values():
                self.claims[str(name)] = int(k)
        self.server.incarnation = os.urandom(6).hex()  # workers notice and join again
        self.stop_announced = False
        self._clocks_sent = None
        self.followers.clear_log()

    def resumed(self, meta: dict) -> None:
        """A restarted shard 0: move the followers back to its version and to its new address."""
        from ps_common.transport import Connection

        # Count on above the numbers the previous process saved, even where the clock went back.
        self.rollback_epoch = max(self.rollback_epoch, int(meta.get("rollback_epoch", 0)) + 1)
        server = self.server
        for k, ep in meta.get("shard_endpoints", {}).items():
            if int(k) == 0:
                continue
            conn = Connection(server.ctx, ep, role="shard", security=self.cfg.security,
                              timeout_s=server.timeouts.rollback_send_s)
            try:
                conn.request(P.Rollback(version=server.state.version, coordinator=server.endpoint,
                                        log_hash=server.state.log_hash),
                             P.Ack, timeout_s=server.timeouts.rollback_reply_s)
            except Exception as exc:  # a follower that is gone registers when it is back
                log.warning("shard %s at %s not told to roll back: %s", k, ep, exc)
            finally:
                conn.close()

    def close(self) -> None:
        # What the coordinator refused or discarded along the way (have.unexpected, ...).
        self.metrics.write(event="counters", counters=dict(self.coord.counters))
        self.metrics.close()

    # ----- membership -------------------------------------------------------------------------
    def _check_digest(self, digest: str) -> None:
        if not hmac.compare_digest(digest, self.server.job_digest):
            raise Refused("config_mismatch",
                          f"job config digest {digest!r} differs from the server's {self.server.job_digest}: "
                          "start every process of a job with the same model/data/optimizer/"
                          "training/mode settings")

    def _on_join(self, ident: bytes, role: str, msg: P.Join) -> None:
        self._check_digest(msg.job_digest)
        for what, text in (("name", msg.name), ("instance", msg.instance), ("device", msg.device)):
            if len(text) > MAX_TEXT:
                raise Refused("bad_join", f"a worker's {what} has at most {MAX_TEXT} characters")
        if len(self.pending_joins) >= MAX_PENDING_JOINS:
            raise Refused("busy", "too many joins are waiting for the shards to register")
        self.pending_joins.append((ident, role, msg))
        self._admit_joins()
        return None

    def _admit_joins(self) -> None:
        """Answer joins once every shard has registered (a Welcome lists all endpoints)."""
        coord, server = self.coord, self.server
        if not self.pending_joins or len(self.shard_endpoints) < self.cfg.cluster.num_shards:
            return
        policy = server.policy
        for ident, role, join in self.pending_joins:
            try:
                wid = (coord.join(join.name, join.instance, join.device, max(0, join.memory_fits),
                                  max(0, join.memory_fails)) if role == "worker" else -1)
            except JoinRefused as exc:
                log.warning("join of %r refused: %s", join.name, exc)
                server.router_reply(ident, P.Error(code=exc.code, message=str(exc)))
                continue
            version = server.state.version
            if wid >= 0:  # ids follow join order: the records say which name each one is
                self.metrics.write(event="worker_joined", worker=wid, name=join.name, device=join.device,
                                   live=coord.live(), version=version)
            start = policy.assignment_key(version, coord.clock_of(wid)) if wid >= 0 else version
            if wid >= 0:
                token = coord.token(wid)
            else:
                token = coord.evaluator_joined() if role == "evaluator" else ""
            server.router_reply(ident, P.Welcome(
                worker_id=wid,
                shard_endpoints=[self.shard_endpoints[k] for k in range(self.cfg.cluster.num_shards)],
                shard_ranges=[list(r) for r in server.ranges], num_params=server.num_params,
                version=start, job=self.cfg.job_spec(), token=token,
                consistent_pulls=policy.consistent_pulls))
        self.pending_joins = []
        self._tell_clocks()   # a join into an empty job lowers the slowest clock: before any commit
        self._announce_plan(coord.try_start())
        server.pulls_changed()  # the job may have started: waiting first pulls get assignments

    def _member(self, worker_id: int, token: str) -> Coordinator:
        coord = self.coord
        if worker_id not in coord.members:
            raise Refused("unknown_worker", f"worker {worker_id} is not a member (declared lost?)")
        if not coord.token_ok(worker_id, token):
            raise Refused("unauthorized", f"worker {worker_id}'s membership token is wrong")
        return coord

    def _on_heartbeat(self, ident: bytes, role: str, msg: P.Heartbeat) -> P.Message:
        coord = self._member(msg.worker_id, msg.token)
        coord.heard_from(msg.worker_id)
        return P.HeartbeatReply(incarnation=self.server.incarnation, version=self.server.state.version,
                                stop=coord.stop)

    def _on_out_of_memory(self, ident: bytes, role: str, msg: P.OutOfMemory) -> P.Message:
        coord = self._member(msg.worker_id, msg.token)
        coord.heard_from(msg.worker_id)
        try:
            a = coord.out_of_memory(msg.worker_id, msg.iteration, msg.batch_size)
        except NotReassigned as exc:
            raise Refused(exc.code, str(exc)) from None
        return P.Reassignment(assignment=a)

    def _on_take_chunk(self, ident: bytes, role: str, msg: P.TakeChunk) -> P.Message:
        coord = self._member(msg.worker_id, msg.token)
        coord.heard_from(msg.worker_id)
        try:
            return coord.take_chunk(msg.worker_id, msg.iteration)
        except NotReassigned as exc:
            raise Refused(exc.code, str(exc)) from None

    def _on_leave(self, ident: bytes, role: str, msg: P.Leave) -> P.Message:
        self._member(msg.worker_id, msg.token)
        reason = msg.reason[:MAX_TEXT] or "no reason given"   # it goes into the log and the records
        self.remove_worker(msg.worker_id, f"left ({reason})")
        return P.Ack(what="leave")

    def remove_worker(self, worker_id: int, reason: str) -> None:
        coord = self.coord
        if coord.leave(worker_id, reason):    # a worker gone already: no second event
            self.metrics.write(event="worker_removed", worker=worker_id, reason=reason,
                               live=coord.live(), version=self.server.state.version)
        self.server.pulls_changed()  # e.g. SSP: nobody waits for the departed worker's clock any more
        self.advance()
        self._announce_plan(coord.try_start())

    def _on_eval(self, ident: bytes, role: str, msg: P.EvalReport) -> P.Message:
        """A measurement: it ends a pause and may stop the job at the target accuracy, so only
        one evaluator's count (its Welcome's token, :meth:`Coordinator.evaluator_reports`): an
        earlier one is refused ``superseded`` and ends, a token this process never gave (shard 0
        restarted) is refused ``unknown_evaluator`` and its evaluator joins again. One of a version not reached
        (measured just before a rollback below it), with an accuracy no measurement gives, or
        of a history a rollback abandoned (its log hash is not this history's at that version)
        is acknowledged and set aside: it counts for nothing, and the evaluator goes on."""
        coord, st = self.coord, self.server.state
        who = coord.evaluator_reports(msg.token)
        if who == "superseded":
            coord.count("eval.superseded")
            raise Refused("superseded", "an evaluator that joined after this one reports now: its reports count")
        if who != "current":
            raise Refused("unknown_evaluator", "no evaluator joined with this token here: join again")
        if not (math.isfinite(msg.accuracy) and 0.0 <= msg.accuracy <= 1.0):
            return self._set_aside(msg, "eval.bad_accuracy", f"an accuracy of {msg.accuracy}", last_anyway=True)
        if not 0 <= msg.version <= st.version:   # e.g. measured just before a rollback below it
            return self._set_aside(msg, "eval.not_reached", f"a measurement of version {msg.version}, "
                                                       f"not reached (the job is at {st.version})")
        known = st.log_hash if msg.version == st.version else self.followers.hash_of(msg.version)
        if known is None:               # older than the commit log: the kept snapshot's, if any
            snap = st.snapshot_at(msg.version)
            known = snap.log_hash if snap is not None else None
        if msg.log_hash and known is not None and msg.log_hash != known:
            return self._set_aside(msg, "eval.other_history", f"a measurement of version {msg.version} of "
                                                         f"another history ({msg.log_hash}, this one's {known})")
        if coord.on_eval(msg.accuracy, final=msg.final, version=msg.version):
            self.server.pulls_changed()  # the pause for this version ends: answer the workers
        # Kept with the coordinator's records, so shard 0's run directory alone gives the whole
        # summary of a job whose processes ran on other hosts (ps-summary).
        self.metrics.write(event="eval", version=msg.version, samples=msg.samples, accuracy=msg.accuracy,
                           loss=msg.loss, final=msg.final)
        t = self.cfg.training.target_accuracy
        if t is not None and msg.accuracy >= t:
            coord.request_stop(f"reached target_accuracy={t} (version {msg.version})")
        return self._eval_ack(msg)

    def _eval_ack(self, msg: P.EvalReport) -> P.Ack:
        """``eval_final_done`` when shard 0 finishes on this final report, so the evaluator may
        exit; otherwise a rollback may still come before every worker knows the stop, and the
        evaluator stays to measure the new history's final version."""
        return P.Ack(what="eval_final_done" if msg.final and self._everyone_knows() else "eval_report")

    def _set_aside(self, msg: P.EvalReport, counter: str, what: str, *, last_anyway: bool = False) -> P.Message:
        """A report that must not count, acknowledged all the same: the evaluator goes on (it
        meets this after a rollback), and a forger learns nothing. A final one still ends the
        wait for the evaluator at the stop with ``last_anyway`` (an accuracy no measurement
        gives: it would only measure the same again); one of another history or a version not
        reached does not: the evaluator, staying after its final report, measures this
        history's final version."""
        if msg.final and last_anyway:
            self.coord.evaluator_done = True
        self.coord.count(counter)
        n = self.coord.counters[counter]
        if worth_logging(n, 20):
            log.warning("evaluator report set aside: %s (%d so far)", what, n)
        return self._eval_ack(msg)

    # ----- commits ----------------------------------------------------------------------------
    def advance(self) -> None:
        """Carry out the commits the coordinator decided, then announce a stop."""
        coord, server = self.coord, self.server
        tm = server.router.timings
        decided = []
        t0 = time.perf_counter()
        while next_ := coord.decide():
            t0 = tm.since("decide", t0)
            decided.append(self._commit(next_[0]))
            t0 = tm.since("commit", t0)
        if coord.stop and not self.stop_announced:
            self.stop_announced = True
            self.stop_time = time.monotonic()
            self.followers.broadcast(P.Stop(version=coord.stop_version, reason=coord.stop_reason))
            server.state.drop_all()
            self.metrics.write(event="stop", version=coord.stop_version, reason=coord.stop_reason)
            server.pulls_changed()
        if decided:
            t0 = time.perf_counter()
            server.serve_pulls()  # answer the workers before writing anything down
            t0 = tm.since("answer", t0)
            for d in decided:
                self._log_commit(d)
            tm.since("write_down", t0)
        self._tell_clocks()
        for ev in coord.drain_events():
            self.metrics.write(**ev)
        if not server.router.pending():
            t0 = time.perf_counter()
            coord.background_work()  # the batch policy, after the workers have their answers
            tm.since("background", t0)

    def _tell_clocks(self, shard: int | None = None) -> None:
        """SSP: tell the followers (or one, ``shard``, whatever it was told) the slowest live
        worker's committed clock at this version when it changed since the last commit or
        ``Clocks``: when the slowest worker left (nothing else would release the answers they
        hold for it), or workers joined an empty job."""
        if not self.server.policy.gates_reads:
            return
        slowest = self.coord.slowest_clock()
        msg = P.Clocks(version=self.server.state.version, slowest_clock=slowest)
        if shard is not None:
            self.followers.send(shard, msg)
        elif slowest != self._clocks_sent:
            self._clocks_sent = slowest
            self.followers.broadcast(msg)

    def _commit(self, d: CommitDecision) -> CommitDecision:
        server = self.server
        st = server.state
        ck = self.cfg.checkpoint
        d.checkpoint = self.checkpoint_next_commit or bool(ck.every_iterations and d.version % ck.every_iterations == 0)
        self.checkpoint_next_commit = False
        slowest = 0
        if server.policy.gates_reads:      # the clocks after this commit (decide() moved them)
            slowest = self._clocks_sent = self.coord.slowest_clock()
        msg = P.Commit(version=d.version, iteration=d.iteration, entries=d.entries, lr_scale=d.lr_scale,
                       drops=d.drops, next_plan=d.next_plan, checkpoint=d.checkpoint,
                       log_hash=next_log_hash(st.log_hash, d.version, d.iteration, d.entries, d.lr_scale),
                       slowest_clock=slowest)
        st.check_holds(d.iteration, d.entries)  # never send a commit this shard cannot apply
        self.followers.broadcast(msg, prev_hash=st.log_hash)  # first: the followers apply in parallel with us
        applied = st.apply(d.iteration, d.entries, d.lr_scale)
        if applied.version != d.version or applied.log_hash != msg.log_hash:
            raise RuntimeError(f"coordinator state out of step: applied {applied.version}/{applied.log_hash}, "
                               f"decided {d.version}/{msg.log_hash}")
        st.drop(d.drops)
        if server.policy.plans_rounds:  # the commit closes its iteration
            st.drop_through(d.iteration)
        if d.checkpoint:
            server.write_checkpoint()
        server.pulls_changed()
        return d

    def _log_commit(self, d: CommitDecision) -> None:
        coord, server = self.coord, self.server
        rec = d.record
        server.metrics.write(version=d.version, iteration=d.iteration, entries=d.entries, lr_scale=d.lr_scale,
                             samples=sum(x for _, x in d.entries))
        self.metrics.write(
            iteration=rec.iteration, version=rec.version, elapsed=rec.elapsed, duration=rec.duration,
            loss=rec.loss, epoch=rec.epoch, samples=rec.samples, applied_samples=rec.applied_samples,
            accepted=rec.accepted, batch_sizes={str(k): v for k, v in rec.batch_sizes.items()},
            ranges={str(k): v for k, v in rec.ranges.items()},
            workers={str(r.worker_id): r.telemetry.to_dict() for r in rec.reports},
            dropped=server.state.dropped, drops=d.drops, stop=coord.stop, stop_reason=coord.stop_reason,
            decision_s=coord.manager.last_decision_s, decision_cpu_s=coord.manager.last_decision_cpu_s,
            **({} if rec.helped_samples is None else {"helped_samples": rec.helped_samples}),
            **({"paused_s": rec.paused_s, "paused_total_s": rec.paused_total_s} if coord.pause.enabled else {}))

    def _announce_plan(self, plan: P.Plan | None) -> None:
        if plan is not None:
            self.followers.broadcast(P.PlanMessage(plan=plan))
            self.server.pulls_changed()

    # ----- the follower shards ----------------------------------------------------------------
    def _on_claim_shard(self, ident: bytes, role: str, msg: P.ClaimShard) -> P.Message:
        """The lowest follower index nobody has registered or claimed; the same instance asking
        again gets the same one: its answer was lost, or it is a server restarted under the same
        ``--name`` (the claims are in shard 0's checkpoints, so a resumed shard 0 keeps them)."""
        self._check_digest(msg.job_digest)
        if not msg.instance:
            raise Refused("malformed", "a shard claim needs its process's instance id")
        k = self.claims.get(msg.instance)
        if k is None:
            taken = set(self.shard_endpoints) | set(self.claims.values())
            free = [i for i in range(1, self.cfg.cluster.num_shards) if i not in taken]
            if not free:
                raise Refused("no_free_shard", f"all {self.cfg.cluster.num_shards - 1} follower shards are "
                                               "claimed or registered")
            if len(self.claims) >= 4 * self.cfg.cluster.num_shards:
                raise Refused("busy", "too many shard claims")
            k = self.claims[msg.instance] = free[0]
            log.info("shard index %d claimed by %s", k, msg.instance)
        return P.ShardClaimed(shard=k)

    def _on_register_shard(self, ident: bytes, role: str, msg: P.RegisterShard) -> None:
        coord, server = self.coord, self.server
        self._check_digest(msg.job_digest)
        if not 0 < msg.shard < self.cfg.cluster.num_shards:
            raise Refused("bad_shard", f"shard index {msg.shard} out of range")
        peer = self.followers.peers.get(msg.shard)
        if msg.registration and peer is not None and peer.registration == msg.registration:
            return self._registration_retried(ident, peer)
        own = server.state.version
        target = None
        if msg.version != own and not msg.resumed:
            if not (server.resumed and msg.version > own):
                raise Refused("needs_resume",
                              f"shard {msg.shard} is at version {msg.version} but the job is at {own}: "
                              "restart a shard of a running job with --resume")
            # This shard 0 resumed from a checkpoint that a follower which kept running is past
            # (its Rollback request did not reach it): the follower goes back to it too.
            target = own
        elif msg.resumed or msg.log_hash != server.state.log_hash:
            # Even at the same version the restarted shard lost the gradients it held: everyone
            # goes back to a checkpoint they all have, of one history (a follower that crashed
            # before a rollback reached it may hold the abandoned history's files), and the
            # workers join again. So does a follower at the job's version with another history
            # (one that missed a Rollback and registers with a restarted shard 0).
            if len(msg.checkpoint_versions) != len(msg.checkpoint_hashes):
                raise Refused("bad_request", "checkpoint_versions and checkpoint_hashes differ in length")
            theirs = dict(zip(msg.checkpoint_versions, msg.checkpoint_hashes))
            common = self._common_checkpoints(min(own, msg.version), theirs)
            if common is None:
                raise Refused("no_checkpoints", "the coordinator keeps no checkpoints to roll back to")
            if not common:
                raise Refused("no_common_checkpoint",
                              f"shard 0 has no checkpoint at or before version {msg.version} of the history "
                              f"shard {msg.shard}'s checkpoints hold ({sorted(theirs)})")
            target = common[-1]
            why = "resumed from" if msg.resumed else "holds another history at"
            self.rollback_all(target, f"shard {msg.shard} {why} version {msg.version}")
        self.shard_endpoints[msg.shard] = msg.endpoint
        self.followers.register(msg.shard, ident, msg.endpoint, msg.version, self.rollback_epoch,
                                registration=msg.registration, answered_version=server.state.version)
        log.info("shard %d registered at %s (version %d)", msg.shard, msg.endpoint, msg.version)
        self.metrics.write(event="shard_registered", shard=msg.shard, endpoint=msg.endpoint,
                           version=msg.version, resumed=msg.resumed)
        self._answer_registration(ident, self.followers.peers[msg.shard])
        self._tell_clocks(msg.shard)
        if target is not None and (target != msg.version or msg.log_hash != server.state.log_hash):
            # after the reply it waits for; at its own version too where the history it holds in
            # memory is not the one its checkpoint there (and shard 0's) has
            self._order_rollback(target, [msg.shard])
        if not msg.resumed:   # after the reply: what removing them commits goes to this shard too
            for w in coord.shard_started_empty(msg.shard):
                self.remove_worker(w, f"its gradient was on shard {msg.shard}, which started again empty")
        self._admit_joins()
        return None

    def _answer_registration(self, ident: bytes, peer: Follower) -> None:
        """``Registered``, with the version and epoch recorded when ``peer`` registered."""
        coord, server = self.coord, self.server
        server.router_reply(ident, P.Registered(member_key=coord.member_key, incarnation=server.incarnation,
                                                version=peer.answered_version, plan=coord.current_plan(),
                                                stop_version=coord.stop_version, rollback_epoch=peer.epoch_floor))

    def _registration_retried(self, ident: bytes, peer: Follower) -> None:
        """The follower sent its registration again (on a new connection) before our answer to
        its first attempt reached it: handled twice, a resumed one would roll the job back twice.
        It gets the same answer again (the version and epoch of the first: the follower judges by
        the version whether it is at the job's), and the Rollback sent to it since (lost with the
        old connection); commits since, its beats catch up."""
        log.info("shard %d's registration again (a retry): answered again", peer.shard)
        self.coord.count("register.retry")
        if not peer.heard:   # else an attempt left queued behind its retry: the follower is on peer.ident
            peer.ident = ident
        self._answer_registration(ident, peer)
        self._tell_clocks(peer.shard)
        if peer.rollback is not None:
            self.followers.send(peer.shard, peer.rollback)
        return None

    def _follower(self, ident: bytes, shard: int, version: int | None = None) -> Follower:
        peer = self.followers.seen(shard, ident, version)
        if peer is None:
            raise Refused("unregistered", f"shard {shard} has not registered")
        return peer

    def _on_have(self, ident: bytes, role: str, msg: P.Have) -> None:
        if self.followers.behind(msg.shard, msg.rollback_epoch):
            self.coord.count("have.behind_rollback")
            return None   # held before the Rollback it has not applied yet, which drops them
        self._follower(ident, msg.shard)
        for e in msg.entries:
            if len(e) == 3:
                self.coord.on_gradient(msg.shard, e[0], e[1], e[2])
        return None

    def _on_shard_sync(self, ident: bytes, role: str, msg: P.ShardSync) -> None:
        """A follower's beat: catch it up, or roll it back when its history differs."""
        coord, st = self.coord, self.server.state
        behind = self.followers.behind(msg.shard, msg.rollback_epoch)
        if behind is not None:
            self._behind_rollback(ident, behind)   # before seen(): its connection may be a dead one
            return None
        self._follower(ident, msg.shard, msg.version).behind_since = None
        if msg.version < st.version:
            missing = self.followers.commits_after(msg.version)
            if missing is None:
                self._realign(msg.shard, msg.version, "too far behind to catch up")
                return None
            for c in missing:
                self.followers.send(msg.shard, c)
            if self.followers.hash_of(msg.version) == msg.log_hash:
                # only behind (commits in flight), on this history: what it holds counts. Before
                # 2026-11-28 only a beat at shard 0's version did, so under ASP, where a
                # follower is rarely there, a lost Have left its gradient incomplete until the
                # worker's transport timeout
                self._credit_holds(msg, behind=True)
        elif msg.version > st.version:
            self._realign(msg.shard, msg.version, "ahead of the coordinator")
            return None
        elif msg.log_hash != st.log_hash:
            self._realign(msg.shard, msg.version, f"history differs ({msg.log_hash} vs {st.log_hash})")
            return None
        else:
            self._credit_holds(msg, behind=False)
        plan = coord.current_plan()
        if plan is not None:
            self.followers.send(msg.shard, P.PlanMessage(plan=plan))
        self._tell_clocks(msg.shard)   # after the commits it missed: it applies it at our version
        if coord.stop:
            self.followers.send(msg.shard, P.Stop(version=coord.stop_version, reason=coord.stop_reason))
        return None

    def _credit_holds(self, msg: P.ShardSync, behind: bool) -> None:
        """The gradients a follower's beat says it holds, as if its ``Have`` had said so (a
        lost one is repaired). A follower ``behind`` still holds gradients this shard 0 has
        committed since: those are skipped, not counted as unexpected (and dropped)."""
        coord = self.coord
        for e in msg.entries:
            if len(e) != 3:
                continue
            w, it, x = e
            if behind and (w, it) not in coord.ledger and coord.expected(w, it) is None:
                continue
            coord.on_gradient(msg.shard, w, it, x)

    def _behind_rollback(self, ident: bytes, peer: Follower) -> None:
        """A beat sent before the follower applied the last Rollback sent to it (or queued for a
        previous shard 0): its version and hash are an abandoned history's, so it is neither
        caught up nor taken for a follower ahead (which would roll the job back again); the
        follower applies the Rollback next, as the link keeps order. Beats that stay behind for
        two sync periods mean the Rollback was lost with a dropped connection: it is sent again,
        to the connection the beat came on (a repeat the follower has applied, it ignores)."""
        now = time.monotonic()
        if peer.behind_since is None:
            peer.behind_since = now
        elif now - peer.behind_since > 2 * self.cfg.transport.shard_sync_s and peer.rollback is not None:
            log.warning("shard %d has not applied rollback %d: sending it again", peer.shard, peer.rollback.epoch)
            if not self.server.router_reply(ident, peer.rollback):
                self.followers.undelivered += 1
            peer.behind_since = now

    def _order_rollback(self, version: int, shards: list[int]) -> None:
        """Send these followers back to ``version`` (shard 0's state is there now), under a new
        epoch: each Rollback a follower receives is newer than the last it applied, or a repeat."""
        self.rollback_epoch += 1
        msg = P.Rollback(version=version, log_hash=self.server.state.log_hash, epoch=self.rollback_epoch)
        for k in shards:
            peer = self.followers.peers.get(k)
            if peer is not None:
                peer.rollback, peer.behind_since = msg, None
                self.followers.send(k, msg)

    def _common_checkpoints(self, at_most: int, theirs: dict[int, str] | None = None) -> list[int] | None:
        """Shard 0's checkpoint versions up to ``at_most``; with ``theirs`` (a follower's
        version -> log hash) only those the follower holds of the same history."""
        server = self.server
        if server.checkpoint_dir is None:
            return None
        if server.checkpointer is not None:
            server.checkpointer.flush()
        return [v for v, h in checkpoint_hashes(server.checkpoint_dir, 0)
                if v <= at_most and (theirs is None or (h != "" and theirs.get(v) == h))]

    def _realign(self, shard: int, version: int, why: str) -> None:
        """A follower whose history cannot be replayed: everyone back to a common checkpoint."""
        log.error("shard %d at version %d: %s", shard, version, why)
        common = self._common_checkpoints(min(version, self.server.state.version))
        if not common:
            self.coord.request_stop(f"shard {shard} diverged ({why}) and no checkpoint is common")
            self.advance()
            return
        self.rollback_all(common[-1], f"shard {shard} {why}")

    def rollback_all(self, version: int, reason: str) -> None:
        log.warning("rolling the job back to version %d: %s", version, reason)
        self.server.restore(version)
        self.metrics.write(event="rollback", version=version, reason=reason)
        self._order_rollback(version, list(self.followers.peers))
