"""Run a whole job on this host: shards, workers and the evaluator as real processes."""

from __future__ import annotations

import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq
from tqdm import tqdm

from ps_common import protocol as P
from ps_common.config import JobConfig, dump_yaml
from ps_common.datasets import dataset_from_config
from ps_common.transport import Connection, TransportTimeout
from ps_launcher.processes import ProcessGroup
from ps_launcher.plots import plot_run
from ps_launcher.summary import summarize

log = logging.getLogger(__name__)


def new_run_dir(cfg: JobConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(cfg.run.run_dir) / f"{cfg.run.name}-{stamp}"


class RunFailed(RuntimeError):
    pass


class LocalCluster:
    """One local run. ``run()`` returns the summary; children are always stopped on exit."""

    def __init__(self, cfg: JobConfig, run_dir: Path | None = None, *, progress: bool = True,
                 startup_timeout_s: float = 120.0, finish_timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
        self.progress = progress
        self.startup_timeout_s = startup_timeout_s
        self.finish_timeout_s = finish_timeout_s
        self.group = ProcessGroup(self.run_dir / "logs")
        self.shard_endpoints: list[str] = []

    def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dir / "config.yaml"
        cfg_path.write_text(dump_yaml(self.cfg))
        # Fetch/convert the dataset once here, so children do not race to do it.
        dataset_from_config(self.cfg.data, self.cfg.run.seed)
        t0 = time.monotonic()
        stop_reason = ""
        try:
            self._start(cfg_path)
            stop_reason = self._monitor()
        except KeyboardInterrupt:
            stop_reason = "interrupted (Ctrl-C)"
        finally:
            self._shutdown()
        summary = summarize(self.run_dir, global_batch=self.cfg.training.global_batch,
                            target_accuracy=self.cfg.training.target_accuracy,
                            wall_s=time.monotonic() - t0, stop_reason=stop_reason)
        plot_run(self.run_dir, summary)
        return summary

    def _common(self, cfg_path: Path) -> list[str]:
        return ["--config", str(cfg_path), "--run-dir", str(self.run_dir)]

    def _start(self, cfg_path: Path) -> None:
        c = self.cfg
        s0 = self.group.start("shard-0", "ps_server.cli", [*self._common(cfg_path), "--shard", "0", "--port", "0"])
        ep0 = self.group.wait_endpoint(s0, self.startup_timeout_s)
        self.shard_endpoints = [ep0]
        others = [self.group.start(f"shard-{k}", "ps_server.cli",
                                   [*self._common(cfg_path), "--shard", str(k), "--port", "0",
                                    "--coordinator", ep0])
                  for k in range(1, c.cluster.num_shards)]
        self.shard_endpoints += [self.group.wait_endpoint(ch, self.startup_timeout_s) for ch in others]
        for i in range(c.cluster.num_workers):
            self.group.start(f"worker-{i}", "ps_worker.cli",
                             [*self._common(cfg_path), "--server", ep0, "--name", f"worker-{i}",
                              "--scenario-index", str(i)])
        if c.evaluator.enabled:
            self.group.start("evaluator", "ps_worker.evaluator_cli", [*self._common(cfg_path), "--server", ep0])

    def _roles(self, prefix: str) -> list:
        return [ch for ch in self.group.children if ch.role.startswith(prefix)]

    def _monitor(self) -> str:
        ctx = zmq.Context.instance()
        conn = Connection(ctx, self.shard_endpoints[0], timeout_s=10.0, security=self.cfg.security)
        t = self.cfg.training
        total = t.max_iterations
        bar = tqdm(total=total, unit="it", desc=self.cfg.run.name, disable=not self.progress,
                   dynamic_ncols=True)
        last = 0
        try:
            while True:
                failed = self.group.failed()
                if failed is not None:
                    raise RunFailed(f"{failed.role} exited with code {failed.proc.returncode}; "
                                    f"last lines of {failed.log_path}:\n{failed.tail()}")
                try:
                    st = conn.request(P.StatusRequest(), P.Status)
                except TransportTimeout:
                    raise RunFailed("shard 0 stopped answering status requests") from None
                assert isinstance(st, P.Status)
                done = int(st.iterations)
                if done != last:
                    bar.set_postfix(epoch=st.epoch, workers=st.workers, refresh=False,
                                    acc=f"{st.last_accuracy:.4f}" if st.last_accuracy >= 0 else "-")
                    bar.update(done - last)
                    last = done
                if st.stop:
                    self._wait_finish()
                    return st.stop_reason
                time.sleep(0.25)
        finally:
            bar.close()
            conn.close()

    def _wait_finish(self) -> None:
        """Workers leave on their own at stop; the evaluator takes its final measurement."""
        deadline = time.monotonic() + self.finish_timeout_s
        for ch in self._roles("worker") + self._roles("evaluator"):
            left = max(0.1, deadline - time.monotonic())
            try:
                ch.proc.wait(timeout=left)
            except Exception:
                log.warning("%s did not exit within the finish timeout", ch.role)

    def _shutdown(self) -> None:
        ctx = zmq.Context.instance()
        for ep in self.shard_endpoints:
            conn = Connection(ctx, ep, timeout_s=2.0, security=self.cfg.security)
            try:
                conn.request(P.Shutdown(reason="launcher finished", job_digest=self.cfg.job_digest()), P.Ack)
            except Exception:
                pass
            finally:
                conn.close()
        self.group.stop_all()
