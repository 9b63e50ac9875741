"""A training worker: pull parameters and an assignment, compute a gradient, push it, repeat."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import zmq

from ps_common.config import JobConfig
from ps_common.datasets import ArrayDataset, load_dataset, sample_order
from ps_common.metrics import MetricsWriter
from ps_common.models import FlatParameters, build_model
from ps_common.protocol import Assignment
from ps_worker.client import ShardClients
from ps_worker.telemetry import ResourceProbe

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"worker.device={name!r} but CUDA is not available on this host")
    return dev


class SampleIndexer:
    """Turns [epoch, start, stop] ranges into sample indices; caches recent epoch orders."""

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n
        self._orders: dict[int, np.ndarray] = {}

    def indices(self, ranges: list[list[int]]) -> np.ndarray:
        parts = []
        for epoch, a, b in ranges:
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
                 dataset: ArrayDataset | None = None) -> None:
        self.cfg = cfg
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.device = resolve_device(cfg.worker.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.worker.torch_threads)
        self.ctx = ctx or zmq.Context.instance()
        self.client = ShardClients(self.ctx, server, timeout_s=cfg.transport.timeout_s,
                                   connect_timeout_s=cfg.transport.connect_timeout_s)
        self.data = dataset or load_dataset(
            cfg.data.dataset, cache_dir=cfg.data.cache_dir, seed=cfg.run.seed,
            synthetic_train=cfg.data.synthetic_train, synthetic_test=cfg.data.synthetic_test)
        self.model = build_model(cfg.model.name, seed=cfg.run.seed).to(self.device)
        self.flat = FlatParameters(self.model)
        self.host_params = np.empty(self.flat.numel, dtype=np.float32)
        if self.device.type == "cuda":
            self.host_grads = torch.empty(self.flat.numel, dtype=torch.float32).pin_memory().numpy()
        else:
            self.host_grads = self.flat.grads_numpy()
        self.indexer = SampleIndexer(cfg.run.seed, self.data.num_train)
        self.probe = ResourceProbe()
        self.run_dir = Path(run_dir) if run_dir else None
        self.metrics: MetricsWriter | None = None
        self.worker_id = -1
        self.iterations_done = 0
        # Round modes need one consistent version from every shard; async modes take each
        # shard's latest slice as it is.
        self.consistent = cfg.mode.sync in ("bsp", "backup")

    def run(self, max_iterations: int | None = None) -> int:
        """Train until the coordinator says stop; returns the number of iterations done."""
        welcome = self.client.join(self.name, self.cfg.job_digest(), str(self.device))
        self.worker_id = welcome.worker_id
        if welcome.num_params != self.flat.numel:
            raise RuntimeError(f"server has {welcome.num_params} parameters, model has {self.flat.numel}")
        self.metrics = MetricsWriter(
            self.run_dir / "metrics" / f"worker-{self.worker_id}.jsonl" if self.run_dir else None)
        log.info("worker %d (%s) joined at version %d on %s", self.worker_id, self.name,
                 welcome.version, self.device)
        try:
            self._loop(welcome.version, max_iterations)
        finally:
            self.metrics.close()
            self.client.close()
        return self.iterations_done

    def _loop(self, version: int, max_iterations: int | None) -> None:
        res = self.client.pull(self.host_params, worker_id=self.worker_id, min_version=version,
                               consistent=self.consistent)
        self._load_params()
        prev = {"push_s": 0.0, "wait_s": res.wait_s, "pull_s": res.pull_s, "iteration_s": 0.0}
        while not res.stop and res.assignment is not None:
            if max_iterations is not None and self.iterations_done >= max_iterations:
                break
            a = res.assignment
            t0 = time.perf_counter()
            x, y = self._batch(a)
            t1 = time.perf_counter()
            loss = self._gradient(x, y)
            t2 = time.perf_counter()
            resources = self.probe.sample(str(self.device))
            # Timings of this iteration's compute, and of the previous iteration's communication
            # (the current one's is not known before the push).
            tel = {"data_s": t1 - t0, "compute_s": t2 - t1,
                   "samples_per_s": a.batch_size / max(t2 - t1, 1e-9),
                   **{f"prev_{k}": v for k, v in prev.items()}, **resources}
            tel["iteration_s"] = prev["iteration_s"]
            self.client.push(self.host_grads, worker_id=self.worker_id, assignment=a, loss=loss,
                             telemetry=tel)
            t3 = time.perf_counter()
            res = self.client.pull(self.host_params, worker_id=self.worker_id,
                                   min_version=a.iteration + 1, consistent=self.consistent)
            if not res.stop:
                self._load_params()
            t4 = time.perf_counter()
            prev = {"push_s": t3 - t2, "wait_s": res.wait_s, "pull_s": res.pull_s,
                    "iteration_s": t4 - t0}
            self.iterations_done += 1
            assert self.metrics is not None
            self.metrics.write(worker=self.worker_id, iteration=a.iteration, batch_size=a.batch_size,
                               loss=loss, data_s=t1 - t0, compute_s=t2 - t1, push_s=t3 - t2,
                               wait_s=res.wait_s, pull_s=res.pull_s, iteration_s=t4 - t0,
                               **resources)
        log.info("worker %d stopping after %d iterations", self.worker_id, self.iterations_done)

    def _batch(self, a: Assignment) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.indexer.indices(a.ranges)
        if idx.size != a.batch_size:
            raise RuntimeError(f"assignment ranges hold {idx.size} samples, batch size is {a.batch_size}")
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
