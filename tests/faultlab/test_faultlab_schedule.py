"""A fault's schedule (no processes involved) and the cores a lab keeps its faults to."""

import multiprocessing
import os
import threading
import time

import pytest

from megatronapp.faultlab import SlowRank
from megatronapp.faultlab.cpu import Schedule, _Toggler, lab_cores


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


def _cores_of_a_lab_pinned_to(core: int, queue) -> None:
    os.sched_setaffinity(0, {core})
    queue.put(lab_cores())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_lab_started_on_some_cores_keeps_its_faults_on_those_cores():
    core = max(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_cores_of_a_lab_pinned_to, args=(core, queue))
    proc.start()
    cores = queue.get(timeout=60)
    proc.join(timeout=60)
    assert cores == [core]
    assert SlowRank(1, "quota", 2.0).quota_share(4, len(cores)) == pytest.approx(0.125)
