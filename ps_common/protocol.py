"""The wire format: the one module that knows how messages look on the wire.

A message is a list of ZeroMQ frames: one header frame, then zero or more raw array frames.
The header frame is ``MAGIC + VERSION byte + msgpack(map)``; the map holds the message type
(``"t"``), the message's typed fields, and ``"arrays"``: one ``[dtype, shape]`` entry per array
frame that follows. Arrays travel as raw bytes (zero-copy on send; read-only ``np.frombuffer``
views on receive). Nothing on the wire is ever pickled.

Every decode checks magic, version, type, field types and ranges, array count, dtypes and
sizes, and raises :class:`ProtocolError` with a message that says what was wrong. Only this
module imports msgpack.

A worker's report travels as :class:`~ps_common.report.Telemetry` (in ``Push`` and
``BsmReport``): the one definition of what a worker measures, with the unit and the range of
every field; this module encodes it, and refuses on decode any field that is unknown, of the
wrong type, not finite or out of its range.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence, Union

import msgpack
import numpy as np

from ps_common.errors import PsError
from ps_common.frozen import fill, plain_defaults
from ps_common.report import Telemetry

MAGIC = b"LBPS"
VERSION = 13
HEADER_PREFIX = MAGIC + bytes([VERSION])
MAX_HEADER_BYTES = 1 << 20
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<i8", "<i4", "|u1"})


class ProtocolError(PsError, ValueError):
    """A frame list that is not a valid message of this protocol version."""


# ---------------------------------------------------------------------------------------------
# Message classes. Field types are checked on decode from the annotations below, so the
# annotations are the schema: keep them to int, float, bool, str, list[...], dict[str, ...],
# Optional[...] and nested message-part dataclasses. A field whose metadata holds
# ``range: (lo, hi)`` must also be a finite number within it (``Telemetry``'s fields do).
# ---------------------------------------------------------------------------------------------


@dataclass
class Message:
    """Base of every message kind; ``TYPE`` is the string sent on the wire."""

    TYPE: ClassVar[str] = ""
    ARRAYS: ClassVar[tuple[int, int]] = (0, 0)  # (min, max) number of array frames
    arrays: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)


@dataclass
class Assignment:
    """What a worker trains on next: its batch size and the sample ranges of the global order.

    ``ranges`` holds ``[epoch, start, stop]`` triples into ``sample_order(seed, epoch, n)``.
    With ``chunked`` (sync=flexrr) they are only the first chunk of the worker's share: it asks
    the coordinator for each further chunk (:class:`TakeChunk`) and pushes once none is left.
    """

    iteration: int
    batch_size: int
    ranges: list[list[int]]
    global_batch: int
    chunked: bool = False


@dataclass
class Plan:
    """Round modes: the gradients that iteration ``iteration`` is waiting for.

    The coordinator sends it to every follower shard (inside the previous iteration's Commit),
    so a follower checks each push against it: the worker is in the plan, with this batch size.
    """

    iteration: int
    workers: list[int]
    batch_sizes: list[int]
    #: the iteration's global batch X as it was planned (protocol 11): the batch sizes of the
    #: workers still in the plan add up to less once a worker was lost, and a flexrr helper that
    #: took the lost worker's chunks pushes more than they add up to. 0: their sum
    total: int = 0


@dataclass
class Hello(Message):
    """A client checks the protocol version and learns the topology size; it authorizes nothing."""

    TYPE: ClassVar[str] = "hello"
    name: str = ""


@dataclass
class HelloReply(Message):
    TYPE: ClassVar[str] = "hello_reply"
    shard: int = 0
    num_shards: int = 1


@dataclass
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    what: str = ""


@dataclass
class Join(Message):
    """A worker (or the evaluator, as an observer) asks the coordinator to join the job.

    ``instance`` is random per process: a second Join from the same process (after a timeout)
    replaces its first membership instead of adding one.
    """

    TYPE: ClassVar[str] = "join"
    name: str = ""
    instance: str = ""
    job_digest: str = ""
    device: str = "cpu"
    memory_fits: int = 0   # a start-up memory probe: the largest batch that fitted (0: not probed)
    memory_fails: int = 0  # ... and the smallest that did not (0: none failed)


@dataclass
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    worker_id: int = 0
    shard_endpoints: list[str] = field(default_factory=list)
    shard_ranges: list[list[int]] = field(default_factory=list)
    num_params: int = 0
    version: int = 0
    job: dict[str, Any] = field(default_factory=dict)
    token: str = ""  # the worker's membership secret: every push, heartbeat and leave carries it
    consistent_pulls: bool = True  # the sync mode's: one version on every shard, or each one's newest


@dataclass
class Heartbeat(Message):
    """Worker -> coordinator, every ``heartbeat.interval_s``; the reply is the coordinator's beat."""

    TYPE: ClassVar[str] = "heartbeat"
    worker_id: int = 0
    token: str = ""


@dataclass
class HeartbeatReply(Message):
    TYPE: ClassVar[str] = "heartbeat_reply"
    incarnation: str = ""  # changes when the coordinator restarts
    version: int = 0
    stop: bool = False


@dataclass
class Leave(Message):
    TYPE: ClassVar[str] = "leave"
    worker_id: int = 0
    token: str = ""
    reason: str = ""


@dataclass
class Push(Message):
    """A worker's mean gradient over its ``batch_size`` samples for this shard's slice.

    Nothing here sets the plan: the shard checks (worker, token, iteration, batch size) against
    what the coordinator committed. With ``pull`` the reply is this shard's parameters once
    they include iteration ``iteration`` (one round trip per iteration).
    """

    TYPE: ClassVar[str] = "push"
    ARRAYS: ClassVar[tuple[int, int]] = (1, 1)
    worker_id: int = 0
    token: str = ""
    iteration: int = 0
    batch_size: int = 0
    loss: float = 0.0
    telemetry: Union[Telemetry, None] = None  # the worker's report of the iteration: shard 0 only
    pull: bool = False


@dataclass
class OutOfMemory(Message):
    """Worker -> coordinator: its assignment of ``iteration`` (``batch_size`` samples) did not fit
    in memory; nothing of it was pushed. The answer is a :class:`Reassignment` (a prefix of the
    same sample ranges; the rest go back to the data cursor) or an Error (``cannot_fit`` when a
    single sample failed)."""

    TYPE: ClassVar[str] = "out_of_memory"
    worker_id: int = 0
    token: str = ""
    iteration: int = 0
    batch_size: int = 0


@dataclass
class TakeChunk(Message):
    """Worker -> coordinator (sync=flexrr): it is done with the samples granted so far in
    ``iteration``; grant it the next chunk, its own or a straggler's. The answer is a
    :class:`Chunk`."""

    TYPE: ClassVar[str] = "take_chunk"
    worker_id: int = 0
    token: str = ""
    iteration: int = 0


@dataclass
class Chunk(Message):
    """The next chunk to compute (``owner``: whose share it was), or none (``ranges`` empty):
    push the sum over every chunk granted, ``batch_size`` samples in all."""

    TYPE: ClassVar[str] = "chunk"
    iteration: int = 0
    owner: int = -1
    ranges: list[list[int]] = field(default_factory=list)
    batch_size: int = 0  # samples granted to this worker in the iteration, this chunk included


@dataclass
class Reassignment(Message):
    TYPE: ClassVar[str] = "reassignment"
    assignment: Union[Assignment, None] = None


@dataclass
class Pull(Message):
    """Ask for this shard's parameters once ``version >= min_version`` (and the policy allows)."""

    TYPE: ClassVar[str] = "pull"
    worker_id: int = -1
    token: str = ""  # a worker's membership token (worker_id >= 0)
    min_version: int = 0
    exact: bool = False  # observers: exactly ``min_version``, from the shard's snapshots


@dataclass
class Params(Message):
    """A shard's slice at ``version``, whole (``parts`` 1) or as one of ``parts`` messages that
    carry consecutive pieces of it, each starting at element ``offset``, in order: a shard
    sends each piece of a new version as soon as its update has computed it, so the transfer
    overlaps the rest of the update (``transport.params_part_bytes``). Every part repeats the
    header fields; only the first (offset 0) carries the assignment."""

    TYPE: ClassVar[str] = "params"
    ARRAYS: ClassVar[tuple[int, int]] = (1, 1)
    shard: int = 0
    version: int = 0
    version_time: float = 0.0
    samples: int = 0  # samples whose gradients made up this version (sum of applied x_i)
    stop: bool = False
    assignment: Union[Assignment, None] = None
    log_hash: str = ""  # digest of every commit applied up to this version
    offset: int = field(default=0, metadata={"range": (0, 1 << 40)})
    parts: int = field(default=1, metadata={"range": (1, 1 << 20)})


# ----- shard control: follower <-> coordinator (over the follower's link to shard 0) ----------


@dataclass
class ClaimShard(Message):
    """A follower started without an index (the dmlc contract: ``DMLC_ROLE=server``) asks the
    coordinator for one. The same ``instance`` always gets the same index."""

    TYPE: ClassVar[str] = "claim_shard"
    job_digest: str = ""
    instance: str = ""


@dataclass
class ShardClaimed(Message):
    TYPE: ClassVar[str] = "shard_claimed"
    shard: int = 0


@dataclass
class RegisterShard(Message):
    """Follower shard k tells the coordinator where workers reach it and where it stands."""

    TYPE: ClassVar[str] = "register_shard"
    shard: int = 0
    endpoint: str = ""
    job_digest: str = ""
    version: int = 0
    log_hash: str = ""
    #: started from a checkpoint and not yet at the job's version since: the gradients it held
    #: are gone, so the job rolls back (said until a registration at the job's version or an
    #: applied Rollback, not again when it registers with a restarted shard 0)
    resumed: bool = False
    #: the follower's own checkpoints, oldest first, and the log hash each was written at: a
    #: resumed follower goes back to the newest one whose history is shard 0's
    checkpoint_versions: list[int] = field(default_factory=list)
    checkpoint_hashes: list[str] = field(default_factory=list)
    #: random per registration, the same in its retries: a retry whose first attempt shard 0
    #: handled (its answer came late) is answered again instead of handled twice
    registration: str = ""


@dataclass
class Registered(Message):
    """The coordinator's answer: the key that worker tokens derive from, and what to collect."""

    TYPE: ClassVar[str] = "registered"
    member_key: str = ""
    incarnation: str = ""
    version: int = 0
    plan: Union[Plan, None] = None
    stop_version: int = -1
    #: the number of the last Rollback the coordinator sent (any follower): every Rollback this
    #: follower receives after this reply has a higher one. The follower echoes the last it
    #: applied in its ShardSync, so that a beat sent before a Rollback arrived is not taken for
    #: a follower ahead of the coordinator
    rollback_epoch: int = 0


@dataclass
class Have(Message):
    """Follower -> coordinator: these gradients arrived here whole (``[worker, iteration, x]``)."""

    TYPE: ClassVar[str] = "have"
    shard: int = 0
    entries: list[list[int]] = field(default_factory=list)
    rollback_epoch: int = 0  # as in ShardSync: gradients of a follower behind a Rollback are not counted


@dataclass
class ShardSync(Message):
    """Follower -> coordinator, every second and whenever it waits for a commit: where it
    stands and what it holds. Repairs a lost Have or Commit; doubles as a liveness beat."""

    TYPE: ClassVar[str] = "shard_sync"
    shard: int = 0
    version: int = 0
    log_hash: str = ""
    entries: list[list[int]] = field(default_factory=list)
    rollback_epoch: int = 0  # the last Rollback's (or Registered's) epoch this follower applied


@dataclass
class Commit(Message):
    """Coordinator -> followers: version ``version`` is exactly these gradients, aggregated as
    sum(x_i g_i) / sum(x_i) and applied with learning-rate scale ``lr_scale``.

    Every shard applies the same commits in the same order; ``log_hash`` is the digest the
    coordinator got after applying it, so a follower that disagrees stops instead of
    diverging. ``drops`` names gradients that will never be applied: [worker, iteration] at any
    size, [worker, iteration, batch_size] only at that size.
    """

    TYPE: ClassVar[str] = "commit"
    version: int = 0
    iteration: int = 0
    entries: list[list[int]] = field(default_factory=list)  # [worker, batch_size]
    lr_scale: float = 1.0
    drops: list[list[int]] = field(default_factory=list)
    next_plan: Union[Plan, None] = None
    log_hash: str = ""
    checkpoint: bool = False  # write a checkpoint once applied (the cut is the same everywhere)
    #: SSP: the slowest live worker's committed clock once this commit is applied (0 in other
    #: modes): every commit carries it, so a lost ``Clocks`` never outlives the next commit
    slowest_clock: int = field(default=0, metadata={"range": (0, 1 << 62)})


@dataclass
class PlanMessage(Message):
    """Coordinator -> followers: a plan made outside a commit (start, re-plan after losses)."""

    TYPE: ClassVar[str] = "plan"
    plan: Union[Plan, None] = None


@dataclass
class Stop(Message):
    """Coordinator -> followers: the job ends at ``version``; answer pulls with stop there."""

    TYPE: ClassVar[str] = "stop"
    version: int = 0
    reason: str = ""


@dataclass
class Clocks(Message):
    """Coordinator -> followers (SSP): at version ``version``, the slowest live worker's
    committed clock is now ``slowest_clock``. A follower at that version holds a worker's next
    parameters by the rule shard 0 holds its assignment with, so that no slice is staler than
    the bound. Commits carry the value too; this says it when it changes between commits (the
    slowest worker left, or workers joined an empty job), and on every beat."""

    TYPE: ClassVar[str] = "clocks"
    version: int = 0
    slowest_clock: int = field(default=0, metadata={"range": (0, 1 << 62)})


@dataclass
class Finish(Message):
    """Coordinator -> followers: everyone has the final version; write results and exit."""

    TYPE: ClassVar[str] = "finish"
    reason: str = ""


@dataclass
class Rollback(Message):
    """Coordinator -> followers: go back to your checkpoint at ``version`` (a shard restarted)."""

    TYPE: ClassVar[str] = "rollback"
    version: int = 0
    coordinator: str = ""  # sent by a restarted shard 0 to a follower's own socket: its new address
    #: shard 0's log hash at ``version``: a follower whose checkpoint there holds another history
    #: stops instead of restoring it ("": not checked)
    log_hash: str = ""
    epoch: int = 0         # this Rollback's number: higher than any sent before (see Registered)


@dataclass
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status_request"


@dataclass
class Status(Message):
    """A shard's view of the run; the coordinator's also covers the whole job."""

    TYPE: ClassVar[str] = "status"
    shard: int = 0
    version: int = 0
    log_hash: str = ""
    iterations: float = 0.0  # progress in global batches (X-sample equivalents in async modes)
    epoch: int = 0
    samples: int = 0
    workers: int = 0
    stop: bool = False
    stop_reason: str = ""
    started: bool = False
    elapsed: float = 0.0
    last_accuracy: float = -1.0
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class EvalReport(Message):
    """The evaluator's measurement, so the coordinator can stop at a target accuracy.

    ``final`` marks the measurement of the final version. ``token`` is the one the evaluator's
    Welcome gave it (protocol 12): a job counts one evaluator's reports, the latest to join and report. A
    report of a version not reached, of another history, or with an accuracy outside [0, 1] is
    acknowledged and set aside. The Ack of a final report says ``eval_final_done`` when shard 0
    finishes on it; otherwise the evaluator stays until shard 0 is gone, in case a rollback
    needs the new history's final version measured.
    """

    TYPE: ClassVar[str] = "eval_report"
    version: int = 0
    samples: int = 0
    accuracy: float = 0.0
    loss: float = 0.0
    final: bool = False
    #: the log hash of the version measured (protocol 11): a measurement of a history that a
    #: rollback abandoned names a version the new history reached too, and must not count there
    log_hash: str = ""
    token: str = ""


@dataclass
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str = ""
    message: str = ""


# ----- batch-size manager service (ps-bsm, ps_server/bsm_service.py) ----------------------
# A BatchSizeManager served over this protocol, for training loops in other processes or
# frameworks. A join is answered with the worker's token (BsmWelcome), leave and report, which
# must carry it, with Ack; errors with Error.


@dataclass
class BsmJoin(Message):
    """A worker became live: it gets a share of the global batch from the next assignment on.

    Joining an id that is live already is a restart of that worker: the answer carries a fresh
    token and the one given before is void."""

    TYPE: ClassVar[str] = "bsm_join"
    worker_id: int = -1


@dataclass
class BsmWelcome(Message):
    """The answer to :class:`BsmJoin`: ``token`` proves the worker in its leave and reports."""

    TYPE: ClassVar[str] = "bsm_welcome"
    worker_id: int = -1
    token: str = ""


@dataclass
class BsmLeave(Message):
    """A worker left or was declared lost (unknown ids are acknowledged and ignored).

    A live worker's leave carries its token; the operator role may evict without one."""

    TYPE: ClassVar[str] = "bsm_leave"
    worker_id: int = -1
    token: str = ""


@dataclass
class BsmReport(Message):
    """One worker's measurements of one finished iteration (a ``WorkerReport`` on the wire),
    with the worker's token."""

    TYPE: ClassVar[str] = "bsm_report"
    worker_id: int = -1
    token: str = ""
    iteration: int = 0
    batch_size: int = 0
    telemetry: Telemetry = Telemetry()


@dataclass
class BsmAssign(Message):
    """Ask for the next split of the global batch over the live workers."""

    TYPE: ClassVar[str] = "bsm_assign"


@dataclass
class BsmAssignment(Message):
    """``batch_sizes[i]`` is the next batch of ``workers[i]``; they sum to ``global_batch``.

    ``decision_s`` is the manager's own decision time (the reports observed since the previous
    assignment plus this one), so its overhead can be set against the iteration time.
    """

    TYPE: ClassVar[str] = "bsm_assignment"
    workers: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    global_batch: int = 0
    decision_s: float = 0.0


@dataclass
class BsmStats(Message):
    """Ask for the service's counters; ``include_state`` adds the manager's ``state_dict()``."""

    TYPE: ClassVar[str] = "bsm_stats"
    include_state: bool = False


@dataclass
class BsmStatsReply(Message):
    TYPE: ClassVar[str] = "bsm_stats_reply"
    policy: str = ""
    global_batch: int = 0
    min_batch: int = 1
    max_batch: Union[int, None] = None
    live: list[int] = field(default_factory=list)
    last_workers: list[int] = field(default_factory=list)
    last_batch_sizes: list[int] = field(default_factory=list)
    decisions: int = 0
    last_decision_s: float = 0.0
    mean_decision_s: float = 0.0  # NaN before the first decision
    total_decision_s: float = 0.0
    reports: int = 0          # reports accepted and fed to the manager
    ignored_reports: int = 0  # reports the manager dropped (counted by the manager)
    rejoins: int = 0          # joins of a live id (a restart, or another process under its id)
    requests: int = 0         # messages received, malformed ones included
    malformed: int = 0        # messages that did not decode
    errors_sent: int = 0      # Error replies of any kind
    uptime_s: float = 0.0
    state: dict[str, Any] = field(default_factory=dict)  # state_dict() when asked for, else {}


# ----- gradient exchange for DDP ranks (ps-bsm --world-size N) --------------------------------
# A DDP job's ranks exchange their gradients through the service instead of a ring all-reduce:
# each rank sends each bucket once and gets the batch-size-weighted mean once, and the split of
# the next iteration rides on the last bucket's answer (one round trip per bucket, no collective).


@dataclass
class ExchangeOpen(Message):
    """A rank starts (or restarts at) ``iteration``: the answer is that iteration's split and this
    rank's token (:class:`ExchangePlan`)."""

    TYPE: ClassVar[str] = "exchange_open"
    worker_id: int = -1
    iteration: int = 0
    #: the same for every rank of one start of the job, another for each restart (the DDP
    #: balancer's rank 0 draws it and broadcasts it): an open under another job than the open
    #: one's is a restart, whichever rank opens first. "": guessed from a second open by a rank
    job: str = ""


@dataclass
class ExchangePlan(Message):
    """``batch_sizes[r]`` is rank ``r``'s share of ``iteration``; ``token`` proves the rank later."""

    TYPE: ClassVar[str] = "exchange_plan"
    iteration: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    token: str = ""


@dataclass
class ExchangePush(Message):
    """One gradient bucket of one rank: the mean gradient over its ``batch_size`` samples.

    ``last`` marks the rank's last bucket of the iteration; it carries the rank's report
    (``telemetry``). The answer (:class:`ExchangeResult`) comes once every rank sent this bucket.
    """

    TYPE: ClassVar[str] = "exchange_push"
    ARRAYS: ClassVar[tuple[int, int]] = (1, 1)
    worker_id: int = -1
    token: str = ""
    iteration: int = 0
    bucket: int = 0
    last: bool = False
    batch_size: int = 0
    telemetry: Union[Telemetry, None] = None


@dataclass
class ExchangeResult(Message):
    """The bucket's weighted mean ``sum_r x_r g_r / X`` (summed in rank order). On the last bucket
    also the next iteration's split and every rank's report as the service observed it."""

    TYPE: ClassVar[str] = "exchange_result"
    ARRAYS: ClassVar[tuple[int, int]] = (1, 1)
    iteration: int = 0
    bucket: int = 0
    next_batch_sizes: list[int] = field(default_factory=list)
    reports: list[Telemetry] = field(default_factory=list)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloReply, Ack, Join, Welcome, Heartbeat, HeartbeatReply, Leave, Push, OutOfMemory,
        Reassignment, TakeChunk, Chunk, Pull, Params, ClaimShard, ShardClaimed, RegisterShard, Registered,
        Have, ShardSync,
        Commit, PlanMessage, Stop, Clocks, Finish, Rollback,
        StatusRequest, Status, EvalReport, Shutdown, Error,
        BsmJoin, BsmWelcome, BsmLeave, BsmReport, BsmAssign, BsmAssignment, BsmStats, BsmStatsReply,
        ExchangeOpen, ExchangePlan, ExchangePush, ExchangeResult,
    )
}


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


_SCALARS = (int, float, str, bool, type(None))


class _Part(typing.NamedTuple):
    names: tuple[str, ...]              # the fields that travel ("arrays" travel as frames)
    #: every field's default where the decoder fills in absent fields (plain frozen parts: a
    #: worker's report), so that fields at their defaults stay off the wire; None: all travel
    defaults: dict[str, Any] | None


_PARTS: dict[type, _Part] = {}


def _part(cls: type) -> _Part:
    part = _PARTS.get(cls)
    if part is None:
        names = tuple(f.name for f in dataclasses.fields(cls) if f.name != "arrays")
        part = _PARTS[cls] = _Part(names, plain_defaults(cls))
    return part


def _plain(value: Any) -> Any:
    """msgpack-ready data: message parts as maps, numpy scalars as Python numbers."""
    t = type(value)
    if t in _SCALARS:
        return value
    if t is list or t is tuple:
        return [v if type(v) in _SCALARS else _plain(v) for v in value]
    if t is dict:
        return {k: v if type(v) in _SCALARS else _plain(v) for k, v in value.items()}
    part = _PARTS.get(t)
    if part is None:
        if isinstance(value, np.generic):
            return value.item()
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            return value
        part = _part(t)
    if part.defaults is None:
        return _fields_plain(value, part.names)
    return _changed_fields(value, part.defaults)


def _changed_fields(obj: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of a plain frozen part (a worker's report) that differ from their defaults,
    which the decoder fills in: a report of 27 fields, most of them not measured, travels and is
    checked as the ten or so that were (a push decodes in 11 µs instead of 16 here)."""
    out = {}
    for name, d in defaults.items():
        v = getattr(obj, name)
        if v is d or (type(v) is type(d) and v == d):
            continue
        out[name] = v if type(v) in _SCALARS else _plain(v)
    return out


def _fields_plain(obj: Any, names: tuple[str, ...], out: dict[str, Any] | None = None) -> dict[str, Any]:
    """``out`` (default: a new map) with the plain value of each named field of ``obj``."""
    if out is None:
        out = {}
    for name in names:
        v = getattr(obj, name)
        out[name] = v if type(v) in _SCALARS else _plain(v)
    return out


_local = threading.local()


def _pack(body: dict[str, Any]) -> bytes:
    """``msgpack.packb(body, use_bin_type=True)`` with this thread's reused Packer (0.9 µs
    instead of 1.3: packb builds a Packer per call). A Packer is not thread-safe, hence one per
    thread; a failed pack leaves it empty."""
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(body)


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the header bytes, then each array as a zero-copy buffer.

    Arrays must be C-contiguous with an allowed dtype; they are not copied, so the caller must
    not mutate them until ZeroMQ has sent them (send with ``copy=False``).
    """
    body = _fields_plain(msg, _part(type(msg)).names, {"t": msg.TYPE})
    arrays = msg.arrays
    lo, hi = msg.ARRAYS
    if not lo <= len(arrays) <= hi:
        raise ProtocolError(f"{msg.TYPE}: needs {lo}..{hi} arrays, got {len(arrays)}")
    specs = []
    for a in arrays:
        dt = np.dtype(a.dtype).str
        if dt not in ALLOWED_DTYPES:
            raise ProtocolError(f"{msg.TYPE}: dtype {dt} is not allowed on the wire")
        if not a.flags.c_contiguous:
            raise ProtocolError(f"{msg.TYPE}: arrays must be C-contiguous")
        specs.append([dt, list(a.shape)])
    body["arrays"] = specs
    header = HEADER_PREFIX + _pack(body)
    return [header, *(memoryview(a).cast("B") if a.ndim else a.tobytes()  # type: ignore[arg-type]
                      for a in arrays)]  # numpy's stubs do not declare the buffer protocol


# ---------------------------------------------------------------------------------------------
# Decoding and validation
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


Validator = Callable[[Any, str], Any]
_VALIDATORS: dict[Any, Validator] = {}


def _validator(tp: Any) -> Validator:
    """A function ``(value, where) -> value`` that checks (and converts) one schema type.

    Built once per type from the annotations and cached: decoding interprets no type hints.
    """
    v = _VALIDATORS.get(tp)
    if v is None:
        v = _VALIDATORS[tp] = _make_validator(tp)
    return v


def _make_validator(tp: Any) -> Validator:
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda value, where: value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        subs = [_validator(a) for a in args]

        def union(value: Any, where: str) -> Any:
            if value is None and optional:
                return None
            errors = []
            for sub in subs:
                try:
                    return sub(value, where)
                except ProtocolError as exc:
                    errors.append(str(exc))
            raise ProtocolError(errors[0] if errors else f"{where}: bad value")
        return union
    if origin is list:
        (arg,) = typing.get_args(tp)
        item = _validator(arg)

        def list_of(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            return [item(x, f"{where}[{i}]") for i, x in enumerate(value)]
        return list_of
    if origin is dict:
        _, varg = typing.get_args(tp)
        val = _validator(varg)

        def map_of(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
            out = {}
            for k, x in value.items():
                if not isinstance(k, str):
                    raise ProtocolError(f"{where}: map keys must be strings")
                out[k] = val(x, f"{where}.{k}")
            return out
        return map_of
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        def part(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: expected a map for {tp.__name__}")
            return _build(tp, value, where)
        return part
    if tp is bool:
        def boolean(value: Any, where: str) -> Any:
            if type(value) is not bool:
                raise ProtocolError(f"{where}: expected bool, got {type(value).__name__}")
            return value
        return boolean
    if tp is int:
        lo, hi = -(1 << 62), 1 << 62

        def integer(value: Any, where: str) -> Any:
            if type(value) is not int:
                raise ProtocolError(f"{where}: expected int, got {type(value).__name__}")
            if not lo <= value <= hi:
                raise ProtocolError(f"{where}: int out of range")
            return value
        return integer
    if tp is float:
        def real(value: Any, where: str) -> Any:
            t = type(value)
            if t is float:
                return value
            if t is int:
                return float(value)
            raise ProtocolError(f"{where}: expected float, got {t.__name__}")
        return real
    if tp is str:
        def text(value: Any, where: str) -> Any:
            if type(value) is not str:
                raise ProtocolError(f"{where}: expected str, got {type(value).__name__}")
            return value
        return text
    raise TypeError(f"unsupported schema type {_type_name(tp)}")


def _ranged(tp: Any, lo: float, hi: float) -> Validator:
    """A number field (float, int or either Optional) that must lie in ``[lo, hi]``, which NaN
    and infinities never do; one call per value (a worker's report has two dozen of them)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    optional = type(None) in typing.get_args(tp)
    (base,) = args
    if base not in (float, int):
        raise TypeError(f"a range applies to numbers, not {_type_name(tp)}")
    accepted = (float, int) if base is float else (int,)

    def ranged(value: Any, where: str) -> Any:
        t = type(value)
        if t in accepted:  # never bool: type(True) is bool
            if lo <= value <= hi:
                return float(value) if t is not base else value
            raise ProtocolError(f"{where}: must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
        if value is None and optional:
            return None
        raise ProtocolError(f"{where}: expected {base.__name__}, got {t.__name__}")
    return ranged


def _field_validator(f: dataclasses.Field, tp: Any) -> Validator:
    """The validator of one field: its type, and its ``range`` metadata if it has one."""
    bounds = f.metadata.get("range")
    return _validator(tp) if bounds is None else _ranged(tp, *bounds)


def _check(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` (nested dataclasses) or raise ProtocolError."""
    return _validator(tp)(value, where)


class _Schema(typing.NamedTuple):
    validators: dict[str, Validator]   # per field
    names: frozenset[str]
    required: frozenset[str]
    #: every field's default, for a frozen class built without its __init__ (None: use __init__;
    #: see :mod:`ps_common.frozen`)
    defaults: dict[str, Any] | None
    #: the class's own constructor from checked values, where it has one (``from_checked``: a
    #: worker's report, which also keeps its fields as a row of floats)
    make: Callable[[dict[str, Any]], Any] | None


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    """Validators, field names, required names and (frozen plain classes) defaults of a class."""
    sch = _SCHEMAS.get(cls)
    if sch is None:
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.name != "arrays"]
        validators = {f.name: _field_validator(f, hints[f.name]) for f in fields}
        required = frozenset(f.name for f in fields if f.default is dataclasses.MISSING
                             and f.default_factory is dataclasses.MISSING)
        sch = _SCHEMAS[cls] = _Schema(validators, frozenset(validators), required, plain_defaults(cls),
                                      getattr(cls, "from_checked", None))
    return sch


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    validators, names, required, defaults, make = _schema(cls)
    if not names.issuperset(body):
        raise ProtocolError(f"{where}: unknown field(s) {sorted(set(body) - names)}")
    missing = required.difference(body)
    if missing:
        raise ProtocolError(f"{where}: missing field {sorted(missing)[0]!r}")
    try:  # the field's path is only spelled out for an error message (1 µs per report saved)
        values = {name: validators[name](value, where) for name, value in body.items()}
    except ProtocolError:
        values = {name: validators[name](value, f"{where}.{name}") for name, value in body.items()}
    if make is not None:
        return make(values)
    return cls(**values) if defaults is None else fill(cls, defaults, values)


def _frame_bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf).cast("B")


def decode(frames: Sequence[Any], *, max_array_bytes: int = 1 << 32) -> Message:
    """Parse and validate a frame list; arrays come back as read-only views of the frames."""
    if not frames:
        raise ProtocolError("empty message")
    head = bytes(_frame_bytes(frames[0]))
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    if not head.startswith(MAGIC):
        raise ProtocolError("bad magic: not a message of this protocol")
    if len(head) < len(HEADER_PREFIX) or head[len(MAGIC)] != VERSION:
        got = head[len(MAGIC)] if len(head) > len(MAGIC) else None
        raise ProtocolError(f"protocol version mismatch: got {got}, this build speaks {VERSION}")
    try:
        body = msgpack.unpackb(head[len(HEADER_PREFIX):], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("header must be a map")
    kind = body.pop("t", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    specs = body.pop("arrays", [])
    if not isinstance(specs, list):
        raise ProtocolError(f"{kind}: 'arrays' must be a list")
    lo, hi = cls.ARRAYS
    if not lo <= len(specs) <= hi or len(specs) != len(frames) - 1:
        raise ProtocolError(
            f"{kind}: expects {lo}..{hi} array frames; header lists {len(specs)}, "
            f"message has {len(frames) - 1}"
        )
    msg = _build(cls, body, kind)
    msg.arrays = [_decode_array(spec, frame, kind, i, max_array_bytes)
                  for i, (spec, frame) in enumerate(zip(specs, frames[1:]))]
    return msg


_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}


def _decode_array(spec: Any, frame: Any, kind: str, index: int, max_bytes: int) -> np.ndarray:
    """Array ``index`` of a ``kind`` message as a read-only view of its frame. (msgpack gives
    exact lists, strings and ints, so exact type tests are the checks; the array's name is
    spelled out only for an error.)"""
    if not (type(spec) is list and len(spec) == 2 and type(spec[0]) is str and type(spec[1]) is list):
        raise ProtocolError(f"{kind}.arrays[{index}]: spec must be [dtype, shape]")
    dt, shape = spec
    dtype = _DTYPES.get(dt)
    if dtype is None:
        raise ProtocolError(f"{kind}.arrays[{index}]: dtype {dt!r} not allowed")
    if len(shape) > 8 or not all(type(s) is int and s >= 0 for s in shape):  # never bool
        raise ProtocolError(f"{kind}.arrays[{index}]: bad shape {shape!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise ProtocolError(f"{kind}.arrays[{index}]: {nbytes} bytes exceeds the limit of {max_bytes}")
    buf = _frame_bytes(frame)
    if buf.nbytes != nbytes:
        raise ProtocolError(f"{kind}.arrays[{index}]: frame has {buf.nbytes} bytes, shape/dtype need {nbytes}")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


def error_for(exc: BaseException, code: str = "bad_request") -> Error:
    """An Error reply describing ``exc``; used by servers' dispatch loops."""
    return Error(code=code, message=str(exc)[:2000])
