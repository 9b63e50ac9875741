"""The timeouts object: backoff bounds, jitter within its range, seeded draws, today's defaults."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ps_common.timeouts import DEFAULT_TIMEOUTS, Backoff, Timeouts


def test_ceiling_grows_by_the_factor_up_to_the_cap():
    b = Backoff(initial_s=0.25, max_s=5.0, factor=2.0)
    assert [b.ceiling(n) for n in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.ceiling(100_000) == 5.0  # no overflow however many retries
    assert Backoff(initial_s=1.0, max_s=1.0, factor=1.0).ceiling(10) == 1.0


def test_without_jitter_the_delay_is_the_ceiling():
    b = Backoff(initial_s=0.1, max_s=3.0, factor=3.0)
    rng = random.Random(0)
    assert [b.delay(n, rng) for n in range(5)] == [b.ceiling(n) for n in range(5)]


def test_jittered_delays_stay_within_their_range_and_spread():
    b = Backoff(initial_s=0.25, max_s=5.0, factor=2.0, jitter=0.2)
    rng = random.Random(7)
    for attempt in range(8):
        ceiling = b.ceiling(attempt)
        draws = [b.delay(attempt, rng) for _ in range(500)]
        assert all(0.8 * ceiling <= d <= ceiling for d in draws)
        assert max(draws) - min(draws) > 0.15 * ceiling, "jitter should spread the retries"


def test_jitter_is_reproducible_with_a_seed():
    b = Backoff(initial_s=0.5, max_s=8.0, jitter=0.5)
    first = [b.delay(n, random.Random(42)) for n in range(6)]
    again = [b.delay(n, random.Random(42)) for n in range(6)]
    other = [b.delay(n, random.Random(43)) for n in range(6)]
    assert first == again and first != other


@pytest.mark.parametrize("kwargs", [
    {"initial_s": 0.0, "max_s": 1.0},
    {"initial_s": 2.0, "max_s": 1.0},
    {"initial_s": 1.0, "max_s": 2.0, "factor": 0.5},
    {"initial_s": 1.0, "max_s": 2.0, "jitter": 1.0},
    {"initial_s": 1.0, "max_s": 2.0, "jitter": -0.1},
])
def test_bad_backoff_is_refused(kwargs):
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_negative_attempt_is_refused():
    with pytest.raises(ValueError):
        Backoff(initial_s=1.0, max_s=2.0).ceiling(-1)


def test_defaults_are_the_values_the_code_used_before():
    t = DEFAULT_TIMEOUTS
    assert (t.reply_s, t.auth_check_s) == (30.0, 0.25)
    assert (t.pull_poll_s, t.stop_drain_s, t.leave_s, t.heartbeat_stop_s) == (0.5, 0.2, 2.0, 5.0)
    assert (t.loop_poll_s, t.tick_s, t.finish_linger_s) == (0.05, 0.1, 0.2)
    assert (t.register_attempt_s, t.rollback_send_s, t.rollback_reply_s) == (2.0, 2.0, 5.0)
    # the worker's rejoin waited 0.25 s, doubling to 5 s; jitter only ever shortens a wait
    assert [t.rejoin.ceiling(n) for n in range(6)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0]
    assert 0 < t.rejoin.jitter < 1


def test_timeouts_are_frozen_and_replaceable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TIMEOUTS.tick_s = 1.0  # type: ignore[misc]
    short = dataclasses.replace(DEFAULT_TIMEOUTS, reply_s=1.0)
    assert short.reply_s == 1.0 and short.tick_s == DEFAULT_TIMEOUTS.tick_s
    assert Timeouts() == DEFAULT_TIMEOUTS
