"""A follower shard's part of the server: hold what workers push, apply what shard 0 commits.

A follower decides nothing. It checks each push against the plan the coordinator committed
(worker, membership token, iteration, batch size), holds the gradient and reports it (``Have``).
Down its link to the coordinator come the commits, in order; it applies each one, checks that
its history (log hash) is the coordinator's, and answers the workers waiting for that version.
A gap in versions, or a second without news, makes it send a ``ShardSync`` so nothing lost on
the way stays lost.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from ps_common import protocol as P
from ps_common.faults import fault
from ps_common.transport import RemoteError
from ps_server.checkpoint import CheckpointError, checkpoint_hashes
from ps_server.control import CoordinatorLink
from ps_server.coordinator import member_token
from ps_server.pulls import PendingPull
from ps_server.router import Refused
from ps_server.shard import MissingGradient

if TYPE_CHECKING:
    from ps_server.server import ShardServer

log = logging.getLogger(__name__)


#: Rollbacks in a row a follower answers by registering again as resumed before it gives up: each
#: round takes the job back to an older checkpoint, so several followers out of step at once
#: (each sent to a version the others' files do not hold) settle within a few rounds.
MAX_RECOVERIES = 3


class Follow:
    """The role of shard k > 0."""


    def __init__(self, server: "ShardServer", coordinator: str) -> None:
        self.server = server
        self.cfg = server.cfg
        self.coordinator_endpoint = coordinator
        self.link: CoordinatorLink | None = None
        self.member_key = ""
        self.plan: P.Plan | None = None
        self.last_iteration = -1  # round modes: the last committed iteration
        self.stop_version = -1
        self._stop_reason = ""
        self.haves: list[list[int]] = []
        self.next_sync = 0.0
        self.rollback_epoch = 0   # the number of the last Rollback applied here, or of the registration
        self.relink_to: str | None = None
        #: this process started from a checkpoint and has not yet been brought to the job's
        #: version: its registration says ``resumed`` (the gradients it held are gone), which
        #: rolls the job back. Once at the job's version (a registration at it, or an applied
        #: Rollback) nothing is missing, and registering again (shard 0 restarted) must not roll
        #: the job back a second time.
        self.lost_state = False
        #: Rollbacks in a row that found no checkpoint of shard 0's history here, each answered by
        #: registering again as resumed (so shard 0 picks one this shard holds); a restore that
        #: succeeds resets it, and one more than MAX_RECOVERIES stops this shard
        self.failed_rollbacks = 0
        #: SSP: the slowest live worker's committed clock at this version, as shard 0's last
        #: commit or ``Clocks`` said (0 until one does, after registering and after the job
        #: went back: holding is the safe side)
        self.slowest_clock = 0
        delay = fault("plan_delay")
        self._plan_delay_s = float(delay["seconds"]) if delay and int(delay["shard"]) == server.shard_id else 0.0
        self._delayed_plans: list[tuple[float, P.Plan]] = []  # (due, plan) under the plan_delay fault
        lost = fault("drop_have")
        self._lost_have = ((int(lost["worker"]), int(lost["iteration"]))
                           if lost and int(lost["shard"]) == server.shard_id else None)

    # ----- the hooks the server calls ---------------------------------------------------------
    def handlers(self) -> dict[type, Any]:
        return {P.Rollback: self._on_rollback}

    def link_socket(self) -> zmq.Socket | None:
        if self.relink_to is not None:
            endpoint, self.relink_to = self.relink_to, None
            try:
                self.connect(endpoint)
            except (RemoteError, RuntimeError) as exc:   # refused, or no answer in time
                self.server.fail(f"registering again with shard 0 failed: {exc}")
        return self.link.sock if self.link is not None else None

    def start(self) -> None:
        self.connect(self.coordinator_endpoint)

    def stopped(self) -> bool:
        return self.stop_version >= 0 and self.server.state.version >= self.stop_version

    def stop_reason(self) -> str:
        return self._stop_reason

    def _token_ok(self, worker_id: int, token: str) -> bool:
        return bool(self.member_key) and hmac.compare_digest(member_token(self.member_key, worker_id), token)

    def check_push(self, msg: P.Push) -> bool:
        """Refuse a push this shard must not hold; True for a late one (dropped, not refused)."""
        w, t, x = msg.worker_id, msg.iteration, msg.batch_size
        if not self._token_ok(w, msg.token):
            raise Refused("unauthorized", f"push for worker {w} without its membership token")
        if self.stopped():
            return True
        largest = self.server.largest_batch()
        if not 1 <= x <= largest:
            raise Refused("bad_batch", f"batch size {x} outside 1..{largest}")
        if not self.server.policy.plans_rounds:
            return False  # async: no plan here; the coordinator commits only what matches its assignment
        if t <= self.last_iteration:
            return True
        plan = self.plan
        if plan is None or plan.iteration < t:
            # The plan travels from shard 0 on another connection than the worker's push, and can
            # arrive after it: the worker sends the push again shortly (nothing is held here).
            raise Refused("plan_pending", f"no plan for iteration {t} here yet "
                                          f"(collecting {plan.iteration if plan else 'nothing'})")
        if plan.iteration != t:
            raise Refused("not_planned", f"no plan for iteration {t} here (collecting {plan.iteration})")
        try:
            planned = plan.batch_sizes[plan.workers.index(w)]
        except ValueError:
            raise Refused("not_planned", f"worker {w} is not in iteration {t}'s plan") from None
        largest = self.server.policy.largest_push(planned, plan.total or sum(plan.batch_sizes))
        if x > largest:
            raise Refused("bad_batch", f"worker {w} was planned {planned} samples for iteration {t}, "
                                       f"the push says {x}")
        # Another size than planned: the coordinator shrank the assignment after an out-of-memory
        # error, or (flexrr) granted chunks to others or of others. It does not tell followers, so
        # no push can overtake the news. Held all the same: the coordinator completes a gradient
        # only at the size it granted, so a forged size is never applied.
        return False

    def accepted_push(self, msg: P.Push) -> None:
        if self._lost_have == (msg.worker_id, msg.iteration):     # the drop_have fault, once
            self._lost_have = None
            log.warning("fault drop_have: not announcing worker %d's gradient of iteration %d",
                        msg.worker_id, msg.iteration)
        else:
            self.haves.append([msg.worker_id, msg.iteration, msg.batch_size])

    def check_pull_token(self, worker_id: int, token: str) -> None:
        if not self._token_ok(worker_id, token):
            raise Refused("unauthorized", f"pull for worker {worker_id} without its membership token")

    def answered(self, p: PendingPull, reply: P.Message) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return dict(stop=self.stopped(), stop_reason=self._stop_reason)

    def shutdown(self, reason: str) -> None:
        return None  # an operator's Shutdown to a follower stops this process only

    def after_messages(self) -> None:
        if self._delayed_plans:
            now = time.monotonic()
            due = [plan for t, plan in self._delayed_plans if t <= now]
            self._delayed_plans = [(t, plan) for t, plan in self._delayed_plans if t > now]
            for plan in due:
                self._set_plan(plan)
        if self.haves and self.link is not None:
            self.link.send(P.Have(shard=self.server.shard_id, entries=self.haves, rollback_epoch=self.rollback_epoch))
            self.haves = []

    def tick(self, now: float) -> None:
        if self.link is None:
            return
        if now >= self.next_sync:
            self._send_sync()
        if self.stop_version >= 0 and self.link.silent_s() > self.cfg.transport.timeout_s:
            log.warning("the coordinator is gone after the stop: finishing")
            self.server.finish("coordinator gone after the stop")

    def finishing(self, reason: str) -> None:
        pass

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def restored(self, meta: dict) -> None:
        self._forget_iterations()

    def may_answer(self, p: PendingPull) -> bool:
        """May a worker's pull be answered with this slice now? Under SSP only once the slowest
        worker is within the staleness bound of the clock it asks for: the rule shard 0 holds
        the worker's assignment by, so the slices from every shard are as fresh as shard 0's
        (before 2026-11-28 a follower answered as soon as the worker's own gradient was
        applied, and its slice could miss the slowest worker's latest clock: bound s + 1)."""
        policy = self.server.policy
        return policy.admits(self.slowest_clock, policy.assignment_key(self.server.state.version, p.min_version))

    def _forget_iterations(self) -> None:
        """The job went back: no gradient held before it, nor its plan or stop, counts now."""
        self.slowest_clock = 0
        self.haves = []   # those gradients are dropped: they must not be announced
        self.plan, self.last_iteration = None, -1
        self.stop_version, self._stop_reason = -1, ""
        self._delayed_plans = []

    def resumed(self, meta: dict) -> None:
        self.lost_state = True

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    # ----- the link -----------------------------------------------------------------------------
    def connect(self, endpoint: str) -> None:
        """(Re)register with the coordinator at ``endpoint``; blocks until it answers."""
        server = self.server
        if self.link is not None:
            self.link.close()
        self.link = CoordinatorLink(server.ctx, endpoint, security=self.cfg.security, hwm=self.cfg.transport.hwm,
                                    timeout_s=self.cfg.transport.timeout_s, timeouts=server.timeouts)
        if server.checkpointer is not None:
            server.checkpointer.flush()
        held = checkpoint_hashes(server.checkpoint_dir, server.shard_id) if server.checkpoint_dir else []
        reg = self.link.register(P.RegisterShard(
            shard=server.shard_id, endpoint=server.endpoint, job_digest=server.job_digest,
            version=server.state.version, log_hash=server.state.log_hash, resumed=self.lost_state,
            checkpoint_versions=[v for v, _ in held], checkpoint_hashes=[h for _, h in held],
            registration=os.urandom(8).hex()),
            self.cfg.transport.connect_timeout_s)
        self.member_key = reg.member_key
        self.slowest_clock = 0          # hold until this shard 0 says (a Clocks follows)
        if reg.version == server.state.version:
            # else a Rollback follows, and applying it clears it (at the job's version with
            # another history, one follows all the same, and any later registration is compared)
            self.lost_state = False
        self.rollback_epoch = reg.rollback_epoch
        self.stop_version = reg.stop_version
        self._set_plan(reg.plan)
        self.next_sync = time.monotonic() + self.cfg.transport.shard_sync_s

    def on_link_messages(self) -> None:
        assert self.link is not None
        for msg in self.link.receive():
            if self.relink_to is not None:
                break   # registering again (a restore failed, or shard 0 forgot us): the rest was for the old link
            if isinstance(msg, P.Commit):
                self._apply_commit(msg)
            elif isinstance(msg, P.PlanMessage):
                self._plan_from_link(msg.plan)
            elif isinstance(msg, P.Stop):
                self.stop_version, self._stop_reason = msg.version, msg.reason
                self.server.pulls_changed()
            elif isinstance(msg, P.Clocks):
                # of the version it was sent at: one behind it waits for the commits (and its
                # beat gets the value again), as a slice without them is what the rule forbids
                if msg.version == self.server.state.version:
                    self.slowest_clock = msg.slowest_clock
                    self.server.pulls_changed()
            elif isinstance(msg, P.Rollback):
                # Each Rollback shard 0 sends is newer than the epoch of our registration and of
                # the Rollbacks before it; one that is not is a repeat of one applied already.
                if msg.epoch > self.rollback_epoch and self._rollback(msg):
                    self.rollback_epoch = msg.epoch
            elif isinstance(msg, P.Finish):
                self.server.finish(msg.reason)
            elif isinstance(msg, P.Error) and msg.code == "unregistered":
                # Shard 0 started again at its address and does not know this shard (its
                # Rollback request did not reach us): register again, which rolls us back.
                log.warning("shard 0 does not know this shard (it restarted?): registering again")
                self.relink_to = self.coordinator_endpoint
            elif isinstance(msg, P.Error):
                log.error("the coordinator refused: [%s] %s", msg.code, msg.message)
        st = self.server.state
        if self.stopped() and st.held:
            st.drop_all()

    def _send_sync(self) -> None:
        assert self.link is not None
        st = self.server.state
        self.link.send(P.ShardSync(shard=self.server.shard_id, version=st.version, log_hash=st.log_hash,
                                   entries=st.holds()[:4096], rollback_epoch=self.rollback_epoch))
        self.next_sync = time.monotonic() + self.cfg.transport.shard_sync_s

    def _plan_from_link(self, plan: P.Plan | None) -> None:
        if self._plan_delay_s and plan is not None:
            self._delayed_plans.append((time.monotonic() + self._plan_delay_s, plan))
        else:
            self._set_plan(plan)

    def _set_plan(self, plan: P.Plan | None) -> None:
        if plan is not None and plan.iteration > self.last_iteration and (
                self.plan is None or plan.iteration >= self.plan.iteration):
            self.plan = plan
            self.server.pulls_changed()

    def _apply_commit(self, msg: P.Commit) -> None:
        server = self.server
        st = server.state
        if msg.version <= st.version:
            return  # a repeat sent while catching up
        if msg.version != st.version + 1:
            log.warning("commit %d while at version %d: asking to catch up", msg.version, st.version)
            self._send_sync()
            return
        tm = server.router.timings
        t0 = time.perf_counter()
        try:
            applied = st.apply(msg.iteration, msg.entries, msg.lr_scale)
        except MissingGradient as exc:
            server.fail(f"{exc}; stopping this shard rather than diverge")
            return
        if applied.log_hash != msg.log_hash:
            server.fail(f"history differs from the coordinator's at version {applied.version} "
                        f"({applied.log_hash} vs {msg.log_hash}): stopping")
            return
        st.drop(msg.drops)
        if server.policy.gates_reads:   # SSP: the slowest clock as of this commit
            self.slowest_clock = msg.slowest_clock
        if server.policy.plans_rounds:  # the commit closes its iteration; the next plan rides on it
            self.last_iteration = msg.iteration
            st.drop_through(msg.iteration)
            if self.plan is not None and self.plan.iteration <= msg.iteration:
                self.plan = None
            self._plan_from_link(msg.next_plan)
        server.pulls_changed()
        t0 = tm.since("commit", t0)
        server.serve_pulls()  # answer the workers first
        t0 = tm.since("answer", t0)
        ck = self.cfg.checkpoint
        if msg.checkpoint or (ck.every_iterations and st.version % ck.every_iterations == 0):
            server.write_checkpoint()
        server.metrics.write(version=applied.version, iteration=applied.iteration, entries=applied.entries,
                             lr_scale=msg.lr_scale, samples=applied.samples, log_hash=applied.log_hash)
        tm.since("write_down", t0)

    def _rollback(self, msg: P.Rollback) -> bool:
        """Restore the version ``msg`` names, if this shard's checkpoint there is of shard 0's
        history; where that checkpoint cannot be used (missing, corrupt, of an abandoned
        history) but this shard is at exactly that version of that history, from memory (and it
        writes the checkpoint again): one job-wide rollback, not two. If neither (written before
        a rollback this shard never processed, or found out of step by a beat), nothing changes,
        and it registers again as resumed with the list of its checkpoints: shard 0 then rolls
        the job back to the newest one both hold of one history, or refuses (no such
        checkpoint), which stops this shard, as do more than MAX_RECOVERIES failures in a row."""
        try:
            self.server.restore(msg.version, expect_log_hash=msg.log_hash)
        except CheckpointError as exc:
            if self.server.rewind(msg.version, msg.log_hash):
                log.warning("cannot use the checkpoint the rollback names (%s); this shard is at that very "
                            "version of shard 0's history, so it went back from memory", exc)
                self.server.write_checkpoint()   # and a later resume finds that version readable
                self.lost_state, self.failed_rollbacks = False, 0
                return True
            self.failed_rollbacks += 1
            if self.failed_rollbacks > MAX_RECOVERIES:
                self.server.fail(f"cannot roll back: {exc}; {self.failed_rollbacks} times in a row, stopping "
                                 "this shard to avoid inconsistent parameters")
                return False
            log.error("cannot roll back: %s; registering again as resumed, so that shard 0 picks a "
                      "checkpoint of its history that this shard holds", exc)
            # The job goes back anyway: what this shard holds belongs to the abandoned iterations
            # (a commit names gradients by worker and iteration, not by value).
            self.server.state.drop_all()
            self._forget_iterations()
            self.lost_state = True
            self.relink_to = self.coordinator_endpoint
            return False
        self.lost_state, self.failed_rollbacks = False, 0   # at a version the whole job went back to, holding nothing
        return True

    def _on_rollback(self, ident: bytes, role: str, msg: P.Rollback) -> P.Message:
        """A restarted shard 0 (``--resume``) moves this follower back and to its new address
        (whatever its epoch: the registration that follows gives this shard the new process's)."""
        self._rollback(msg)   # if it cannot, the registration below says resumed
        self.relink_to = msg.coordinator or self.coordinator_endpoint
        self.coordinator_endpoint = self.relink_to
        return P.Ack(what="rollback")
