"""Wire protocol: round trips over dtypes and shapes; malformed frames rejected clearly."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchsize_manager.reports import WorkerReport
from ps_common import protocol as P
from ps_common.frozen import fillable
from ps_common.report import Telemetry


def roundtrip(msg: P.Message) -> P.Message:
    frames = [bytes(f) for f in P.encode(msg)]
    return P.decode(frames)


@pytest.mark.parametrize("dtype", ["<f4", "<f8", "<i8", "<i4", "|u1"])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 3, 4)])
def test_array_roundtrip_dtypes_shapes(dtype, shape):
    a = (np.arange(int(np.prod(shape))) * 3).astype(dtype).reshape(shape)
    out = roundtrip(P.Params(shard=1, version=7, version_time=1.5, stop=False, arrays=[a]))
    assert isinstance(out, P.Params)
    (b,) = out.arrays
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)
    assert not b.flags.writeable, "received arrays must be read-only views"
    assert (out.shard, out.version, out.version_time) == (1, 7, 1.5)


REPORT_FIELDS = dataclasses.fields(Telemetry)
RANGED = [f for f in REPORT_FIELDS if "range" in f.metadata]


def _field_values(f: dataclasses.Field) -> st.SearchStrategy:
    """Every value a report field may hold on the wire (its type, within its range)."""
    if isinstance(f.default, bool):
        return st.booleans()
    lo, hi = f.metadata["range"]
    if isinstance(f.default, int):
        return st.integers(lo, hi)
    values = st.floats(lo, hi)
    return st.one_of(st.none(), values) if f.default is None else values


reports = st.builds(Telemetry, **{f.name: _field_values(f) for f in REPORT_FIELDS})


@settings(max_examples=60, deadline=None)
@given(
    worker=st.integers(0, 2**31), it=st.integers(0, 2**40), bs=st.integers(1, 10**6),
    loss=st.floats(allow_nan=False), tel=st.one_of(st.none(), reports),
    values=st.lists(st.floats(width=32, allow_nan=False), max_size=50),
)
def test_push_roundtrip_property(worker, it, bs, loss, tel, values):
    g = np.array(values, dtype=np.float32)
    msg = P.Push(worker_id=worker, token="t" * 32, iteration=it, batch_size=bs, loss=loss, telemetry=tel,
                 pull=True, arrays=[g])
    out = roundtrip(msg)
    assert out == msg  # arrays are excluded from ==, compared below
    np.testing.assert_array_equal(out.arrays[0], g)


def test_nested_assignment_roundtrip():
    a = P.Assignment(iteration=3, batch_size=10, ranges=[[0, 50, 55], [1, 0, 5]], global_batch=20)
    out = roundtrip(P.Params(assignment=a, arrays=[np.zeros(2, np.float32)]))
    assert out.assignment == a
    plan = P.Plan(iteration=4, workers=[0, 2], batch_sizes=[7, 13])
    commit = P.Commit(version=5, iteration=4, entries=[[0, 7], [2, 13]], lr_scale=0.5, drops=[[1, 4]],
                      next_plan=plan, log_hash="ab" * 8, checkpoint=True)
    assert roundtrip(commit) == commit


def test_every_message_type_roundtrips_with_defaults():
    for cls in P.MESSAGE_TYPES.values():
        lo, _ = cls.ARRAYS
        msg = cls(arrays=[np.zeros(3, np.float32)] * lo)
        assert type(roundtrip(msg)) is cls


def header(body: dict, prefix: bytes = P.HEADER_PREFIX) -> bytes:
    return prefix + msgpack.packb(body)


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty"),
        ([b"XXXX\x01" + msgpack.packb({"t": "hello"})], "bad magic"),
        ([P.MAGIC + bytes([P.VERSION + 1]) + msgpack.packb({"t": "hello"})], "version mismatch"),
        ([P.HEADER_PREFIX + b"\xc1\xc1"], "not valid msgpack"),
        ([header([1, 2])], "must be a map"),
        ([header({"t": "nope"})], "unknown message type"),
        ([header({"t": "hello", "name": 5})], r"hello\.name: expected str"),
        ([header({"t": "hello", "bogus": 1})], "unknown field"),
        ([header({"t": "pull", "worker_id": True})], "expected int"),
        ([header({"t": "pull", "min_version": 2**63})], "out of range"),
        ([header({"t": "push", "arrays": []})], "array frames"),
        ([header({"t": "push", "arrays": [["<f4", [4]]]})], "array frames"),
        ([header({"t": "push", "arrays": [["<f4", [4]]]}), b"\0" * 12], "frame has 12 bytes"),
        ([header({"t": "push", "arrays": [["O", [1]]]}), b"\0" * 8], "not allowed"),
        ([header({"t": "push", "arrays": [["<f4", [-1]]]}), b""], "bad shape"),
        ([header({"t": "push", "arrays": [["<f4"]]}), b""], r"\[dtype, shape\]"),
        ([header({"t": "hello", "arrays": [["<f4", [1]]]}), b"\0" * 4], "array frames"),
        ([header({"t": "push", "telemetry": {"compute_s": "x"}, "arrays": [["<f4", [1]]]}), b"\0" * 4],
         r"push\.telemetry\.compute_s: expected float"),
        ([header({"t": "push", "telemetry": {"a": 1.0}, "arrays": [["<f4", [1]]]}), b"\0" * 4],
         r"push\.telemetry: unknown field\(s\) \['a'\]"),
        ([header({"t": "push", "telemetry": [1.0], "arrays": [["<f4", [1]]]}), b"\0" * 4], "expected a map"),
        ([header({"t": "params", "assignment": {"iteration": 1}, "arrays": [["<f4", [1]]]}), b"\0" * 4],
         "missing field"),
    ],
)
def test_malformed_frames_rejected(frames, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(frames)


def _push_with_report(report: dict) -> list[bytes]:
    return [header({"t": "push", "telemetry": report, "arrays": [["<f4", [1]]]}), b"\0" * 4]


@pytest.mark.parametrize("f", RANGED, ids=lambda f: f.name)
def test_every_report_field_is_bounded_on_decode(f):
    """Each measured field: finite, non-negative, within its range, of its type; in a Push and in
    a BsmReport alike. Its bounds are accepted."""
    lo, hi = f.metadata["range"]
    for ok in (lo, hi):
        assert getattr(P.decode(_push_with_report({f.name: ok})).telemetry, f.name) == ok
    bad = [-1, hi + 1, hi * 10] if isinstance(f.default, int) else [-1e-9, hi * 1.001, math.nan, math.inf, -math.inf]
    for v in bad:
        with pytest.raises(P.ProtocolError, match=rf"push\.telemetry\.{f.name}: must be a finite number in"):
            P.decode(_push_with_report({f.name: v}))
        frames = [header({"t": "bsm_report", "worker_id": 0, "telemetry": {f.name: v}})]
        with pytest.raises(P.ProtocolError, match=rf"bsm_report\.telemetry\.{f.name}: must be a finite number in"):
            P.decode(frames)
    wrong = 0.5 if isinstance(f.default, int) else "1"
    with pytest.raises(P.ProtocolError, match=rf"push\.telemetry\.{f.name}: expected"):
        P.decode(_push_with_report({f.name: wrong}))


def test_report_flags_and_optional_fields_on_decode():
    assert P.decode(_push_with_report({"oom": True})).telemetry.oom is True
    with pytest.raises(P.ProtocolError, match=r"push\.telemetry\.oom: expected bool"):
        P.decode(_push_with_report({"oom": 1}))
    assert P.decode(_push_with_report({"finish_s": None})).telemetry.finish_s is None
    with pytest.raises(P.ProtocolError, match=r"push\.telemetry\.compute_s: expected float, got NoneType"):
        P.decode(_push_with_report({"compute_s": None}))   # not optional: only "not measured" ones are
    assert P.decode(_push_with_report({})).telemetry == Telemetry()


def test_a_decoded_report_is_the_frozen_report_its_constructor_makes():
    """Reports are built by filling the instance instead of the frozen __init__ (faster): the
    result is the same value, frozen, with every field not sent at its default."""
    sent = {"compute_s": 0.01, "cpu_quota": 0.5, "oom": True, "burners": 2, "finish_s": None}
    tel = P.decode(_push_with_report(sent)).telemetry
    assert type(tel) is Telemetry and tel == Telemetry(**sent) and hash(tel) == hash(Telemetry(**sent))
    assert tel.data_s == 0.0 and tel.mem_headroom_mb is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        tel.compute_s = 1.0  # type: ignore[misc]
    assert P._schema(P.Push).defaults is None          # messages keep their own __init__


def test_a_report_with_a_finish_time_is_a_copy_like_replace():
    """``Telemetry.with_finish`` (the coordinator's fast copy) gives what dataclasses.replace
    does, leaves the original alone, and stays a frozen Telemetry."""
    tel = P.decode(_push_with_report({"compute_s": 0.01, "cpu_quota": 0.5, "oom": True,
                                      "finish_s": 0.3, "burners": 2})).telemetry
    for finish in (0.02, None):
        new = tel.with_finish(finish)
        assert new == dataclasses.replace(tel, finish_s=finish) and type(new) is Telemetry
        assert new.finish_s == finish and tel.finish_s == 0.3 and new.compute_s == 0.01
        with pytest.raises(dataclasses.FrozenInstanceError):
            new.finish_s = 1.0  # type: ignore[misc]


def test_a_report_travels_as_the_fields_that_differ_from_their_defaults():
    """The encoder leaves out report fields at their defaults and the decoder fills them in: the
    same report comes back. A value of another type that equals a default (0 for False) still
    travels, so the decoder refuses it as before; so does a NaN where the default is None."""
    tel = Telemetry(compute_s=0.05, host_cpu=40.0, cpu_quota=0.5, oom=False, data_s=0.0, finish_s=None)
    frames = P.encode(P.Push(worker_id=1, telemetry=tel, arrays=[np.zeros(1, np.float32)]))
    body = msgpack.unpackb(frames[0][len(P.HEADER_PREFIX):])
    assert body["telemetry"] == {"compute_s": 0.05, "host_cpu": 40.0, "cpu_quota": 0.5}
    assert body["worker_id"] == 1 and "token" in body and "pull" in body   # messages: every field
    back = P.decode(frames).telemetry
    assert back == tel and hash(back) == hash(tel)
    assert P.decode(P.encode(P.Push(telemetry=Telemetry(), arrays=[np.zeros(1, np.float32)]))).telemetry == Telemetry()
    with pytest.raises(P.ProtocolError, match="expected bool"):
        P.decode(P.encode(P.Push(telemetry=Telemetry(oom=0), arrays=[np.zeros(1, np.float32)])))  # type: ignore[arg-type]
    with pytest.raises(P.ProtocolError, match="finite number"):
        P.decode(P.encode(P.Push(telemetry=Telemetry(cpu_quota=math.nan), arrays=[np.zeros(1, np.float32)])))


def test_a_report_with_new_telemetry_is_a_copy_like_replace():
    """``WorkerReport.with_telemetry`` (the coordinator's copy of every report) is what
    dataclasses.replace gives; a class whose __init__ does more than store cannot be copied so."""
    rep = WorkerReport(worker_id=4, iteration=9, batch_size=32, telemetry=Telemetry(compute_s=0.1))
    tel = rep.telemetry.with_finish(0.2)
    new = rep.with_telemetry(tel)
    assert new == dataclasses.replace(rep, telemetry=tel) and hash(new) == hash(dataclasses.replace(rep, telemetry=tel))
    assert type(new) is WorkerReport and rep.telemetry.finish_s is None and new.telemetry is tel
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.batch_size = 1  # type: ignore[misc]

    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    assert fillable(WorkerReport) and fillable(Telemetry) and not fillable(Checked)
    assert not fillable(dataclasses.make_dataclass("Open", ["x"]))      # not frozen


def test_array_size_limit():
    frames = [bytes(f) for f in P.encode(P.Push(arrays=[np.zeros(100, np.float32)]))]
    with pytest.raises(P.ProtocolError, match="exceeds the limit"):
        P.decode(frames, max_array_bytes=399)
    P.decode(frames, max_array_bytes=400)


def test_oversized_header_rejected():
    big = header({"t": "error", "message": "x" * (P.MAX_HEADER_BYTES + 10)})
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode([big])


def test_encode_refuses_bad_arrays():
    with pytest.raises(P.ProtocolError, match="not allowed"):
        P.encode(P.Push(arrays=[np.zeros(2, dtype=np.complex64)]))
    with pytest.raises(P.ProtocolError, match="contiguous"):
        P.encode(P.Push(arrays=[np.zeros((4, 4), np.float32)[:, 1]]))
    with pytest.raises(P.ProtocolError, match="needs 1..1 arrays"):
        P.encode(P.Push())


def test_no_pickle_anywhere_in_wire_modules():
    import inspect

    from ps_common import transport

    for mod in (P, transport):
        src = inspect.getsource(mod)
        assert "import pickle" not in src and "pickle.loads" not in src


def test_only_plain_frozen_dataclasses_are_built_without_their_init():
    """ps_common.frozen refuses every class whose __init__ does more than store fields: the
    decoder then calls the class itself."""
    from ps_common.frozen import fill, plain_defaults

    @dataclasses.dataclass(frozen=True)
    class Plain:
        a: float = 1.0
        b: int | None = None

    @dataclasses.dataclass(frozen=True)
    class Checked:
        a: float = 1.0

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a < 0")

    @dataclasses.dataclass(frozen=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Required:
        a: float

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        a: float = 1.0

    @dataclasses.dataclass
    class Mutable:
        a: float = 1.0

    assert plain_defaults(Plain) == {"a": 1.0, "b": None}
    for cls in (Checked, Factory, Required, Slotted, Mutable):
        assert plain_defaults(cls) is None, cls.__name__
    built = fill(Plain, plain_defaults(Plain), {"b": 3})
    assert built == Plain(1.0, 3) and hash(built) == hash(Plain(1.0, 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.a = 2.0  # type: ignore[misc]
