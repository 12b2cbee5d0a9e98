"""A fault's schedule: when a fault lab fault is switched on and off (no processes involved)."""

import threading
import time

import pytest

from megatronapp.faultlab.cpu import Schedule, _Toggler


def _switches(schedule: Schedule, seconds: float) -> list[tuple[float, bool]]:
    """(seconds since start, on) for every switch the toggler made in `seconds`."""
    seen, lock, t0 = [], threading.Lock(), time.monotonic()

    def switch(on: bool) -> None:
        with lock:
            seen.append((time.monotonic() - t0, on))

    toggler = _Toggler(switch, schedule)
    time.sleep(seconds)
    toggler.stop()
    return seen


def test_a_late_fault_stays_off_until_its_start_then_follows_its_period():
    seen = _switches(Schedule(on_ms=100, period_ms=200, start_ms=300), 0.55)
    assert seen[0][1] is False and seen[0][0] < 0.05  # off at once
    first_on = next(t for t, on in seen if on)
    assert 0.29 <= first_on < 0.4
    assert [on for _, on in seen][:3] == [False, True, False]


def test_a_fault_that_stops_is_on_from_the_start_then_off_for_the_rest_of_the_run():
    seen = _switches(Schedule(on_ms=150, period_ms=10_000_000), 0.4)
    assert [on for _, on in seen] == [True, False]
    assert 0.14 <= seen[1][0] < 0.3


def test_a_negative_start_is_refused():
    with pytest.raises(ValueError, match="start_ms"):
        Schedule(on_ms=1, period_ms=2, start_ms=-1)
