"""The store's circuit breaker (``kvcodec.store.breaker``) on a fake clock."""
from __future__ import annotations

import pytest

from kvcodec.store.breaker import CLOSED, HALF_OPEN, OPEN, STATES, Breaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_failure_opens_it_and_requests_skip_the_store_until_the_cooldown():
    clock = Clock()
    b = Breaker(failures_to_open=1, cooldown_s=1.0, clock=clock)
    assert b.allow() and b.state == CLOSED
    b.failure("connection refused")
    assert b.state == OPEN and not b.allow() and b.opened == 1
    assert not b.take_probe()  # cooling down
    assert "connection refused" in b.describe() and "next probe in 1.0s" in b.describe()
    clock.t += 1.0
    assert b.take_probe() and b.state == HALF_OPEN
    assert not b.take_probe()  # one probe at a time
    assert not b.allow()  # requests still skip while the probe runs


def test_a_good_probe_closes_it_a_bad_one_opens_it_for_longer():
    clock = Clock()
    b = Breaker(cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    b.failure("reset")
    for cooldown in (2.0, 3.0, 3.0):  # doubled, up to the cap
        clock.t += b.cooldown_s
        assert b.take_probe()
        b.probe_done(False, "probe: timed out")
        assert b.state == OPEN and b.cooldown_s == cooldown and "timed out" in b.last_error
        clock.t += cooldown - 0.01
        assert not b.take_probe()
    clock.t += 0.01
    assert b.take_probe()
    b.probe_done(True)
    assert b.state == CLOSED and b.allow() and b.cooldown_s == 1.0 and b.opened == 4


def test_consecutive_failures_count_and_a_success_resets_them():
    b = Breaker(failures_to_open=3, clock=Clock())
    b.failure()
    b.failure()
    b.success()
    b.failure()
    b.failure()
    assert b.state == CLOSED
    b.failure()
    assert b.state == OPEN


def test_ordinary_outcomes_do_not_decide_while_it_is_not_closed():
    clock = Clock()
    b = Breaker(clock=clock)
    b.failure()
    b.success()  # a late answer of a call from before
    assert b.state == OPEN
    clock.t += 1.0
    assert b.take_probe()
    b.failure()
    b.success()
    assert b.state == HALF_OPEN
    b.probe_done(True)
    b.probe_done(False)  # a stray second report changes nothing
    assert b.state == CLOSED


def test_states_have_gauge_numbers_and_bad_settings_are_refused():
    assert STATES == {"closed": 0, "half-open": 1, "open": 2}
    with pytest.raises(ValueError):
        Breaker(failures_to_open=0)
    with pytest.raises(ValueError):
        Breaker(cooldown_s=5.0, max_cooldown_s=1.0)
