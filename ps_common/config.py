"""Typed, validated job configuration: defaults < YAML < environment < CLI ``--set`` flags.

One frozen pydantic model per component. Unknown keys and bad values are errors that name the
dotted key (``training.global_batch``) and, for enumerations, the allowed values.
Environment overrides look like ``LBBSP__TRAINING__GLOBAL_BATCH=256``; CLI overrides like
``--set training.global_batch=256``; both take YAML scalars.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ps_common.errors import PsError
from ps_common.registry import Registry
from ps_common.scenario import ScenarioConfig
from ps_common.security.settings import SecurityConfig

ENV_PREFIX = "LBBSP__"


class ConfigError(PsError, ValueError):
    """A configuration problem, with a message that names the key."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(StrictModel):
    name: str = "run"
    seed: int = 0
    run_dir: str = "runs"


class ModelConfig(StrictModel):
    # The name is checked against ps_ml's model registry by whoever loads the config to run
    # servers (ps_server.job_config); a worker building an unknown model gets the same error.
    name: str = Field("lenet", min_length=1)


class DataConfig(StrictModel):
    dataset: Literal["mnist", "synthetic"] = "mnist"
    cache_dir: Optional[str] = None
    synthetic_train: int = Field(4096, gt=0)
    synthetic_test: int = Field(1024, gt=0)


class OptimizerConfig(StrictModel):
    name: Literal["sgd"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    nesterov: bool = False


class TrainingConfig(StrictModel):
    global_batch: int = Field(128, gt=0)
    min_batch: int = Field(1, gt=0, description="x_min: floor of any worker's batch size")
    max_batch: Optional[int] = Field(None, gt=0, description="x_max: cap of any worker's batch size")
    memory_caps: dict[str, int] = Field(default_factory=dict, description=(
        "known memory caps, by worker name (ps-launch names them worker-0, worker-1, ...): the "
        "largest batch each may get; caps are also learned from out-of-memory errors"))
    oom_margin: float = Field(0.05, ge=0.0, lt=1.0, description=(
        "a cap learned from an out-of-memory error settles this fraction below the failed size"))
    max_iterations: Optional[int] = Field(None, gt=0)
    epochs: Optional[float] = Field(None, gt=0)
    max_seconds: Optional[float] = Field(None, gt=0)
    target_accuracy: Optional[float] = Field(None, gt=0, le=1)
    reject_nonfinite: bool = True
    finish_timeout_s: float = Field(
        60.0, gt=0, description="after the stop, how long shard 0 waits for workers and the "
                                "evaluator to collect the final version before every shard exits")


class ClusterConfig(StrictModel):
    num_shards: int = Field(1, ge=1, le=64)
    num_workers: int = Field(2, ge=1)
    host: str = "127.0.0.1"
    transport: Literal["tcp", "ipc"] = Field(
        "tcp", description="ps-launch: shards listen on TCP (cluster.host) or on Unix sockets (ipc://, "
                           "one host only, less overhead per message)")
    shard_threads: int = Field(1, ge=1, le=256, description=(
        "torch threads of each shard's update and finiteness check (ps-server): more pay only where "
        "every shard has cores of its own; ps-server lets them sleep between updates "
        "(OMP_WAIT_POLICY=PASSIVE, unless the environment sets a policy)"))


class ModeConfig(StrictModel):
    """A mode names one sync policy and one batch policy. Their registries live above this
    package (``ps_server.sync``, ``batchsize_manager``), so the names are checked where those
    are loaded: the servers and the launcher pass a ``check`` to :func:`load_config`."""

    sync: str = Field("bsp", min_length=1, description="sync policy (ps_server.sync.SYNC_POLICIES)")
    staleness: int = Field(5, ge=0, description="SSP bound s")
    backup_workers: int = Field(1, ge=1, description="b for sync=backup: N + b workers run")
    reassign_chunks: int = Field(8, ge=2, description=(
        "sync=flexrr: each worker's share is cut into this many chunks; a worker done with its own "
        "takes a straggler's last unclaimed chunk, one claim (a round trip to shard 0) per chunk"))
    batch_policy: str = Field("uniform", min_length=1, description="batch policy (batchsize_manager)")
    batch_policy_args: dict[str, Any] = Field(default_factory=dict)
    plan_ahead: bool = Field(
        True, description="decide the next split while the workers compute, from the reports known "
                          "then (one iteration older), so the batch policy never delays a commit")


class WorkerConfig(StrictModel):
    device: str = "cpu"
    torch_threads: int = Field(1, ge=1)
    memory_limit_mb: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description=(
        "memory this worker may use for training, enforced for real: on CUDA a per-process memory "
        "fraction, on a CPU an address-space limit (RLIMIT_AS) above what the process holds when "
        "training starts. A pass that does not fit is retried with a smaller share of its samples. "
        "scenario.workers[i].memory_limit_mb overrides it per worker"))
    memory_headroom: bool = Field(True, description=(
        "with a memory limit, report each iteration's headroom and memory per sample, from which "
        "the manager caps this worker before it runs out of memory"))
    memory_probe: bool = Field(False, description=(
        "before joining, find the largest batch that fits (doubling, then binary search) and "
        "tell the coordinator, so no iteration fails on it (CUDA workers, and CPU workers with "
        "a memory limit)"))

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and v != "auto" and not v.startswith("cuda"):
            raise ValueError("device must be 'cpu', 'auto' or 'cuda[:N]'")
        return v


class EvaluatorConfig(StrictModel):
    """The evaluator measures exactly versions 0, k, 2k, ... from the shards' snapshots. It runs
    at a lower CPU priority (``nice``), so on a busy host it yields to training and falls behind
    instead of slowing the workers; ``snapshots`` bounds how far (in versions of k) before a
    version is skipped."""

    enabled: bool = True
    every_iterations: int = Field(50, gt=0)
    test_samples: Optional[int] = Field(None, gt=0)
    batch: int = Field(64, gt=0, description=(
        "test samples per forward pass; larger is slower on a CPU once the activations leave the "
        "cache (one thread, 10,000 MNIST test samples: LeNet 0.21 s at 64, 0.28 s at 1000; the "
        "1.2M-parameter CNN 1.5 s at 64, 3.6 s at 1000)"))
    nice: int = Field(19, ge=0, le=19, description=(
        "CPU niceness of the evaluator process. 19 (default) also makes it SCHED_IDLE: it yields to "
        "training (which still loses some speed to it), and on a saturated host it measures in "
        "the gaps, so a target_accuracy stop comes when its measurement does, after training "
        "moved on (time to accuracy is unaffected: it is the measured version's time). 0: as "
        "training (prompt stop, slower training)."))
    snapshots: int = Field(32, ge=1, le=1024, description="parameter snapshots each shard keeps for it")
    pause_training: bool = Field(False, description=(
        "hold the workers at every measured version until the evaluator has reported it (the job "
        "starts once the evaluator has joined: version 0 is measured first), and stop "
        "the training clock meanwhile (as a training loop that evaluates between steps does): on a "
        "host that training saturates, the evaluator then costs the workers nothing, a "
        "target_accuracy stop comes at the measured version, and iteration times, elapsed and "
        "time to accuracy leave the pauses out (the summary shows their total). Round and async "
        "modes; work already assigned finishes during a pause."))
    pause_timeout_s: float = Field(30.0, gt=0, description=(
        "the longest pause: a measurement that has not arrived by then (the evaluator is gone or "
        "stuck) lets training go on, and no pause is taken until a report arrives again"))


class HeartbeatConfig(StrictModel):
    interval_s: float = Field(0.5, gt=0, description="how often workers send a heartbeat")
    timeout_s: float = Field(5.0, gt=0, description="silence after which a worker is declared lost")


class ElasticConfig(StrictModel):
    """What happens to the global batch when workers join or leave (round modes).

    keep=global_batch (default): X stays constant and is re-split; nothing else changes.
    keep=worker_batch: every worker keeps ``worker_batch`` samples, so X follows the number of
    live workers, and the learning rate follows X by linear scaling (Goyal et al. 2017), ramped
    over ``ramp_iterations``. Momentum needs no separate correction here: the optimizer keeps
    the raw gradient average in its buffer and applies the learning rate outside it, which is
    what Goyal et al.'s momentum correction restores for the lr-inside formulation.
    """

    keep: Literal["global_batch", "worker_batch"] = "global_batch"
    worker_batch: Optional[int] = Field(None, gt=0, description="default: global_batch / num_workers")
    lr_rule: Literal["linear", "none"] = "linear"
    ramp_iterations: int = Field(0, ge=0)


class CheckpointConfig(StrictModel):
    dir: Optional[str] = Field(None, description="default: RUN_DIR/checkpoints")
    every_iterations: Optional[int] = Field(None, gt=0)
    every_seconds: Optional[float] = Field(None, gt=0)
    keep: int = Field(3, ge=2, description="checkpoints kept per shard (>= 2 for rollbacks)")


class TransportConfig(StrictModel):
    """Timeouts and the bounds on what one peer can make a server hold (each one counted when hit)."""

    timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(60.0, gt=0)
    hwm: int = Field(100, ge=1, description="ZeroMQ high-water mark (messages) per peer and direction")
    max_pending_pulls_per_peer: int = Field(4, ge=1, description="waiting pulls per connection, and per worker id")
    max_pending_pulls: int = Field(256, ge=1, description="waiting pulls without a worker id (evaluator, "
                                                          "observers), all connections together")
    max_frames: int = Field(4, ge=1, description="frames per message")
    shard_sync_s: float = Field(1.0, gt=0, description="how often a follower shard reports to shard 0")
    params_part_bytes: int = Field(
        4 << 20, ge=0, description="a shard sends a new version's slice to the workers in parts of this "
                                   "many bytes (0, or at least 4096; at most hwm / 2 parts), each as soon as "
                                   "the update has computed it, so the transfer overlaps the rest of the "
                                   "update; 0: whole, once the update is done")

    @field_validator("params_part_bytes")
    @classmethod
    def _part_floor(cls, v: int) -> int:
        if 0 < v < 4096:
            raise ValueError("must be 0 (whole answers) or at least 4096 bytes")
        return v


class RayConfig(StrictModel):
    """``ps-launch --backend ray``: what each process asks Ray for. Custom resources double as
    node labels (a node started with ``--resources '{"gpu_a100": 4}'`` is the only one that
    satisfies ``worker_resources: {gpu_a100: 1}``)."""

    shard_cpus: float = Field(1.0, ge=0)
    shard_resources: dict[str, float] = Field(default_factory=dict)
    spread_shards: bool = Field(True, description="a placement group spreads the shards over nodes")
    worker_cpus: float = Field(1.0, ge=0)
    worker_gpus: float = Field(0.0, ge=0)
    worker_memory_mb: Optional[float] = Field(None, gt=0)
    worker_resources: dict[str, float] = Field(default_factory=dict)
    evaluator_cpus: float = Field(0.5, ge=0)
    evaluator_resources: dict[str, float] = Field(default_factory=dict)
    records_every_s: float = Field(2.0, gt=0, description="how often the driver brings back new log lines "
                                                          "and metrics records")
    restart_lost_shards: int = Field(
        3, ge=0, description="times a shard lost with its node is started again elsewhere from its last "
                             "checkpoint (needs checkpoint.dir on storage every node shares)")


class SlurmRole(StrictModel):
    """What each task of one role asks Slurm for (its step's options, or with ``hetjob`` its
    component's)."""

    cpus: int = Field(1, ge=1, description="--cpus-per-task")
    mem_mb: Optional[int] = Field(None, ge=1, description="memory per task (as --mem-per-cpu of its share)")
    gpus: int = Field(0, ge=0, description="--gpus-per-task")
    partition: Optional[str] = Field(None, min_length=1)
    constraint: Optional[str] = Field(None, min_length=1, description="--constraint: node features")


class SlurmConfig(StrictModel):
    """``ps-launch --backend slurm --print``: what shards, workers and the evaluator each ask for
    (CPUs, memory, GPUs per task, partition, node features)."""

    shard: SlurmRole = SlurmRole()
    worker: SlurmRole = SlurmRole()
    evaluator: SlurmRole = SlurmRole()
    hetjob: bool = Field(False, description=(
        "one heterogeneous job, a component per role, each with exactly its own resources and "
        "partition; else one allocation sized for the largest role and one step per role (needs "
        "one partition and one constraint for all roles)"))

    @model_validator(mode="after")
    def _one_place_unless_hetjob(self) -> "SlurmConfig":
        if not self.hetjob:
            for what in ("partition", "constraint"):
                named = {getattr(getattr(self, r), what) for r in ("shard", "worker", "evaluator")} - {None}
                if len(named) > 1:  # one named is the whole allocation's
                    raise ValueError(f"roles name different {what}s ({', '.join(sorted(named))}): one "
                                     "allocation has one; set slurm.hetjob: true for a component per role")
        return self


class JobConfig(StrictModel):
    """The whole job. Cross-field rules are checked here so errors still name the key."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    cluster: ClusterConfig = ClusterConfig()
    mode: ModeConfig = ModeConfig()
    worker: WorkerConfig = WorkerConfig()
    evaluator: EvaluatorConfig = EvaluatorConfig()
    transport: TransportConfig = TransportConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    elastic: ElasticConfig = ElasticConfig()
    scenario: ScenarioConfig = ScenarioConfig()
    security: SecurityConfig = SecurityConfig()  # per host: not part of the job digest
    ray: RayConfig = RayConfig()                 # how ps-launch --backend ray places processes
    slurm: SlurmConfig = SlurmConfig()           # what ps-launch --backend slurm asks for per role

    @model_validator(mode="after")
    def _cross_checks(self) -> "JobConfig":
        if self.cluster.transport == "ipc" and self.scenario.needs_hosts(self.cluster.num_workers):
            raise ValueError("cluster.transport=ipc cannot reach processes on lab hosts "
                             "(scenario links or hosts): use tcp")
        if self.evaluator.pause_training and self.evaluator.pause_timeout_s >= self.transport.timeout_s:
            raise ValueError(
                f"evaluator.pause_timeout_s ({self.evaluator.pause_timeout_s}) must be below "
                f"transport.timeout_s ({self.transport.timeout_s}): a worker whose pull waits that "
                "long gives up")
        shared = [i for i, w in enumerate(self.scenario.workers) if w.gpu_sm_percent is not None]
        if shared and self.worker.device == "cpu":
            raise ValueError(f"scenario.workers[{shared[0]}].gpu_sm_percent is a share of a GPU, and "
                             "worker.device is cpu: set worker.device to cuda (or auto)")
        if self.training.global_batch < self.cluster.num_workers * self.training.min_batch:
            raise ValueError(
                f"training.global_batch ({self.training.global_batch}) is below cluster.num_workers "
                f"x training.min_batch ({self.cluster.num_workers} x {self.training.min_batch})")
        return self

    def job_spec(self) -> dict[str, Any]:
        """The part every process of one job must agree on (checked by digest at join)."""
        d = self.model_dump(mode="json")
        return {"seed": d["run"]["seed"], **{k: d[k] for k in ("model", "data", "optimizer",
                                                               "training", "mode", "scenario",
                                                               "elastic")},
                "num_shards": d["cluster"]["num_shards"]}

    def job_digest(self) -> str:
        blob = json.dumps(self.job_spec(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_overrides(self, overrides: Sequence[str]) -> "JobConfig":
        data = self.model_dump(mode="json")
        _apply_overrides(data, overrides, source="--set")
        return validate(data, source="overrides")


def _apply_overrides(data: dict[str, Any], items: Sequence[str], *, source: str) -> None:
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{source}: expected KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw), source)


def _set_dotted(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = [p for p in key.split(".") if p]
    if not parts:
        raise ConfigError(f"{source}: empty key")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {key}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> list[str]:
    out = []
    for name, raw in sorted(env.items()):
        if name.startswith(ENV_PREFIX):
            key = ".".join(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
            out.append(f"{key}={raw}")
    return out


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if key and "input" in err and err["type"] != "missing":
                msg += f" (got {err['input']!r})"
            lines.append(f"  {key}: {msg}" if key else f"  {msg}")
    return "\n".join(lines)


def validate(data: Mapping[str, Any], *, source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


#: A check a higher package adds to loading: ``check(cfg, source)`` raises :class:`ConfigError`.
ConfigCheck = Callable[[JobConfig, str], object]


def check_names(cfg: JobConfig, registries: Mapping[str, Registry[Any]], *, source: str = "config") -> None:
    """Each dotted key's value must be a name in its registry (``{"mode.sync": SYNC_POLICIES}``).

    For names whose registry lives above this package: the package that has it checks them
    where it loads the config, with the same message as any other bad value (the key, the
    known names, what was given)."""
    problems = []
    for key, registry in registries.items():
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        try:
            registry.get(value)
        except ValueError as exc:
            problems.append(f"{key}: {exc} (got {value!r})")
    if problems:
        raise ConfigError("\n".join([f"invalid configuration ({source}):", *(f"  {p}" for p in problems)]))


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                env: Mapping[str, str] | None = None, *, check: ConfigCheck | None = None) -> JobConfig:
    """Load, merge and validate a job config; raises :class:`ConfigError` naming the key.

    ``check``: what the caller's package validates beyond this schema (the names of its
    registries), run on the merged config before it is returned."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            loaded = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded
        _resolve_key_paths(data, p.parent)
    _apply_overrides(data, _env_overrides(os.environ if env is None else env), source="environment")
    _apply_overrides(data, overrides, source="--set")
    cfg = validate(data, source=source)
    if check is not None:
        check(cfg, source)
    if path is not None:  # trace files named relative to the config file
        cfg = cfg.model_copy(update={"scenario": cfg.scenario.resolved(Path(path).parent)})
    return cfg


#: ``security`` keys that name files or directories.
SECURITY_PATH_KEYS = ("server_secret_key", "server_public_key", "client_secret_key", "allowed_clients_dir",
                      "client_keys_dir", "secret_file")


def _resolve_key_paths(data: dict[str, Any], base: Path) -> None:
    """Relative key and secret paths written in a config file name files beside it, whatever
    directory a process is started from (one file serves every host); paths given with --set
    or the environment stay relative to the working directory, where they were typed."""
    sec = data.get("security")
    if not isinstance(sec, dict):
        return
    for key in SECURITY_PATH_KEYS:
        v = sec.get(key)
        if isinstance(v, str) and v:
            p = Path(os.path.expanduser(v))
            if not p.is_absolute():
                sec[key] = str((base / p).resolve())


def dump_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
