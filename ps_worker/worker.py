"""A training worker: pull parameters and an assignment, compute a gradient, push it, repeat."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import zmq

from ps_common import protocol as P
from ps_common.cgroup_cpu import CpuQuotaProbe
from ps_common.config import JobConfig
from ps_common.errors import PsError, UsageError
from ps_common.heap import keep_freed_memory
from ps_common.metrics import MetricsWriter, existing_for
from ps_common.protocol import Assignment
from ps_common.report import Telemetry
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts
from ps_common.transport import AuthenticationFailed, RemoteError, TransportTimeout
from ps_ml.datasets import ArrayDataset, dataset_from_config, sample_order
from ps_ml.models import FlatParameters, build_model
from ps_worker.client import REJOIN_CODES, PullAborted, ShardClients
from ps_worker.contention import CommDelay, ContentionDriver, EmulatedSlowdown
from ps_worker.gpu_share import apply_sm_share
from ps_worker.heartbeat import Heartbeat
from ps_worker.memory import MemoryLimit, bound_kernel_cache, choose_cuda_allocator, is_out_of_memory
from ps_worker.scenario_runtime import runtime_for
from ps_worker.telemetry import ResourceProbe

log = logging.getLogger(__name__)

#: Smallest batch a start-up memory probe tries first (then doubles).
PROBE_START = 16


class CannotFitInMemory(PsError, RuntimeError):
    """Not even one sample fits in this worker's memory limit."""


def device_type(name: str) -> str:
    """The type of device ``name`` resolves to, without creating a CUDA context."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def resolve_device(name: str) -> torch.device:
    """The device a worker trains on; a CUDA device always with its index, since torch's memory
    calls (``set_per_process_memory_fraction`` among them) refuse a bare "cuda"."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"worker.device={name!r} but CUDA is not available on this host")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class SampleIndexer:
    """Turns [epoch, start, stop] ranges into sample indices; caches recent epoch orders."""

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n
        self._orders: dict[int, np.ndarray] = {}

    def indices(self, ranges: list[list[int]]) -> np.ndarray:
        """The samples of ``ranges``: refused (:class:`~ps_common.protocol.ProtocolError`) unless every range lies in
        an epoch's order (a negative start would wrap around to other samples silently)."""
        if not ranges:
            raise P.ProtocolError("an assignment with no sample ranges")
        parts = []
        for epoch, a, b in ranges:
            if not (epoch >= 0 and 0 <= a <= b <= self.n):
                raise P.ProtocolError(f"assignment range [{epoch}, {a}, {b}] is not within an epoch "
                                    f"of {self.n} samples")
            order = self._orders.get(epoch)
            if order is None:
                order = sample_order(self.seed, epoch, self.n)
                self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
                self._orders[epoch] = order
            parts.append(order[a:b])
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


class Worker:
    def __init__(self, cfg: JobConfig, server: str, *, name: str | None = None,
                 run_dir: str | Path | None = None, ctx: zmq.Context | None = None,
                 dataset: ArrayDataset | None = None, scenario_index: int | None = None,
                 timeouts: Timeouts = DEFAULT_TIMEOUTS, overwrite: bool = False) -> None:
        self.cfg = cfg
        self.overwrite = overwrite
        self.timeouts = timeouts
        self._jitter = random.Random()  # not the job's seed: workers must not retry in step
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        # The heterogeneity scenario is looked up by the launcher's index (stable across modes),
        # not by the coordinator's worker id (join order is racy).
        self.scenario_index = scenario_index
        # before the CUDA context: MPS and the caching allocator read their settings once
        kind = device_type(cfg.worker.device)
        apply_sm_share(self._sm_percent(), kind)
        if kind == "cuda":
            choose_cuda_allocator()
        self.device = resolve_device(cfg.worker.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.worker.torch_threads)
            bound_kernel_cache()
        self.ctx = ctx or zmq.Context.instance()
        self.client = ShardClients(self.ctx, server, timeout_s=cfg.transport.timeout_s,
                                   connect_timeout_s=cfg.transport.connect_timeout_s,
                                   security=cfg.security, role="worker", hwm=cfg.transport.hwm,
                                   timeouts=timeouts)
        self.data = dataset or dataset_from_config(cfg.data, cfg.run.seed)
        self.model = build_model(cfg.model.name, seed=cfg.run.seed).to(self.device)
        self.flat = FlatParameters(self.model)
        self.host_params = np.empty(self.flat.numel, dtype=np.float32)
        if self.device.type == "cuda":
            self.host_grads = torch.empty(self.flat.numel, dtype=torch.float32).pin_memory().numpy()
        else:
            self.host_grads = self.flat.grads_numpy()
        self.indexer = SampleIndexer(cfg.run.seed, self.data.num_train)
        self.probe = ResourceProbe(str(self.device)).start()
        self.quota_probe = CpuQuotaProbe()
        self.run_dir = Path(run_dir) if run_dir else None
        self.metrics: MetricsWriter | None = None
        self.worker_id = -1
        self._left = False   # this membership said goodbye (set by _leave, cleared by a join)
        self.iterations_done = 0
        self.rejoins = 0
        self.memory = MemoryLimit(self._memory_limit_mb(), self.device)
        if self.memory.limit_mb is None or self.memory.cuda:
            keep_freed_memory()   # a model's worth of bytes in and out every iteration (ps_common.heap)
        self.memory_probe: tuple[int, int] | None = None
        self.oom_retries = 0
        self.contention: ContentionDriver | None = None
        # Round modes need one consistent version from every shard; async modes take each
        # shard's latest slice as it is. The coordinator says which in its Welcome.
        self.consistent = True

    def run(self, max_iterations: int | None = None) -> int:
        """Train until the coordinator says stop; returns the number of iterations done.

        If the coordinator drops this worker (declared lost after a stall) or restarts, the
        worker joins again, with jittered exponential backoff (``timeouts.rejoin``, growing with
        every rejoin) while the coordinator is unreachable. Leaving early (``max_iterations``,
        SIGTERM) tells the coordinator, so no barrier waits.
        """
        try:
            while True:
                welcome = self._join()
                hb = Heartbeat(self.ctx, self.client.server, self.worker_id,
                               self.cfg.heartbeat.interval_s, security=self.cfg.security,
                               token=self.client.token, timeouts=self.timeouts).start()
                try:
                    outcome = self._loop(welcome.version, max_iterations, hb)
                except KeyboardInterrupt:
                    self._leave("interrupted")
                    raise
                except AuthenticationFailed:
                    raise
                except (PullAborted, RemoteError, TransportTimeout) as exc:
                    code = getattr(exc, "code", "")
                    if isinstance(exc, RemoteError) and code not in REJOIN_CODES:
                        self._goodbye(exc)
                        raise
                    backoff = self.timeouts.rejoin.delay(self.rejoins, self._jitter)
                    log.warning("worker %d: %s; joining again in %.2fs", self.worker_id, exc, backoff)
                    outcome = "rejoin"
                except Exception as exc:
                    self._goodbye(exc)
                    raise
                finally:
                    hb.stop()
                if outcome == "leave":
                    self._leave(f"max_iterations={max_iterations}")
                if outcome != "rejoin":
                    return self.iterations_done
                self.rejoins += 1
                self.client.close()
                time.sleep(backoff)
        finally:
            self.probe.stop()
            if self.contention is not None:
                self.contention.stop()
            if self.metrics is not None:
                self.metrics.close()
            self.client.close()

    def _sm_percent(self) -> int | None:
        """The scenario's GPU share for this worker. MPS reads it when the CUDA context is made,
        before the worker joins, so it needs the launcher's index (not the worker id)."""
        if self.scenario_index is None:
            if any(w.gpu_sm_percent is not None for w in self.cfg.scenario.workers):
                raise UsageError("scenario.workers[i].gpu_sm_percent needs the worker's scenario index "
                                 "before it joins: pass --scenario-index (ps-launch does)")
            return None
        return self.cfg.scenario.for_worker(self.scenario_index).gpu_sm_percent

    def _memory_limit_mb(self) -> float | None:
        """The scenario's limit for this worker (when its index is known before joining), else
        ``worker.memory_limit_mb``."""
        if self.scenario_index is not None:
            own = self.cfg.scenario.for_worker(self.scenario_index).memory_limit_mb
            if own is not None:
                return own
        return self.cfg.worker.memory_limit_mb

    def _join(self):
        if (self.cfg.worker.memory_probe and self.memory_probe is None
                and (self.memory.limit_mb is not None or self.device.type == "cuda")):
            self._warm_up_then_limit_memory()
            try:
                self.memory_probe = self._probe_memory()
            finally:
                self.memory.lift()  # threads started before training are not training's
        fits, fails = self.memory_probe or (0, 0)
        welcome = self._join_when_name_is_free(fits, fails)
        self.worker_id = welcome.worker_id
        self._left = False
        try:
            self._joined(welcome)
        except BaseException:  # a member that cannot train leaves at once: no barrier waits for it
            self._leave("it could not start after joining")
            raise
        log.info("worker %d (%s) joined at version %d on %s", self.worker_id, self.name,
                 welcome.version, self.device)
        return welcome

    def _join_when_name_is_free(self, fits: int, fails: int) -> P.Welcome:
        """Join; while a member of another process holds this worker's name (this worker's
        previous process, not yet declared lost), wait for the coordinator to declare it lost
        (its heartbeat timeout) and join again. Past twice that, the name belongs to a worker
        that is alive: a configuration error, raised."""
        deadline = time.monotonic() + 2 * self.cfg.heartbeat.timeout_s + 1.0
        attempt = 0
        while True:
            try:
                return self.client.join(self.name, self.cfg.job_digest(), str(self.device),
                                        memory_fits=fits, memory_fails=fails)
            except RemoteError as exc:
                if exc.code != "name_in_use" or time.monotonic() > deadline:
                    raise
                delay = self.timeouts.name_in_use.delay(attempt, self._jitter)
                log.warning("%s; joining again in %.2fs", exc, delay)
                time.sleep(delay)
                attempt += 1

    def _joined(self, welcome: P.Welcome) -> None:
        """What a new membership needs before training: checks, the scenario, the records."""
        if welcome.num_params != self.flat.numel:
            raise UsageError(f"server has {welcome.num_params} parameters, model has {self.flat.numel}")
        self.consistent = welcome.consistent_pulls
        if self.contention is None:
            idx = self.scenario_index if self.scenario_index is not None else self.worker_id
            self.scenario = runtime_for(self.cfg.scenario, idx)
            if self.memory.limit_mb is None and self.scenario.spec.memory_limit_mb is not None:
                self.memory = MemoryLimit(self.scenario.spec.memory_limit_mb, self.device)
            self.slowdown = EmulatedSlowdown(self.scenario)
            self.contention = ContentionDriver(self.scenario)
            self.client.comm_delay = CommDelay(self.scenario)
            if self.scenario.is_emulated or self.scenario.has_real_load:
                log.info("worker %d scenario: %s", self.worker_id, self.scenario.describe())
        if self.metrics is not None:
            self.metrics.close()
        # Each join is a new id, so a file of that id holds an earlier run's records.
        self.metrics = MetricsWriter(
            self.run_dir / "metrics" / f"worker-{self.worker_id}.jsonl" if self.run_dir else None,
            existing_for(overwrite=self.overwrite))

    def _leave(self, reason: str) -> None:
        self._left = True
        try:
            # Bounded: on SIGTERM or a dead launcher the shards may be gone already, and a
            # goodbye must not keep the process alive for the transport timeout (120 s).
            self.client.send_to_coordinator(
                P.Leave(worker_id=self.worker_id, reason=reason, token=self.client.token), P.Ack,
                timeout_s=min(self.timeouts.leave_s, self.cfg.transport.timeout_s))
        except Exception as exc:  # best effort: the heartbeat timeout covers a failed leave
            log.info("leave not acknowledged: %s", exc)

    def _goodbye(self, exc: BaseException) -> None:
        """A failure that ends this worker: tell the coordinator (unless done already), so that no
        barrier waits for the heartbeat timeout to learn it."""
        if not self._left:
            self._leave(f"failed: {type(exc).__name__}: {str(exc)[:300]}")

    def _abort_reason(self, hb: Heartbeat) -> str | None:
        if hb.dropped:
            return "the coordinator no longer counts this worker as a member"
        if hb.restarted:
            return "the coordinator restarted"
        # A slow coordinator is not a reason to leave (it may be writing a checkpoint, or
        # stalled): only one silent for the whole transport timeout is taken as gone.
        if hb.coordinator_silent_s() > self.cfg.transport.timeout_s:
            return f"no heartbeat reply for {hb.coordinator_silent_s():.1f}s"
        return None

    def _loop(self, version: int, max_iterations: int | None, hb: Heartbeat) -> str:
        """Iterations until stop ("stop"), the iteration budget ("leave")."""
        abort = lambda: self._abort_reason(hb)  # noqa: E731
        res = self.client.pull(self.host_params, worker_id=self.worker_id, min_version=version,
                               consistent=self.consistent, abort=abort)
        self._load_params()
        assert self.contention is not None
        if not self.contention.started:
            self.contention.start()  # the scenario clock starts with training, not start-up
        self._warm_up_then_limit_memory()  # last: every thread of the process is running
        origin = self.contention.origin
        # The previous iteration's communication (the current one's is not known before the push).
        prev = Telemetry(prev_wait_s=res.wait_s, prev_pull_s=res.pull_s)
        cpu_at_report: float | None = None  # process CPU clock when the previous report left
        while not res.stop and res.assignment is not None:
            if max_iterations is not None and self.iterations_done >= max_iterations:
                return "leave"
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            if res.assignment.chunked:
                a, loss, data_s, t1, emulated = self._chunked_gradient(res.assignment, origin)
                mem = Telemetry()
            else:
                a, loss, data_s, t1, mem = self._fitting_gradient(res.assignment)
                # Emulated slowdown: sleep (f - 1) x compute, counted inside the compute phase so
                # every policy (and LB-BSP's predictors) sees it as slower compute.
                emulated = self.slowdown.after_compute(self.iterations_done, time.monotonic() - origin,
                                                       time.perf_counter() - t1)
            t2 = time.perf_counter()
            cpu2 = time.process_time()
            cpu_s = None if cpu_at_report is None else cpu2 - cpu_at_report
            cpu_at_report = cpu2
            quota, throttled = self.quota_probe.read()
            tel = dataclasses.replace(
                self.probe.sample(), data_s=data_s, compute_s=t2 - t1, cpu_quota=quota, throttled_s=throttled,
                cpu_s=cpu_s, compute_cpu_s=cpu2 - cpu0,
                iteration_s=prev.iteration_s, prev_push_s=prev.prev_push_s, prev_wait_s=prev.prev_wait_s,
                prev_pull_s=prev.prev_pull_s, emulated_s=emulated, slowdown=self.slowdown.last_factor,
                burners=self.contention.target, mem_headroom_mb=mem.mem_headroom_mb,
                mem_per_sample_mb=mem.mem_per_sample_mb, mem_limit_mb=mem.mem_limit_mb,
                oom_retries=mem.oom_retries)
            res = self.client.push_pull(self.host_grads, self.host_params, worker_id=self.worker_id,
                                        assignment=a, loss=loss, telemetry=tel,
                                        consistent=self.consistent, abort=abort)
            if not res.stop:
                self._load_params()
            t4 = time.perf_counter()
            push_s = res.send_s
            t3 = t2 + push_s
            prev = Telemetry(iteration_s=t4 - t0, prev_push_s=push_s, prev_wait_s=res.wait_s,
                             prev_pull_s=res.pull_s)
            self.iterations_done += 1
            assert self.metrics is not None
            # The report, with this iteration's communication and its own time, known by now.
            self.metrics.write(worker=self.worker_id, iteration=a.iteration, batch_size=a.batch_size,
                               loss=loss, push_s=t3 - t2, wait_s=res.wait_s, pull_s=res.pull_s,
                               **dict(tel.to_dict(), iteration_s=t4 - t0))
        log.info("worker %d stopping after %d iterations", self.worker_id, self.iterations_done)
        return "stop"

    def _fitting_gradient(self, a: Assignment) -> tuple[Assignment, float, float, float, Telemetry]:
        """The gradient of ``a``; when it does not fit in memory, the coordinator gives a smaller
        share of the same samples (the rest go back to its data cursor) and it is retried.
        Returns (the assignment computed, loss, data seconds, compute start, the memory fields
        of its report)."""
        retries = 0
        while True:
            t0 = time.perf_counter()
            x = y = None
            try:
                # loading the batch allocates too (its inputs, on the device): a failure there
                # asks for a smaller share as well, instead of ending the worker
                x, y = self._batch(a.ranges, a.batch_size)
                t1 = time.perf_counter()
                self.memory.begin()
                loss = self._gradient(x, y)
            except Exception as exc:  # noqa: BLE001 - only an allocation failure is handled
                if not is_out_of_memory(exc):
                    raise
                why = str(exc).splitlines()[0][:200]
                exc.__traceback__ = None  # its frames hold the failed pass's tensors
            else:
                mem = self.memory.telemetry(a.batch_size) if self.cfg.worker.memory_headroom else Telemetry()
                return a, loss, t1 - t0, t1, dataclasses.replace(mem, oom_retries=retries)
            del x, y
            self.flat.zero_grad_()
            self.memory.release()
            a = self._reassigned(a, why)
            retries += 1
            self.oom_retries += 1

    def _chunked_gradient(self, a: Assignment, origin: float) -> tuple[Assignment, float, float, float, float]:
        """sync=flexrr: the gradient over every chunk the coordinator grants this worker in
        ``a``'s iteration: the first (``a``'s ranges), then one claim (:class:`P.TakeChunk`) per
        chunk, its own or a straggler's, until none is left. Per-sample gradients add up across
        chunks and the push carries their mean over all of them, so the update is the same
        whoever computed which chunk. An emulated slowdown sleeps after each chunk, so helpers
        can take over while it does. An allocation failure is not retried with less: the chunks
        are already a fraction of the share. Returns (what the push carries, loss, data seconds,
        compute start, emulated seconds)."""
        start = time.perf_counter()
        self.flat.zero_grad_()
        ranges: list[list[int]] = []
        count, loss_sum, data_s, emulated = 0, 0.0, 0.0, 0.0
        piece = a.ranges
        while True:
            size = sum(b - s for _, s, b in piece)
            t0 = time.perf_counter()
            x, y = self._batch(piece, size)
            t1 = time.perf_counter()
            data_s += t1 - t0
            loss_sum += self._accumulate(x, y)
            del x, y
            emulated += self.slowdown.after_compute(self.iterations_done, time.monotonic() - origin,
                                                    time.perf_counter() - t1)
            ranges += piece
            count += size
            try:
                reply = self.client.send_to_coordinator(
                    P.TakeChunk(worker_id=self.worker_id, token=self.client.token, iteration=a.iteration), P.Chunk)
            except RemoteError as exc:
                if exc.code == "stopped":  # pushed and dropped; the pull answers with the stop
                    break
                if exc.code in REJOIN_CODES:
                    raise
                raise PullAborted(f"chunk claim refused: [{exc.code}] {exc}") from None
            assert isinstance(reply, P.Chunk)
            if not reply.ranges:
                if reply.batch_size != count:
                    raise PullAborted(f"the coordinator granted {reply.batch_size} samples, this worker "
                                      f"computed {count}")
                break
            piece = reply.ranges
        with torch.no_grad():
            self.flat.grads.div_(count)
        if self.device.type != "cpu":
            self.flat.grads_to_host(self.host_grads)
        done = Assignment(iteration=a.iteration, batch_size=count, ranges=ranges, global_batch=a.global_batch)
        return done, loss_sum / count, data_s, start + data_s, emulated

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Add the summed per-sample gradients of (x, y) to the flat gradient; their summed loss."""
        loss = F.cross_entropy(self.model(x), y, reduction="sum")
        loss.backward()
        return float(loss.detach())

    def _reassigned(self, a: Assignment, why: str) -> Assignment:
        log.warning("worker %d: out of memory with %d samples at iteration %d (%s); asking for fewer",
                    self.worker_id, a.batch_size, a.iteration, why)
        try:
            reply = self.client.send_to_coordinator(
                P.OutOfMemory(worker_id=self.worker_id, token=self.client.token, iteration=a.iteration,
                              batch_size=a.batch_size), P.Reassignment)
        except RemoteError as exc:
            if exc.code == "cannot_fit":
                self._leave("it cannot hold the job's smallest share (min_batch) in memory")
                raise CannotFitInMemory(f"worker {self.name}: {exc}; raise worker.memory_limit_mb "
                                        "or use a smaller model") from None
            if exc.code in REJOIN_CODES:
                raise
            # the iteration moved on without us (declared lost meanwhile, a stop): join afresh
            raise PullAborted(f"out-of-memory retry refused: [{exc.code}] {exc}") from None
        assert isinstance(reply, P.Reassignment)
        if reply.assignment is None or reply.assignment.batch_size >= a.batch_size:
            raise PullAborted("the coordinator's reassignment is not smaller")
        log.info("worker %d: retrying iteration %d with %d samples", self.worker_id, a.iteration,
                 reply.assignment.batch_size)
        return reply.assignment

    def _warm_up_then_limit_memory(self) -> None:
        """Put the memory limit in force above what the process holds now, after one pass of
        two samples: kernels, thread pools and allocator arenas that the first pass sets up
        are the process's, not a cost of the batch size."""
        if self.memory.limit_mb is None:
            self.memory.apply()  # CUDA: measured against the device's memory; CPU: nothing
            return
        if not self.memory.warm:
            self._fits(2)
            self.memory.warm = True
        self.memory.apply()

    def _probe_memory(self) -> tuple[int, int]:
        """(largest batch that fits, smallest that does not or 0): doubling from PROBE_START up to
        the largest batch this worker can be given, then a binary search to within
        ``training.oom_margin`` of the failure. Gradients computed here are thrown away."""
        t = self.cfg.training
        top = min(t.max_batch or t.global_batch, t.global_batch)
        fits, fails = 0, 0
        b = min(PROBE_START, top)
        while True:
            if self._fits(b):
                fits = b
                if b >= top:
                    break
                b = min(top, 2 * b)
            else:
                fails = b
                break
        while fails and fails - fits > max(1, t.oom_margin * fails):
            mid = (fits + fails) // 2
            if self._fits(mid):
                fits = mid
            else:
                fails = mid
        if fits == 0:
            raise CannotFitInMemory(f"worker {self.name}: not even one sample fits in "
                                    f"{self.memory.limit_mb} MB")
        log.info("memory probe: %d samples fit%s", fits, f", {fails} do not" if fails else "")
        return fits, fails

    def _fits(self, b: int) -> bool:
        idx = np.arange(b) % self.data.num_train
        x = y = None
        try:
            x, y = self.data.train_batch(idx)
            if self.device.type != "cpu":
                x, y = x.to(self.device), y.to(self.device)
            self._gradient(x, y)
            return True
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            exc.__traceback__ = None
            return False
        finally:
            del x, y
            self.flat.zero_grad_()
            self.memory.release()

    def _batch(self, ranges: list[list[int]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.indexer.indices(ranges)
        if idx.size != size or size < 1:
            raise P.ProtocolError(f"assignment ranges hold {idx.size} samples, batch size is {size}")
        x, y = self.data.train_batch(idx)
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

    def _gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.flat.zero_grad_()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.device.type != "cpu":
            self.flat.grads_to_host(self.host_grads)
        return float(loss.detach())

    def _load_params(self) -> None:
        self.flat.load_(self.host_params)
