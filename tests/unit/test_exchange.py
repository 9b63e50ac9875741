"""The gradient exchange's rule (ps_server/exchange.py), message by message, without sockets.

Real ranks and a real service: tests/system/test_ddp_server_exchange.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchsize_manager import BatchSizeManager
from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_server.exchange import GradientExchange
from ps_server.router import Refused

X = 64
WEIGHTS = [1.0, 3.0, 4.0]   # fixed policy: splits [8, 24, 32]
PLAN = [8, 24, 32]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(world: int = 3, **kw) -> tuple[GradientExchange, Clock]:
    clock = Clock()
    counter = itertools.count()
    manager = BatchSizeManager("fixed", X, policy_args={"weights": WEIGHTS[:world]})
    ex = GradientExchange(manager, world, clock=clock, new_token=lambda: f"tok{next(counter)}", **kw)
    return ex, clock


def push(ex: GradientExchange, rank: int, grad, *, bucket: int = 0, last: bool = True,
         iteration: int = 0, token: str | None = None, batch_size: int | None = None,
         telemetry: Telemetry | None = None):
    msg = P.ExchangePush(worker_id=rank, token=ex.tokens.get(rank, "") if token is None else token,
                         iteration=iteration, bucket=bucket, last=last,
                         batch_size=ex.plan[rank] if batch_size is None else batch_size,
                         telemetry=(telemetry or Telemetry(compute_s=0.01 * (rank + 1))) if last else None,
                         arrays=[np.asarray(grad)])
    return ex.push(f"id{rank}".encode(), msg)


def open_rank(ex: GradientExchange, rank: int, iteration: int = 0, job: str = "") -> P.ExchangePlan:
    """Open as ``rank``; its plan (what the others were told is checked where it matters)."""
    *_, (ident, plan) = ex.open(f"id{rank}".encode(), rank, iteration, job)
    assert ident == f"id{rank}".encode() and isinstance(plan, P.ExchangePlan)
    return plan


def open_all(ex: GradientExchange, iteration: int = 0) -> list[P.ExchangePlan]:
    return [open_rank(ex, r, iteration) for r in range(ex.world)]


def grads(world: int = 3, n: int = 5, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(n).astype(dtype) for _ in range(world)]


def test_weighted_mean_in_rank_order_whatever_the_arrival_order():
    g = grads()
    want = (sum(np.float64(PLAN[r]) / X * g[r].astype(np.float64) for r in range(3))).astype(np.float32)
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        ex, _ = make()
        plans = open_all(ex)
        assert [p.batch_sizes for p in plans] == [PLAN] * 3
        assert len({p.token for p in plans}) == 3
        replies = []
        for r in order:
            replies += push(ex, r, g[r])
        assert len(replies) == 3 and sorted(i for i, _ in replies) == [b"id0", b"id1", b"id2"]
        msgs = [m for _, m in replies]
        assert all(isinstance(m, P.ExchangeResult) for m in msgs)
        results.append(msgs[0].arrays[0])
        assert all(np.array_equal(m.arrays[0], msgs[0].arrays[0]) for m in msgs)
        # The last bucket brings the next split and every rank's report, and opens iteration 1.
        assert msgs[0].next_batch_sizes == PLAN and ex.iteration == 1
        assert [t.compute_s for t in msgs[0].reports] == pytest.approx([0.01, 0.02, 0.03])
    assert results[0].dtype == np.float32
    np.testing.assert_allclose(results[0], want, rtol=1e-6)
    assert all(np.array_equal(r, results[0]) for r in results)  # bit-identical


def test_the_weighted_mean_is_summed_in_float64_to_the_bit():
    """Weights float32 cannot hold exactly (13/61, 48/61): each float32 gradient times its
    weight, and their sum, in float64, rounded to float32 once at the end."""
    manager = BatchSizeManager("fixed", 61, policy_args={"weights": [13.0, 48.0]})
    ex = GradientExchange(manager, 2)
    open_all(ex)
    assert ex.plan == [13, 48]
    g = [np.random.default_rng(r).standard_normal(10_000).astype(np.float32) for r in (0, 1)]
    push(ex, 0, g[0])
    out = push(ex, 1, g[1])
    want = (g[0].astype(np.float64) * (13 / 61) + g[1].astype(np.float64) * (48 / 61)).astype(np.float32)
    np.testing.assert_array_equal(out[0][1].arrays[0], want)


def test_finite_gradients_near_float32s_limit_are_summed_not_refused():
    ex, _ = make()
    open_all(ex)
    big = [np.full(4, 3e38, np.float32), np.full(4, -3e38, np.float32), np.full(4, 3e38, np.float32)]
    out = push(ex, 0, big[0]) + push(ex, 1, big[1]) + push(ex, 2, big[2])
    assert [type(m).__name__ for _, m in out] == ["ExchangeResult"] * 3
    want = np.float32((8 * 3e38 - 24 * 3e38 + 32 * 3e38) / 64)
    np.testing.assert_allclose(out[0][1].arrays[0], want, rtol=1e-6)


class _Raising:
    """A custom policy with a bug: it divides by a report's compute time, which may be 0."""

    name = "raising"

    def join(self, worker_id: int) -> None:
        pass

    def leave(self, worker_id: int) -> None:
        pass

    def observe(self, report) -> None:
        1.0 / report.telemetry.compute_s

    def assign(self, workers, global_batch, min_batch=1, *, max_batch=None):
        return {w: global_batch // len(workers) for w in workers}


def test_a_policy_that_raises_fails_the_iteration_for_every_rank_and_a_restart_recovers():
    from batchsize_manager.policies import BatchPolicy

    policy = type("Raising", (_Raising, BatchPolicy), {})()
    ex = GradientExchange(BatchSizeManager(policy, 64), 2)
    open_all(ex)
    g = grads(2)
    assert push(ex, 0, g[0], telemetry=Telemetry(compute_s=0.01)) == []
    out = push(ex, 1, g[1], telemetry=Telemetry(compute_s=0.0))
    assert sorted((i, m.code) for i, m in out) == [(b"id0", "policy_error"), (b"id1", "policy_error")]
    assert "ZeroDivisionError" in out[0][1].message
    assert ex.failed is not None and not ex.buckets and ex.held_bytes == 0
    open_all(ex)                          # the restarted job: a fresh iteration 0, nothing "done"
    push(ex, 0, g[0], telemetry=Telemetry(compute_s=0.01))
    out = push(ex, 1, g[1], telemetry=Telemetry(compute_s=0.02))
    assert [type(m).__name__ for _, m in out] == ["ExchangeResult"] * 2 and ex.iteration == 1


def test_buckets_answer_as_they_complete_and_only_the_last_moves_the_iteration():
    ex, _ = make(world=2)
    open_all(ex)
    g = grads(world=2)
    assert push(ex, 0, g[0], bucket=0, last=False) == []
    assert push(ex, 0, g[1], bucket=1, last=True) == []
    done0 = push(ex, 1, g[0], bucket=0, last=False)
    assert [m.bucket for _, m in done0] == [0, 0] and done0[0][1].next_batch_sizes == []
    assert ex.iteration == 0
    done1 = push(ex, 1, g[1], bucket=1, last=True)
    assert done1[0][1].next_batch_sizes == [16, 48] and ex.iteration == 1 and ex.held_bytes == 0
    # The manager saw one report per rank for iteration 0.
    assert ex.manager.decisions == 2


def test_a_rank_with_no_samples_adds_nothing_even_if_its_gradient_is_nan():
    ex, _ = make(world=2)
    ex.plan = [0, X]
    open_all(ex)
    ex.plan = [0, X]
    out = push(ex, 0, np.full(3, np.nan, np.float32)) + push(ex, 1, np.ones(3, np.float32))
    np.testing.assert_array_equal(out[0][1].arrays[0], np.ones(3, np.float32))


def _state(ex: GradientExchange) -> tuple:
    return (ex.iteration, dict(ex.tokens), ex.held_bytes, ex.failed,
            {b: sorted(bk.grads) for b, bk in ex.buckets.items()})


@pytest.mark.parametrize("case, code", [
    ("token", "unauthorized"),
    ("non_ascii_token", "unauthorized"),
    ("other_rank_token", "unauthorized"),
    ("rank", "unknown_worker"),
    ("iteration", "not_planned"),
])
def test_pushes_without_the_ranks_token_are_refused_and_change_nothing(case, code):
    ex, _ = make()
    open_all(ex)
    g = grads()
    push(ex, 0, g[0])  # rank 0 is in; ranks 1 and 2 are not
    before = _state(ex)
    with pytest.raises(Refused) as err:
        if case == "token":
            push(ex, 1, g[1], token="forged")
        elif case == "non_ascii_token":     # compare_digest refuses non-ASCII str: bytes compared
            push(ex, 1, g[1], token="é" * 32)
        elif case == "other_rank_token":
            push(ex, 1, g[1], token=ex.tokens[0])
        elif case == "rank":
            push(ex, 3, g[1], token="x", batch_size=8)
        elif case == "iteration":
            push(ex, 1, g[1], iteration=1)
    assert err.value.code == code
    assert _state(ex) == before
    # ...and the iteration still completes with the real pushes.
    out = push(ex, 1, g[1]) + push(ex, 2, g[2])
    assert len(out) == 3 and ex.iteration == 1


@pytest.mark.parametrize("case, code", [
    ("batch", "bad_batch"),
    ("duplicate", "duplicate"),
    ("shape", "bad_shape"),
    ("dtype", "bad_shape"),
    ("last_flag", "bad_shape"),
    ("int_dtype", "bad_request"),
    ("bucket_index", "bad_request"),
    ("no_report", "bad_request"),
    ("non_finite", "non_finite"),
])
def test_a_ranks_own_broken_push_fails_the_iteration_for_every_rank(case, code):
    """With the rank's token the push is the rank's: its sizes or its model differ from the
    others', so the iteration cannot complete, and every rank is told at once."""
    ex, _ = make()
    open_all(ex)
    g = grads()
    push(ex, 0, g[0])
    sender = 0 if case == "duplicate" else 1
    if case == "batch":
        out = push(ex, 1, g[1], batch_size=PLAN[1] + 1)
    elif case == "duplicate":
        out = push(ex, 0, g[0])
    elif case == "shape":
        out = push(ex, 1, np.zeros(6, np.float32))
    elif case == "dtype":
        out = push(ex, 1, g[1].astype(np.float64))
    elif case == "last_flag":
        out = push(ex, 1, g[1], last=False)
    elif case == "int_dtype":
        out = push(ex, 1, np.zeros(5, np.int64))
    elif case == "bucket_index":
        out = push(ex, 1, g[1], bucket=ex.max_buckets)
    elif case == "no_report":
        out = ex.push(b"id1", P.ExchangePush(worker_id=1, token=ex.tokens[1], iteration=0, bucket=0,
                                             last=True, batch_size=PLAN[1], telemetry=None, arrays=[g[1]]))
    else:
        bad = g[1].copy()
        bad[2] = np.inf
        out = push(ex, 1, bad)
    codes = [(i, m.code) for i, m in out]
    assert codes[0] == (f"id{sender}".encode(), code)
    assert (b"id0", "iteration_failed") in codes[1:] and len(codes) == 2
    assert ex.held_bytes == 0 and ex.abandoned == 1 and not ex.buckets
    with pytest.raises(Refused) as err:   # every later push of the iteration is told why
        push(ex, 2, g[2])
    assert err.value.code == "iteration_failed" and f"rank {sender}'s bucket" in str(err.value)
    # The job can start over (e.g. from a checkpoint): opening an iteration replans it.
    plans = open_all(ex, iteration=0)
    assert plans[0].batch_sizes == PLAN and ex.failed is None
    assert len(push(ex, 0, g[0]) + push(ex, 1, g[1]) + push(ex, 2, g[2])) == 3


def test_a_stalled_iteration_is_abandoned_and_its_waiters_told():
    ex, clock = make(stale_s=5.0)
    open_all(ex)
    g = grads()
    push(ex, 0, g[0])
    clock.now = 4.0
    assert ex.expire() == []
    clock.now = 9.5
    out = ex.expire()
    assert [(i, m.code) for i, m in out] == [(b"id0", "iteration_failed")]
    assert "ranks [1, 2]" in out[0][1].message
    plan = open_rank(ex, 1, 7)           # a restarted job opens its own iteration
    assert ex.iteration == 7 and plan.iteration == 7


@pytest.mark.parametrize("crash_at", [0, 3])
def test_a_restarted_job_opens_at_once_and_the_dead_incarnations_buckets_go(crash_at):
    """torchrun restarts every rank within seconds of a crash, long before ``stale_s``: the
    first open of the restarted job abandons the open iteration, whose waiting ranks are told,
    and nothing the dead ranks sent is summed with what the new ones send."""
    ex, clock = make(stale_s=60.0)
    open_all(ex, crash_at)
    old = grads()
    push(ex, 0, old[0], iteration=crash_at)
    push(ex, 1, old[1], iteration=crash_at)
    clock.now = 2.0                      # rank 2 crashed; torchrun restarts all three
    restart = 0   # from the start: another iteration (crash at 3), or the same one (crash at 0)
    told = ex.open(b"new0", 0, restart)
    assert [(i, m.code) for i, m in told[:-1]] == [(b"id0", "iteration_failed"), (b"id1", "iteration_failed")]
    assert "restarted job" in told[0][1].message and isinstance(told[-1][1], P.ExchangePlan)
    tokens = {told[-1][1].token} | {open_rank(ex, r, restart).token for r in (1, 2)}
    assert len(tokens) == 3 and ex.iteration == restart and not ex.buckets
    new = [g + 10.0 for g in grads()]
    for r in range(3):
        out = push(ex, r, new[r], iteration=restart)
    mean = out[0][1].arrays[0]
    want = sum(PLAN[r] / X * new[r].astype(np.float64) for r in range(3)).astype(np.float32)
    np.testing.assert_array_equal(mean, want)   # the dead ranks' buckets are nowhere in it
    assert ex.abandoned == 1 and ex.completed == 1


@pytest.mark.parametrize("first", [0, 2])
@pytest.mark.parametrize("done_before", [0, 1])
def test_a_restarted_job_voids_the_dead_one_whichever_rank_opens_first(first, done_before):
    """Whichever rank of the restarted job opens first, a sender of the dead job's buckets (0)
    or a rank that sent nothing (2), and whether the open iteration was opened or reached by
    completing the one before: nothing the dead job sent is summed with the new ranks' buckets,
    and a process of the dead job that still pushes is refused."""
    ex, clock = make(stale_s=60.0)
    open_all(ex)
    g = grads()
    for t in range(done_before):                  # iterations completed before the crash
        for r in range(3):
            push(ex, r, g[r], iteration=t)
    t = done_before
    push(ex, 0, g[0] + 100.0, iteration=t)       # the dead job's rank 0 sent its bucket
    old0 = ex.tokens[0]
    clock.now = 2.0                               # rank 1 crashed; torchrun restarts all three
    told = ex.open(f"new{first}".encode(), first, t)
    assert [(i, m.code) for i, m in told[:-1]] == [(b"id0", "iteration_failed")]
    assert "restarted job" in told[0][1].message and not ex.buckets and ex.held_bytes == 0
    with pytest.raises(Refused) as err:           # the dead job's rank 0, still pushing
        push(ex, 0, g[0], iteration=t, token=old0)
    assert err.value.code == "unauthorized" and not ex.buckets
    new = [x + 10.0 for x in g]
    push(ex, first, new[first], iteration=t)
    for r in [r for r in range(3) if r != first]:
        open_rank(ex, r, t)                       # the other new ranks open: no second restart
    assert ex.generation == 1 and ex.abandoned == 1 and ex.buckets
    for r in [r for r in range(3) if r != first]:
        out = push(ex, r, new[r], iteration=t)
    mean = out[0][1].arrays[0]
    want = sum(PLAN[r] / X * new[r].astype(np.float64) for r in range(3)).astype(np.float32)
    np.testing.assert_array_equal(mean, want)     # the dead rank 0's bucket is nowhere in it
    assert ex.completed == done_before + 1


def test_with_job_ids_a_restart_is_seen_even_when_ranks_opened_in_different_generations():
    """Job B's rank 1 died before it opened, so its ranks opened in different generations; job C's
    rank 1, opening first, would not be taken for a restart by the guess (a second open in its
    generation), and its push would complete a bucket holding B's rank 0's gradient. The job
    the balancer names in every open tells them apart."""
    ex, clock = make(world=2, stale_s=60.0)
    for r in (0, 1):
        open_rank(ex, r, 0, job="A")
    open_rank(ex, 0, 0, job="B")                 # job B: rank 0 opens and sends, rank 1 dies first
    dead = grads(2)[0] + 100.0
    push(ex, 0, dead)
    told = ex.open(b"c1", 1, 0, "C")              # job C: rank 1 opens first
    assert [(i, m.code) for i, m in told[:-1]] == [(b"id0", "iteration_failed")] and not ex.buckets
    new = [x + 10.0 for x in grads(2)]
    push(ex, 1, new[1])
    assert open_rank(ex, 0, 0, job="C") and ex.buckets, "job C's rank 0 is no restart: rank 1's bucket stays"
    out = push(ex, 0, new[0])
    weights = [ex.plan[r] / sum(ex.plan) for r in (0, 1)]
    want = sum(w * x.astype(np.float64) for w, x in zip(weights, new)).astype(np.float32)
    np.testing.assert_array_equal(out[0][1].arrays[0], want)
    assert ex.abandoned == 1 and ex.completed == 1


def test_held_bytes_and_open_buckets_are_bounded():
    ex, _ = make(max_buckets=2, max_bytes=100)
    open_all(ex)
    push(ex, 0, np.zeros(10, np.float32), bucket=0, last=False)            # 40 bytes
    push(ex, 0, np.zeros(10, np.float32), bucket=1, last=False)            # 80
    out = push(ex, 1, np.zeros(10, np.float32), bucket=0, last=False)      # 120 > 100
    assert [(i, m.code) for i, m in out][0] == (b"id1", "too_large")
    assert ex.held_bytes == 0 and not ex.buckets       # the iteration failed, nothing is held


def test_world_and_arguments_are_checked():
    manager = BatchSizeManager("uniform", X)
    with pytest.raises(ValueError):
        GradientExchange(manager, 0)
    with pytest.raises(ValueError):
        GradientExchange(manager, 2, stale_s=0)
    ex, _ = make()
    with pytest.raises(Refused) as err:
        ex.open(b"id0", 0, -1)
    assert err.value.code == "bad_request"


def test_finish_times_are_the_services_own_measure():
    """From the moment an iteration opened to each rank's last bucket; a rank's own is dropped."""
    ex, clock = make(world=2)
    open_all(ex)
    g = grads(world=2)
    clock.now = 0.5
    push(ex, 0, g[0], telemetry=Telemetry(compute_s=0.1, finish_s=0.001))
    clock.now = 2.0
    out = push(ex, 1, g[1], telemetry=Telemetry(compute_s=0.1, finish_s=0.001))
    assert [t.finish_s for t in out[0][1].reports] == pytest.approx([0.5, 2.0])
    clock.now = 2.3                      # iteration 1 opened at 2.0, when the answers left
    push(ex, 1, g[1], iteration=1)
    clock.now = 2.4
    out = push(ex, 0, g[0], iteration=1)
    assert [t.finish_s for t in out[0][1].reports] == pytest.approx([0.4, 0.3])
