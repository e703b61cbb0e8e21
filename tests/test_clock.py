"""The event stamp (aiproxy/_fast/clock.pyx): one clock read per read callback."""

import time

from aiproxy._fast.clock import event_begin, event_end, event_now, monotonic


def test_monotonic_is_the_clock_behind_time_monotonic() -> None:
    a = time.monotonic()
    b = monotonic()
    c = time.monotonic()
    assert a <= b <= c


def test_event_now_returns_the_callbacks_stamp_until_it_ends() -> None:
    stamp = event_begin()
    try:
        time.sleep(0.002)
        assert event_now() == stamp
        # A nested begin (a callback run from inside another) keeps the outer stamp.
        assert event_begin() == stamp
        event_end()
        assert event_now() == stamp
    finally:
        event_end()
    after = event_now()
    assert after >= stamp + 0.002
    time.sleep(0.001)
    assert event_now() > after  # outside a callback: the clock itself


def test_an_unmatched_end_does_not_leave_a_stale_stamp() -> None:
    event_end()
    event_end()
    stamp = event_begin()
    event_end()
    time.sleep(0.001)
    assert event_now() > stamp
