"""Run a whole job on this host: shards, workers and the evaluator as real processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq
from tqdm import tqdm

from ps_common import protocol as P
from ps_common.cli_util import PARENT_ENV
from ps_common.config import JobConfig, dump_yaml
from ps_common.errors import PsError
from ps_common.rendezvous import ENDPOINT_FILE, FILE_PREFIX
from ps_common.security.credentials import ROLES, generate_master, load_secret, write_role_secret
from ps_common.transport import Connection, TransportTimeout
from ps_launcher.forked_process import ForkServer
from ps_launcher.plots import plot_run
from ps_launcher.processes import ProcessGroup
from ps_launcher.run_dir import prepare_run_dir
from ps_launcher.summary import summarize
from ps_ml.datasets import dataset_from_config
from ps_worker.gpu_share import launch_env

log = logging.getLogger(__name__)

SECRET_ENV = "LBBSP__SECURITY__SECRET_FILE"


def new_run_dir(cfg: JobConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(cfg.run.run_dir) / f"{cfg.run.name}-{stamp}"


class RunFailed(PsError, RuntimeError):
    pass


class LocalCluster:
    """One local run. ``run()`` returns the summary; children are always stopped on exit."""

    def __init__(self, cfg: JobConfig, run_dir: Path | None = None, *, progress: bool = True,
                 startup_timeout_s: float = 120.0, finish_timeout_s: float = 60.0,
                 overwrite: bool = False, fork_server: ForkServer | None = None) -> None:
        """``fork_server``: one that outlives this run (ps-compare's, for all its runs); without
        it the run's process group starts its own with its first role."""
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
        self.overwrite = overwrite
        self.progress = progress
        self.startup_timeout_s = startup_timeout_s
        self.finish_timeout_s = finish_timeout_s
        self.group = ProcessGroup(self.run_dir / "logs", shared_server=fork_server)
        self.shard_endpoints: list[str] = []
        self.ipc_dir: Path | None = None
        self.lab: Any = None  # a LabDriver when the scenario uses real mechanisms
        self._hosts = False
        #: Ctrl-C, SIGTERM or SIGHUP ended the run: it stopped early, everything was gathered.
        self.interrupted = False

    def run(self) -> dict[str, Any]:
        """Raises :class:`~ps_launcher.run_dir.RunDirInUse` for a run directory that holds a run
        (unless ``overwrite``): two runs' metrics in one directory would mix."""
        prepare_run_dir(self.run_dir, self.overwrite)
        self.role_env = self._credentials()
        cfg_path = self.run_dir / "config.yaml"
        cfg_path.write_text(dump_yaml(self.cfg))
        # Fetch/convert the dataset once here, so children do not race to do it.
        dataset_from_config(self.cfg.data, self.cfg.run.seed)
        t0 = time.monotonic()
        stop_reason = ""
        try:
            self._open_lab()
            self._start(cfg_path)
            stop_reason = self._monitor_files() if self._hosts else self._monitor()
        except KeyboardInterrupt:
            stop_reason = "interrupted (Ctrl-C)"
            self.interrupted = True
        finally:
            self._shutdown()
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
            if self.lab is not None:
                self.lab.close()
        summary = summarize(self.run_dir, global_batch=self.cfg.training.global_batch,
                            target_accuracy=self.cfg.training.target_accuracy,
                            wall_s=time.monotonic() - t0, stop_reason=stop_reason,
                            num_shards=self.cfg.cluster.num_shards)
        plot_run(self.run_dir, summary)
        return summary

    def _credentials(self) -> dict[str, dict[str, str]]:
        """Per-role environment for the children: without CURVE, a fresh job secret for this run
        (or the one configured) with the master for shards and one role file per other role, so
        a worker process cannot act as the operator or a shard. With CURVE each process picks its
        role's key itself."""
        sec = self.cfg.security
        if sec.curve:
            return {}
        secrets_dir = self.run_dir / "secrets"
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(secrets_dir, 0o700)
        if sec.secret_file:
            master = load_secret(sec.secret_file)
            if master.master is None:  # a single role file: everyone uses it (and fails if it must)
                return {r: {SECRET_ENV: master.path} for r in ROLES}
        else:
            master = generate_master(secrets_dir / "job.secret", overwrite=True)
        env = {"shard": {SECRET_ENV: str(Path(master.path).resolve())}}
        for role in ("worker", "evaluator", "operator"):
            path = secrets_dir / f"{role}.secret"
            write_role_secret(path, master, role, overwrite=True)
            env[role] = {SECRET_ENV: str(path.resolve())}
        self.cfg = self.cfg.model_copy(update={"security": sec.model_copy(
            update={"secret_file": env["operator"][SECRET_ENV]})})
        return env

    def _common(self, cfg_path: Path) -> list[str]:
        return ["--config", str(cfg_path), "--run-dir", str(self.run_dir)]

    def _open_lab(self) -> None:
        """Real mechanisms (CPU quotas, hosts with shaped links) when the scenario asks for them."""
        sc, n = self.cfg.scenario, self.cfg.cluster.num_workers
        if not (sc.needs_quotas(n) or sc.needs_hosts(n)):
            return
        from ps_launcher.lab import cleanup_stale
        from ps_launcher.lab.driver import LabDriver

        removed = cleanup_stale()
        if removed:
            log.warning("removed what killed runs left: %s", ", ".join(removed))
        self.lab = LabDriver(self.cfg, self.run_dir).open()
        self._hosts = self.lab.lab is not None

    def _host(self, shard: int) -> list[str]:
        """``--host`` for shard ``shard``: its lab host's address, or a Unix socket with
        cluster.transport=ipc."""
        if self.lab is not None and self._hosts:
            host = self.lab.host(f"shard-{shard}")
            assert host is not None
            return ["--host", host.ip]
        if self.cfg.cluster.transport != "ipc":
            return []
        if self.ipc_dir is None:  # short: a Unix socket path has ~100 bytes at most
            self.ipc_dir = Path(tempfile.mkdtemp(prefix="lbps-ipc-"))
        return ["--host", f"ipc://{self.ipc_dir}/shard-{shard}"]

    def _start_child(self, name: str, module: str, args: list[str], role: str):
        env = {**self.role_env.get(role, {}), PARENT_ENV: str(os.getpid())}
        index = int(name.split("-")[1]) if name.startswith("worker-") else None
        if index is not None:  # MPS may read the GPU share as CUDA starts: set it from birth
            env.update(launch_env(self.cfg.scenario.for_worker(index).gpu_sm_percent))
        prefix = self.lab.prefix(name) if self.lab is not None else None
        child = self.group.start(name, module, args, env=env, prefix=prefix)
        if self.lab is not None and index is not None:
            self.lab.attach(index, child.proc.pid)
        return child

    #: Every process starts at once and reads shard 0's endpoint from a file in the run directory
    #: (:mod:`ps_common.rendezvous`); a backend whose processes do not see this file system (Ray)
    #: starts the others once shard 0 is up, with its endpoint on their command lines.
    endpoint_by_file = True

    def _start(self, cfg_path: Path) -> None:
        c = self.cfg
        s0_args = [*self._common(cfg_path), "--shard", "0", "--port", "0", *self._host(0)]
        if self.endpoint_by_file:
            ep_file = self.run_dir / ENDPOINT_FILE
            ep_file.unlink(missing_ok=True)          # an earlier run's endpoint would be read as this one's
            s0 = self._start_child("shard-0", "ps_server.cli", [*s0_args, "--endpoint-file", str(ep_file)], "shard")
            ep0 = FILE_PREFIX + str(ep_file)
        else:
            s0 = self._start_child("shard-0", "ps_server.cli", s0_args, "shard")
            ep0 = self.group.wait_endpoint(s0, self.startup_timeout_s)
        others = [self._start_child(f"shard-{k}", "ps_server.cli",
                                    [*self._common(cfg_path), "--shard", str(k), "--port", "0", *self._host(k),
                                     "--coordinator", ep0], "shard")
                  for k in range(1, c.cluster.num_shards)]
        # Clients need only shard 0's address, and shard 0 holds their joins until every shard has
        # registered: they start (importing torch, loading data) while the shards do.
        for i in range(c.cluster.num_workers):
            self._start_child(f"worker-{i}", "ps_worker.cli", self._worker_args(cfg_path, ep0, i), "worker")
        if c.evaluator.enabled:
            self._start_child("evaluator", "ps_worker.evaluator_cli", self._evaluator_args(cfg_path, ep0), "evaluator")
        self.shard_endpoints = [self.group.wait_endpoint(s0, self.startup_timeout_s) if self.endpoint_by_file else ep0]
        self.shard_endpoints += [self.group.wait_endpoint(ch, self.startup_timeout_s) for ch in others]

    def _evaluator_args(self, cfg_path: Path, ep0: str) -> list[str]:
        return [*self._common(cfg_path), "--server", ep0]

    def _worker_args(self, cfg_path: Path, ep0: str, i: int) -> list[str]:
        return [*self._common(cfg_path), "--server", ep0, "--name", f"worker-{i}", "--scenario-index", str(i)]

    def _roles(self, prefix: str) -> list:
        return [ch for ch in self.group.children if ch.role.startswith(prefix)]

    def _raise_if_a_child_failed(self) -> None:
        failed = self.group.failed()
        if failed is not None:
            raise RunFailed(f"{failed.role} exited with code {failed.proc.returncode}; "
                            f"last lines of {failed.log_path}:\n{failed.tail()}")

    def _monitor(self) -> str:
        ctx = zmq.Context.instance()
        conn = Connection(ctx, self.shard_endpoints[0], role="operator", timeout_s=10.0,
                          security=self.cfg.security)
        t = self.cfg.training
        total = t.max_iterations
        bar = tqdm(total=total, unit="it", desc=self.cfg.run.name, disable=not self.progress,
                   dynamic_ncols=True)
        last = 0
        shard0 = self._roles("shard-0")[0]
        ep0 = self.shard_endpoints[0]
        try:
            while True:
                self._raise_if_a_child_failed()
                if self.shard_endpoints[0] != ep0:  # shard 0 was started again elsewhere (Ray)
                    ep0, shard0 = self.shard_endpoints[0], self._roles("shard-0")[0]
                    conn.close()
                    conn = Connection(ctx, ep0, role="operator", timeout_s=10.0, security=self.cfg.security)
                if shard0.proc.poll() == 0:  # the job finished between two status requests
                    self._wait_finish()
                    return self._final_stop_reason()
                st = self._status(conn, shard0)
                if st is None:
                    continue  # shard 0 ended meanwhile: the check above sees how
                if st.started and self.lab is not None:
                    self.lab.start_clock()
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

    @staticmethod
    def _status(conn: Connection, shard0: Any) -> P.Status | None:
        """Shard 0's status, or None once shard 0 has exited. A job can end between two
        requests (shard 0 exits by itself after the stop), so the answer is awaited in short
        slices while the process lives, not for the whole 5 s (which every short run used to
        wait out at its end)."""
        conn.send(P.StatusRequest())
        deadline = time.monotonic() + 5.0
        while True:
            try:
                reply = conn.recv(timeout_s=0.1)
            except TransportTimeout:
                if shard0.proc.poll() is not None:
                    return None
                if time.monotonic() > deadline:
                    raise RunFailed("shard 0 stopped answering status requests") from None
                continue
            if isinstance(reply, P.Status):
                return reply

    def _monitor_files(self) -> str:
        """Progress from shard 0's metrics when the processes run on lab hosts, which this
        process cannot reach: the first commit starts the scenario's clock, the stop record ends
        the run."""
        path = self.run_dir / "metrics" / "coordinator.jsonl"
        t = self.cfg.training
        bar = tqdm(total=t.max_iterations, unit="it", desc=self.cfg.run.name, disable=not self.progress,
                   dynamic_ncols=True)
        fh = None
        pending = b""
        try:
            while True:
                self._raise_if_a_child_failed()
                if fh is None and path.exists():
                    fh = open(path, "rb")
                chunk = fh.read() if fh is not None else b""
                *lines, pending = (pending + chunk).split(b"\n")
                commits = 0
                for line in lines:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if "event" not in r:
                        commits += 1
                        if self.lab is not None:
                            self.lab.start_clock()
                    elif r["event"] == "stop":
                        bar.close()
                        self._wait_finish()
                        return r.get("reason", "stopped")
                if commits:
                    bar.update(commits)
                if self._roles("shard-0")[0].proc.poll() == 0:
                    self._wait_finish()
                    return self._final_stop_reason()
                time.sleep(0.25)
        finally:
            bar.close()
            if fh is not None:
                fh.close()

    def _final_stop_reason(self) -> str:
        from ps_common.metrics import read_jsonl

        path = self.run_dir / "metrics" / "coordinator.jsonl"
        reason = "finished"
        if path.exists():
            for rec in read_jsonl(path):
                if rec.get("event") == "stop":
                    reason = rec.get("reason", reason)
        return reason

    def _wait_finish(self) -> None:
        """Every process ends on its own after the stop: workers at once, the evaluator after
        its final measurement, the shards once both have the final version."""
        deadline = time.monotonic() + self.finish_timeout_s + self.cfg.training.finish_timeout_s
        for ch in self._roles("worker") + self._roles("evaluator") + self._roles("shard"):
            left = max(0.1, deadline - time.monotonic())
            try:
                ch.proc.wait(timeout=left)
            except Exception:
                log.warning("%s did not exit within the finish timeout", ch.role)

    def _shutdown(self) -> None:
        """Stop whatever still runs: an operator Shutdown to live shards, then signals."""
        ctx = zmq.Context.instance()
        live = {ch.role for ch in self.group.children if ch.proc.poll() is None}
        for k, ep in enumerate(self.shard_endpoints):
            if f"shard-{k}" not in live or self._hosts:  # lab hosts: not reachable from here
                continue
            try:  # the signals below stop it anyway: a shutdown must not fail on the way
                conn = Connection(ctx, ep, role="operator", timeout_s=2.0, security=self.cfg.security)
            except Exception as exc:  # noqa: BLE001 - e.g. the operator's key file is gone
                log.warning("cannot ask shard %d to shut down (%s): stopping it by signal", k, exc)
                continue
            try:
                conn.request(P.Shutdown(reason="launcher stopping"), P.Ack)
            except Exception:
                pass
            finally:
                conn.close()
        self.group.stop_all()
