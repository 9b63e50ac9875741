"""Run a job on a Ray cluster: ``ps-launch CONFIG --backend ray [--address auto|HOST:PORT]``.

Every shard, worker and the evaluator is the same command line as under the local launcher,
run as a child process of a Ray actor placed by the ``ray:`` config section (shards in a
placement group that spreads them over nodes; workers with their CPUs, GPUs, memory and custom
resources, which serve as node labels). The child is told to die with its actor (parent-death
signal), so a node that leaves the cluster takes its processes with it. Shards bind every
interface and advertise their node's address. Nothing needs a shared file system: the config
and each role's job secret travel with the actor, each process writes a node-local run
directory, and at the end the driver gathers them into one run directory, writes the summary
and plots, as ``ps-launch`` does locally.

The driver brings every process's new log lines and metrics records back every
``ray.records_every_s`` while the job runs, so the run directory can be watched live and what a
lost node's processes wrote is kept.

Failures: a worker lost with its node is a lost worker to the job (training goes on), the
evaluator lost with its node ends the measurements. A shard lost with its node is started again
on another node from its last checkpoint when ``checkpoint.dir`` is on storage every node shares
(``ray.restart_lost_shards`` times at most); when it is shard 0, the workers and the evaluator
start again at its new address. Without shared checkpoints a lost shard fails the run. Ctrl-C,
SIGTERM or a failure stops every process and kills every actor.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

from ps_common.cli_util import PARENT_ENV
from ps_common.config import ConfigError, JobConfig
from ps_launcher.launcher import LocalCluster, RunFailed

log = logging.getLogger(__name__)

#: ``returncode`` of a process whose actor (and so node) is gone.
LOST = -1000
_ENDPOINT_RE = re.compile(r"listening on (\S+)")


class ProcessActor:
    """One process of the job on the node Ray placed this actor on."""

    def __init__(self, name: str, files: dict[str, bytes], log_name: str = "") -> None:
        self.name = name
        self.log_name = log_name or f"{name}.log"
        self.dir = Path(tempfile.mkdtemp(prefix=f"lbbsp-ray-{name}-"))
        for rel, data in files.items():
            path = self.dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if rel.endswith((".secret", ".key_secret")):
                path.chmod(0o600)
        self.proc: subprocess.Popen | None = None

    def _fill(self, s: str) -> str:
        return s.replace("{dir}", str(self.dir)).replace("{node_ip}", ray.util.get_node_ip_address())

    def start(self, module: str, args: list[str], env: dict[str, str]) -> int:
        full = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid()),
                **{k: self._fill(v) for k, v in env.items()}}
        with open(self.dir / "process.log", "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *[self._fill(a) for a in args]],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=full, start_new_session=True)
        return self.proc.pid

    def endpoint(self, timeout_s: float) -> str:
        """The address a shard printed once bound (raises if it exited first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = _ENDPOINT_RE.search((self.dir / "process.log").read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} printed no endpoint within {timeout_s:.0f}s:\n{self.tail()}")

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "process.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return p.returncode

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def read_new(self, offsets: dict[str, int], final: bool = False) -> dict[str, bytes]:
        """What the process wrote since ``offsets`` (relative path -> bytes already taken): the
        appended complete lines of its log and metrics while it runs; with ``final``, the rest of
        those and every other file of its run directory (checkpoints, final parameters), after
        which the node-local copy goes."""
        files = {f"logs/{self.log_name}": self.dir / "process.log"}
        run = self.dir / "run"
        if run.exists():
            files.update({str(p.relative_to(run)): p for p in run.rglob("*") if p.is_file()})
        out: dict[str, bytes] = {}
        for rel, path in files.items():
            streamed = rel.endswith((".jsonl", ".log"))
            if not (streamed or final):
                continue
            try:
                with open(path, "rb") as fh:
                    fh.seek(offsets.get(rel, 0) if streamed else 0)
                    data = fh.read()
            except OSError:
                continue
            if streamed and not final:
                data = data[:data.rfind(b"\n") + 1]  # whole lines only: a record is never split
            if data or (final and rel.startswith("logs/")):  # every process has a log, if empty
                out[rel] = data
        if final:
            shutil.rmtree(self.dir, ignore_errors=True)
        return out


#: The actor class as Ray runs it (``ray.remote`` returns an untyped wrapper).
_REMOTE_ACTOR: Any = ray.remote(num_cpus=0)(ProcessActor)


class RemoteProc:
    """The part of ``subprocess.Popen`` the local launcher's monitor uses, over an actor."""

    def __init__(self, actor: Any, pid: int) -> None:
        self.actor, self.pid = actor, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = ray.get(self.actor.poll.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.returncode = LOST
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray actor", timeout or 0)
            time.sleep(0.2)
        assert self.returncode is not None
        return self.returncode


class RemoteChild:
    def __init__(self, role: str, actor: Any, proc: RemoteProc, log_path: Path) -> None:
        self.role, self.actor, self.proc, self.log_path = role, actor, proc, log_path
        self.taken: dict[str, int] = {}  # bytes of each streamed file already on the driver

    def tail(self, lines: int = 30) -> str:
        try:
            return ray.get(self.actor.tail.remote(lines), timeout=10)
        except Exception:  # noqa: BLE001 - the actor is gone: what was collected, if anything
            try:
                return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                return "(lost with its node)"


class RayProcessGroup:
    """The local launcher's process group, on Ray actors."""

    def __init__(self, cfg: JobConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.children: list[RemoteChild] = []
        self.files: dict[str, bytes] = {}
        self.role_files: dict[str, dict[str, bytes]] = {}
        self.pg: Any = None  # the shards' placement group
        self.lost: list[str] = []
        self.retired: list[RemoteChild] = []  # shards lost with their node and started again
        self._lock = threading.Lock()
        self._streaming = threading.Event()
        self._streamer: threading.Thread | None = None

    def _options(self, name: str) -> dict[str, Any]:
        r = self.cfg.ray
        if name.startswith("shard-"):
            opts: dict[str, Any] = {"num_cpus": r.shard_cpus, "resources": dict(r.shard_resources)}
            if self.pg is not None:  # a shard started again gets its bundle, which Ray moved off the lost node
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=int(name.split("-")[1]))}
            return opts
        if name.startswith("worker-"):
            opts = {"num_cpus": r.worker_cpus, "num_gpus": r.worker_gpus, "resources": dict(r.worker_resources)}
            if r.worker_memory_mb:
                opts["memory"] = int(r.worker_memory_mb * 2**20)
            return opts
        return {"num_cpus": r.evaluator_cpus, "resources": dict(r.evaluator_resources)}

    def place_shards(self, timeout_s: float) -> None:
        r = self.cfg.ray
        if not r.spread_shards:
            return
        from ray.util.placement_group import placement_group

        bundle = {"CPU": r.shard_cpus, **r.shard_resources} if r.shard_cpus else dict(r.shard_resources)
        self.pg = placement_group([dict(bundle) or {"CPU": 0.01}] * self.cfg.cluster.num_shards,
                                  strategy="SPREAD")
        if not self.pg.wait(timeout_s):
            raise RunFailed(f"Ray could not place {self.cfg.cluster.num_shards} shards ({bundle} each, spread "
                            f"over nodes) within {timeout_s:.0f}s")

    def start(self, name: str, module: str, args: list[str], env: dict[str, str], role: str,
              timeout_s: float = 120.0, log_name: str = "") -> RemoteChild:
        files = {**self.files, **self.role_files.get(role, {})}
        opts = self._options(name)
        log_name = log_name or f"{name}.log"
        actor = _REMOTE_ACTOR.options(**opts).remote(name, files, log_name)
        try:
            pid = ray.get(actor.start.remote(module, args, env), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            free = ray.available_resources()
            raise RunFailed(f"Ray could not place {name} within {timeout_s:.0f}s: it asks for "
                            f"{ {k: v for k, v in opts.items() if k != 'scheduling_strategy'} }, the cluster "
                            f"has {free} free (the ray: section sets what each process asks for)") from None
        child = RemoteChild(name, actor, RemoteProc(actor, pid), self.run_dir / "logs" / log_name)
        self.children.append(child)
        return child

    def retire(self, child: RemoteChild) -> None:
        """A shard lost with its node, about to be started again: no longer watched."""
        self.children.remove(child)
        self.retired.append(child)

    def stop_and_retire(self, children: list[RemoteChild], grace_s: float = 5.0) -> None:
        """Stop these live processes, bring back what they wrote, and stop watching them."""
        stops = [c.actor.stop.remote(grace_s) for c in children]
        ray.wait(stops, num_returns=len(stops), timeout=grace_s + 15)
        self.gather(final=True, timeout_s=30, only=children)
        for c in children:
            try:
                ray.kill(c.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.retire(c)

    def node_of(self, role: str) -> str:
        """The Ray node id a live process runs on."""
        child = next(c for c in self.children if c.role == role)
        return ray.get(child.actor.node_id.remote(), timeout=30)

    # ----- records, streamed --------------------------------------------------------------
    def start_streaming(self, every_s: float) -> None:
        """Bring every process's new log lines and metrics records to the driver's run
        directory every ``every_s`` seconds, so they can be watched live and what a lost node's
        processes wrote up to then is kept."""
        def loop() -> None:
            while not self._streaming.wait(every_s):
                try:
                    self.gather(final=False, timeout_s=every_s * 4)
                except Exception:  # noqa: BLE001 - a node going away mid-read: next round
                    log.debug("streaming records failed this round", exc_info=True)

        self._streamer = threading.Thread(target=loop, name="ray-records", daemon=True)
        self._streamer.start()

    def stop_streaming(self) -> None:
        self._streaming.set()
        if self._streamer is not None:
            self._streamer.join(30)
            self._streamer = None

    def gather(self, *, final: bool, timeout_s: float, only: list[RemoteChild] | None = None) -> None:
        """Read what each live process (or each of ``only``) wrote since the last time, append it
        on the driver."""
        with self._lock:
            live = [c for c in (self.children if only is None else only) if c.proc.returncode != LOST]
            refs = {c.role: c.actor.read_new.remote(dict(c.taken), final) for c in live}
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
            for c in live:
                try:
                    files = ray.get(refs[c.role], timeout=0)
                except Exception:  # noqa: BLE001 - lost with its node, or too slow: next time
                    continue
                for rel, data in files.items():
                    path = self.run_dir / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if rel.endswith((".jsonl", ".log")):
                        with open(path, "ab") as fh:  # one file may collect several processes' lines
                            fh.write(data)
                        c.taken[rel] = c.taken.get(rel, 0) + len(data)
                    else:
                        path.write_bytes(data)

    def wait_endpoint(self, child: RemoteChild, timeout_s: float) -> str:
        try:
            return ray.get(child.actor.endpoint.remote(timeout_s), timeout=timeout_s + 30)
        except ray.exceptions.RayTaskError as exc:
            raise RunFailed(str(exc.cause if hasattr(exc, "cause") else exc)) from None

    def failed(self) -> RemoteChild | None:
        """A process that failed. A worker lost with its node is the job's business, not a failure;
        so is the evaluator (no more measurements; shard 0 waits for its final one at most
        ``training.finish_timeout_s``)."""
        for c in self.children:
            rc = c.proc.poll()
            if rc == LOST and (c.role.startswith("worker-") or c.role == "evaluator"):
                if c.role not in self.lost:
                    self.lost.append(c.role)
                    log.warning("%s was lost with its node; the job goes on without it", c.role)
                continue
            if rc not in (None, 0):
                return c
        return None

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every process, gather what each wrote into the run directory, kill the actors.
        All at once and bounded: a node that is gone costs a timeout, not one per process."""
        self.stop_streaming()
        live = [c for c in self.children if c.proc.returncode != LOST]
        stops = [c.actor.stop.remote(grace_s) for c in live]
        ray.wait(stops, num_returns=len(stops), timeout=grace_s + 15)
        self.gather(final=True, timeout_s=60)
        for c in self.children + self.retired:
            try:
                ray.kill(c.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            # It can block for good after a SIGTERM (seen with a Ray started by the driver);
            # the placement group also goes when the job's driver disconnects.
            t = threading.Thread(target=remove_placement_group, args=(self.pg,), daemon=True)
            t.start()
            t.join(5.0)
            self.pg = None


class RayCluster(LocalCluster):
    """The local launcher's run (credentials, monitor, summary) with processes on Ray."""

    endpoint_by_file = False   # a Ray node need not see the driver's file system

    def __init__(self, cfg: JobConfig, run_dir: Path | None = None, *, address: str | None = None,
                 progress: bool = True, overwrite: bool = False) -> None:
        super().__init__(cfg, run_dir, progress=progress, overwrite=overwrite)
        sc, n = cfg.scenario, cfg.cluster.num_workers
        if sc.needs_quotas(n) or sc.needs_hosts(n):
            raise ValueError("the lab's CPU quotas and shaped links are local mechanisms: not with --backend ray")
        self.address = address
        self.ray_group = RayProcessGroup(cfg, self.run_dir)
        self.group = self.ray_group  # type: ignore[assignment]  # the same interface, over actors
        self.restarts: dict[str, int] = {}
        self.curve_env: dict[str, dict[str, str]] = {}  # per role: where its shipped CURVE keys are

    def run(self) -> dict[str, Any]:
        if not ray.is_initialized():
            local = self.address is None and not os.environ.get("RAY_ADDRESS")
            # A Ray started here for this run counts at least one logical CPU per process, as the
            # local launcher runs them all on this host whatever its core count.
            need = self._cpus_needed() if local else None
            cpus: dict[str, Any] = {"num_cpus": max(os.cpu_count() or 1, need)} if need else {}
            ray.init(address=self.address, log_to_driver=False, configure_logging=False, **cpus)
            # ray.init installs its own SIGTERM handler, which ends the driver at once: put back
            # the launcher's (SIGTERM, SIGHUP -> the Ctrl-C path that stops and gathers everything)
            from ps_common.cli_util import interrupt_on_signals

            if threading.current_thread() is threading.main_thread():
                interrupt_on_signals()
        return super().run()

    def _cpus_needed(self) -> int:
        r, c = self.cfg.ray, self.cfg.cluster
        total = (r.shard_cpus * c.num_shards + r.worker_cpus * c.num_workers
                 + (r.evaluator_cpus if self.cfg.evaluator.enabled else 0.0))
        return int(total + 0.999)

    def _open_lab(self) -> None:
        group = self.ray_group
        group.cfg = self.cfg
        group.files = {"config.yaml": (self.run_dir / "config.yaml").read_bytes()}
        for role, env in self.role_env.items():   # each role gets its own job secret, no other
            group.role_files[role] = {f"{role}.secret": Path(env["LBBSP__SECURITY__SECRET_FILE"]).read_bytes()}
        if self.cfg.security.curve:
            self._ship_curve_keys(group)
        group.place_shards(self.startup_timeout_s)
        group.start_streaming(self.cfg.ray.records_every_s)

    def _ship_curve_keys(self, group: "RayProcessGroup") -> None:
        """With CURVE, each role's key files travel with its actors, as the job secret does
        without it: shards get the servers' key pair and the allowed clients' public keys; a
        worker or the evaluator gets its own key pair and the servers' public key, never the
        servers' secret one. No node needs the keys beforehand."""
        sec = self.cfg.security
        sec.require_server()
        if not sec.server_public_key:
            raise ConfigError("security.server_public_key: with CURVE on Ray, set the servers' public key file, "
                             "so that clients are not sent the servers' secret key file")
        public = Path(sec.server_public_key).expanduser().read_bytes()
        allowed = Path(sec.allowed_clients_dir or "").expanduser()
        group.role_files["shard"] = {
            "curve/server.key_secret": Path(sec.server_secret_key or "").expanduser().read_bytes(),
            "curve/server.key": public,
            **{f"curve/allowed/{p.name}": p.read_bytes() for p in sorted(allowed.glob("*.key"))}}
        pre = "LBBSP__SECURITY__"
        self.curve_env["shard"] = {f"{pre}SERVER_SECRET_KEY": "{dir}/curve/server.key_secret",
                                   f"{pre}SERVER_PUBLIC_KEY": "{dir}/curve/server.key",
                                   f"{pre}ALLOWED_CLIENTS_DIR": "{dir}/curve/allowed"}
        for role in ("worker", "evaluator"):
            own = (Path(sec.client_secret_key) if sec.client_secret_key
                   else Path(sec.client_keys_dir) / f"{role}.key_secret" if sec.client_keys_dir else None)
            if own is None:
                raise ConfigError("security.client_secret_key or security.client_keys_dir: with CURVE on Ray, "
                                 "clients need their own key pair (ps-keys init), not the servers' secret key")
            group.role_files[role] = {"curve/client.key_secret": own.expanduser().read_bytes(),
                                      "curve/server.key": public}
            self.curve_env[role] = {f"{pre}CLIENT_SECRET_KEY": "{dir}/curve/client.key_secret",
                                    f"{pre}SERVER_PUBLIC_KEY": "{dir}/curve/server.key"}

    def _common(self, cfg_path: Path) -> list[str]:
        return ["--config", "{dir}/config.yaml", "--run-dir", "{dir}/run"]

    def _host(self, shard: int) -> list[str]:
        return ["--host", "0.0.0.0", "--advertise", "{node_ip}"]

    def _role_env(self, role: str) -> dict[str, str]:
        """Where a process of ``role`` finds the credentials that travelled with its actor."""
        env = {"LBBSP__SECURITY__SECRET_FILE": f"{{dir}}/{role}.secret"} if role in self.role_env else {}
        return {**env, **self.curve_env.get(role, {})}

    def _start_child(self, name: str, module: str, args: list[str], role: str):
        return self.ray_group.start(name, module, args, self._role_env(role), role, self.startup_timeout_s)

    def _restartable(self, child: RemoteChild) -> str | None:
        """Why a lost shard cannot be started again, or None if it can."""
        ck, role = self.cfg.checkpoint, child.role
        if not (ck.dir and Path(ck.dir).is_absolute() and (ck.every_iterations or ck.every_seconds)):
            return ("its checkpoints were on the lost node: set checkpoint.dir to an absolute path on storage "
                    "every node shares, and checkpoint.every_iterations or every_seconds")
        if self.restarts.get(role, 0) >= self.cfg.ray.restart_lost_shards:
            return f"it was started again {self.restarts.get(role, 0)} times already (ray.restart_lost_shards)"
        return None

    def _restart_shard(self, child: RemoteChild) -> None:
        """A shard lost with its node starts again on another node from its last checkpoint
        (``--resume``). A follower registers with shard 0, which rolls every shard back to their
        last common checkpoint; the workers join again and learn its new address. Shard 0 tells
        the followers to roll back to its checkpoint and where it is now, and the workers and
        the evaluator, which hold its old address, start again pointed at the new one."""
        group = self.ray_group
        k = int(child.role.split("-")[1])
        n = self.restarts[child.role] = self.restarts.get(child.role, 0) + 1
        log.warning("%s was lost with its node: starting it again from its last checkpoint (restart %d)",
                    child.role, n)
        group.retire(child)
        args = [*self._common(Path()), "--shard", str(k), "--port", "0", *self._host(k), "--resume",
                *(["--coordinator", self.shard_endpoints[0]] if k else [])]
        again = group.start(child.role, "ps_server.cli", args, self._role_env("shard"), "shard", self.startup_timeout_s,
                            log_name=f"{child.role}.restart-{n}.log")
        self.shard_endpoints[k] = group.wait_endpoint(again, self.startup_timeout_s)
        if k == 0:
            self._restart_clients(n)

    def _restart_clients(self, n: int) -> None:
        """Workers and the evaluator keep no state the job needs (the resumed coordinator plans
        from its checkpoint and waits for cluster.num_workers to join): each live one stops,
        its records come back, and it starts again on a node Ray picks, at shard 0's new address."""
        group, ep0 = self.ray_group, self.shard_endpoints[0]
        clients = [c for c in group.children if (c.role.startswith("worker-") or c.role == "evaluator")
                   and c.proc.poll() is None]
        group.stop_and_retire(clients)
        for c in clients:
            if c.role == "evaluator":
                module, role, args = "ps_worker.evaluator_cli", "evaluator", self._evaluator_args(Path(), ep0)
            else:
                i = int(c.role.split("-")[1])
                module, role, args = "ps_worker.cli", "worker", self._worker_args(Path(), ep0, i)
            group.start(c.role, module, args, self._role_env(role), role, self.startup_timeout_s,
                        log_name=f"{c.role}.restart-{n}.log")

    def _raise_if_a_child_failed(self) -> None:
        failed = self.ray_group.failed()
        if failed is not None and failed.proc.returncode == LOST and failed.role.startswith("shard-"):
            why = self._restartable(failed)
            if why is None:
                self._restart_shard(failed)
                return
            raise RunFailed(f"{failed.role} was lost with its node and cannot be started again: {why}; "
                            f"last lines:\n{failed.tail()}")
        if failed is not None:
            what = "was lost with its node" if failed.proc.returncode == LOST else \
                f"exited with code {failed.proc.returncode}"
            raise RunFailed(f"{failed.role} {what}; last lines:\n{failed.tail()}")
