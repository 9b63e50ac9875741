"""A commit's update left pending and streamed: the shard sends each piece of the new slice as
soon as it is final, the worker puts the pieces together. Same bits as the update done at once;
nothing reads half an update; a piece that does not continue its answer is refused."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import protocol as P
from ps_common.config import OptimizerConfig
from ps_server import optimizer
from ps_server.params_parts import PartCutter, answer_part_elements
from ps_server.shard import ShardState
from ps_worker.slice_assembly import SliceAssembly

N = 1000


def grad(seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    a.flags.writeable = False
    return a


def shard(**kw) -> ShardState:
    cfg = OptimizerConfig(lr=0.1, momentum=0.9, weight_decay=kw.pop("weight_decay", 0.0))
    return ShardState(0, np.random.default_rng(9).standard_normal(N).astype(np.float32), cfg, **kw)


def commit(s: ShardState, it: int) -> None:
    s.receive(0, it, 3, grad(2 * it))
    s.receive(1, it, 5, grad(2 * it + 1))
    s.apply(it, [[0, 3], [1, 5]], 1.0)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
def test_a_streamed_update_gives_the_bits_of_one_done_at_once_and_each_prefix_is_final(monkeypatch, weight_decay):
    monkeypatch.setattr(optimizer, "BLOCK", 64)  # many blocks (64 per torch thread), the last one short
    blocks = -(-N // optimizer.block_elements())
    assert blocks > 3
    at_once, streamed = shard(weight_decay=weight_decay), shard(weight_decay=weight_decay)
    for it in range(4):
        commit(at_once, it)
        _ = at_once.params
        commit(streamed, it)
        assert streamed.updating
        prefixes: list[tuple[int, np.ndarray]] = []

        def seen(end: int, prefixes: list = prefixes) -> None:
            prefixes.append((end, streamed.newest_params[:end].copy()))

        streamed.finish_update(seen)
        assert not streamed.updating
        ends = [e for e, _ in prefixes]
        assert ends == sorted(ends) and ends[-1] == N and len(set(ends)) == blocks
        for end, seen in prefixes:  # what was final then is what the update ends with
            np.testing.assert_array_equal(seen, streamed.params[:end])
        np.testing.assert_array_equal(streamed.params, at_once.params)
        np.testing.assert_array_equal(streamed.state_arrays()["momentum_buffer"],
                                      at_once.state_arrays()["momentum_buffer"])


@pytest.mark.parametrize("read", ["params", "snapshots", "state_arrays", "next_apply", "restore", "rewind"])
def test_every_read_of_the_state_finishes_a_pending_update_first(read):
    reference, s = shard(snapshot_every=1), shard(snapshot_every=1)
    commit(reference, 0)
    expected = reference.params.copy()
    saved = reference.state_arrays()
    commit(s, 0)
    assert s.updating
    if read == "params":
        got = s.params
    elif read == "snapshots":
        got = s.snapshots[1][0]
    elif read == "state_arrays":
        got = s.state_arrays()["params"]
    elif read == "next_apply":  # the next commit starts from the finished one (its momentum too)
        commit(s, 1)
        commit(reference, 1)
        np.testing.assert_array_equal(s.params, reference.params)
        return
    elif read == "restore":     # a pending update must not write the momentum after it is loaded
        s.restore({k: v.copy() for k, v in saved.items()}, {**reference.state_meta()})
        np.testing.assert_array_equal(s.optimizer.buf, saved["momentum_buffer"])
        got = s.params
    else:
        s.rewind()
        got = s.newest_params
    assert not s.updating
    np.testing.assert_array_equal(got, expected)


def test_the_buffer_being_written_is_never_handed_out_again():
    s = shard()
    commit(s, 0)
    commit(s, 1)
    writing = s.newest_params
    commit(s, 2)  # finishes version 2's update, which then holds the parameters this one starts from
    assert s._pending is not None and s._pending.base is writing
    assert s._pending.out is not writing
    s.finish_update()
    np.testing.assert_array_equal(s.params, s.newest_params)


def test_block_size_grows_with_the_threads_so_each_thread_keeps_its_share():
    assert optimizer.block_elements(1) == optimizer.BLOCK
    assert optimizer.block_elements(8) == 8 * optimizer.BLOCK
    assert optimizer.block_elements(0) == optimizer.BLOCK


# ----- cutting a slice into parts ----------------------------------------------------------------
def test_parts_cover_the_slice_once_in_order_each_when_final():
    c = PartCutter(10, 4)
    assert c.count == 3
    assert c.ready(3) == []
    assert c.ready(9) == [(0, 4), (4, 8)]
    assert c.ready(9) == []
    assert c.ready(10) == [(8, 10)]
    assert c.ready(10) == []
    assert PartCutter(8, 4).ready(8) == [(0, 4), (4, 8)] and PartCutter(3, 4).count == 1
    with pytest.raises(ValueError):
        PartCutter(10, 0)


# ----- putting the parts together ---------------------------------------------------------------
def wire(msg: P.Params) -> P.Params:
    """``msg`` as the worker gets it: encoded, then decoded into read-only views."""
    out = P.decode(P.encode(msg))
    assert isinstance(out, P.Params)
    return out


def parts(values: np.ndarray, cuts: list[int], **fields) -> list[P.Params]:
    bounds = [0, *cuts, values.size]
    head = dict(version=7, log_hash="abc", **fields)
    return [wire(P.Params(offset=lo, parts=len(bounds) - 1, arrays=[values[lo:hi]], **head))
            for lo, hi in zip(bounds, bounds[1:])]


def assemble(msgs: list[P.Params], size: int = 10) -> tuple[SliceAssembly, np.ndarray]:
    out = np.full(size, -1.0, np.float32)
    a = SliceAssembly(1, msgs[0], out)
    for m in msgs[1:]:
        a.add(m)
    return a, out


def test_parts_in_order_fill_the_slice_and_a_whole_answer_is_one_part():
    values = np.arange(10, dtype=np.float32)
    a, out = assemble(parts(values, [4, 8]))
    assert a.complete and a.head.version == 7
    np.testing.assert_array_equal(out, values)
    a, out = assemble(parts(values, []))
    assert a.complete
    incomplete, _ = assemble(parts(values, [4, 8])[:2])
    assert not incomplete.complete


@pytest.mark.parametrize("forgery, match", [
    ("starts_late", "first part starts at element 4"),
    ("gap", "part at element 8, expected 4"),
    ("repeat", "part at element 0, expected 4"),
    ("other_version", "part of version 8"),
    ("other_history", "inside the answer of version 7"),
    ("too_long", "does not fit its slice"),
    ("one_element", "1 parts of 1 cover 1 of 10"),
    ("too_many_parts", "cover 10 of 10"),
    ("fewer_than_announced", "2 parts of 3 cover 10 of 10"),
    ("float64", "does not fit its slice"),
])
def test_a_part_that_does_not_continue_its_answer_is_refused(forgery, match):
    """Well-formed messages (each decodes), forged to break the answer they claim to be in."""
    values = np.arange(10, dtype=np.float32)
    good = parts(values, [4, 8])
    msgs = {
        "starts_late": good[1:],
        "gap": [good[0], good[2]],
        "repeat": [good[0], good[0]],
        "other_version": [good[0], parts(values, [4, 8], samples=0)[1]],
        "other_history": [good[0], wire(P.Params(version=7, log_hash="xyz", offset=4, parts=3,
                                                 arrays=[values[4:8]]))],
        "too_long": [good[0], wire(P.Params(version=7, log_hash="abc", offset=4, parts=3,
                                            arrays=[np.zeros(7, np.float32)]))],
        "one_element": [wire(P.Params(version=7, log_hash="abc", arrays=[values[:1]]))],
        "too_many_parts": [*good, wire(P.Params(version=7, log_hash="abc", offset=10, parts=3,
                                                arrays=[np.zeros(0, np.float32)]))],
        "fewer_than_announced": [wire(P.Params(version=7, log_hash="abc", offset=0, parts=3, arrays=[values[:4]])),
                                 wire(P.Params(version=7, log_hash="abc", offset=4, parts=3, arrays=[values[4:]]))],
        "float64": [wire(P.Params(version=7, log_hash="abc", arrays=[values.astype(np.float64)]))],
    }[forgery]
    if forgery == "other_version":
        msgs[1].version = 8
    with pytest.raises(P.ProtocolError, match=match):
        assemble(msgs)


def test_the_part_fields_are_bounded_on_decode():
    for bad in ({"offset": -1}, {"parts": 0}, {"parts": True}):
        frames = P.encode(P.Params(version=1, arrays=[np.zeros(2, np.float32)]))
        body = P.msgpack.unpackb(frames[0][len(P.HEADER_PREFIX):])
        frames[0] = P.HEADER_PREFIX + P.msgpack.packb({**body, **bad})
        with pytest.raises(P.ProtocolError):
            P.decode(frames)


def test_a_read_from_inside_the_update_is_refused_not_answered_with_half_of_it():
    s = shard()
    commit(s, 0)

    def peek(end: int) -> None:
        _ = s.params

    with pytest.raises(RuntimeError, match="while its update was being computed"):
        s.finish_update(peek)


def test_an_older_snapshot_is_read_without_finishing_the_pending_update():
    s = shard(snapshot_every=1)
    commit(s, 0)
    old = s.snapshot_at(1)  # this version's own: finished first
    commit(s, 1)
    assert s.snapshot_at(1) is old and s.updating
    assert s.snapshot_at(2) is not None and not s.updating


def test_answers_have_at_most_half_the_high_water_mark_in_parts():
    assert answer_part_elements(10_000_000, 4 << 20, hwm=100) == 1 << 20   # 10 parts
    assert answer_part_elements(10_000_000, 4096, hwm=100) == 200_000        # 50 parts, not 2,442
    assert answer_part_elements(10_000_000, 4096, hwm=1) == 10_000_000       # one part: whole
    assert answer_part_elements(10_000_000, 0, hwm=100) == 0                 # whole answers


@pytest.mark.parametrize("value, ok", [(0, True), (4096, True), (1, False), (4095, False), (-1, False)])
def test_a_part_size_is_zero_or_at_least_a_page(value, ok):
    from pydantic import ValidationError

    from ps_common.config import TransportConfig

    if ok:
        assert TransportConfig(params_part_bytes=value).params_part_bytes == value
    else:
        with pytest.raises(ValidationError, match="params_part_bytes"):
            TransportConfig(params_part_bytes=value)
