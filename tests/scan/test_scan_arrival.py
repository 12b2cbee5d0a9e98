"""Arrival-order evidence (scan/analyze/detect_arrival.py) on synthetic collective instances:
a rank late by its own work is named, one late because it waited on a receive is not, a clean
run names nobody."""

from __future__ import annotations

import random

import pytest

from megatronapp.scan.analyze.detect_arrival import compare_arrivals, compute_arrival_samples, min_wait_share
from megatronapp.scan.analyze.detect_config import DetectConfig, is_late_by_own_work
from megatronapp.scan.analyze.detect_links import P2PMessage
from megatronapp.scan.analyze.detect_rules import CollectiveInstance

MS = 1_000_000
GROUP = "0:[0, 1, 2, 3]"


def _dp_job(
    world: int, work_ms: dict[int, float], waits_ms: dict[int, float], iterations: int = 12, seed: int = 0
) -> tuple[list[CollectiveInstance], list[P2PMessage]]:
    """One all-reduce per iteration among `world` DP ranks. Each rank works work_ms[r] (default 10)
    after the previous all-reduce ends, with 5% jitter, plus waits_ms[r] spent in a receive from
    rank `world` (outside the group) before it arrives."""
    rng = random.Random(seed)
    instances, messages, t = [], [], 0
    for it in range(iterations):
        spans = {}
        for r in range(world):
            work = work_ms.get(r, 10.0) * MS * rng.uniform(0.95, 1.05)
            wait = waits_ms.get(r, 0.0) * MS
            if wait:
                messages.append(P2PMessage(world, r, it, it, 1024, int(t + wait), int(t), int(t), int(t + wait)))
            spans[r] = int(t + wait + work)
        last = max(spans, key=lambda r: (spans[r], r))
        end = spans[last] + MS
        instances.append(
            CollectiveInstance(GROUP, "dp", it, it, {r: (s, end) for r, s in spans.items()}, last, spans[last])
        )
        t = end
    return instances, messages


def _ten_collectives_an_iteration(iterations: int, work_ns) -> list[CollectiveInstance]:
    """FSDP2-like: 4 DP ranks meet ten times an iteration; before meeting k each rank r works
    work_ns(r, k) after the previous meeting ends (0.1 ms after its last member arrived)."""
    instances, t = [], 0
    for it in range(iterations):
        for k in range(10):
            spans = {r: int(t + work_ns(r, k)) for r in range(4)}
            last = max(spans, key=lambda r: (spans[r], r))
            end = spans[last] + MS // 10
            instances.append(
                CollectiveInstance(
                    GROUP, "dp", it * 10 + k, it, {r: (s, end) for r, s in spans.items()}, last, spans[last]
                )
            )
            t = end
    return instances


def _named(instances, messages, config=DetectConfig()) -> list[int]:
    stats = compare_arrivals(compute_arrival_samples(instances, messages), instances, config.compute_min_ratio)
    return sorted(r for r, st in stats.items() if is_late_by_own_work(st, config))


@pytest.mark.parametrize("slow", [0, 3])
def test_a_rank_late_by_its_own_work_is_named(slow):
    instances, messages = _dp_job(4, {slow: 14.0}, {})
    assert _named(instances, messages) == [slow]
    stats = compare_arrivals(compute_arrival_samples(instances, messages), instances, 1.2)[slow]
    assert stats.last_share > 0.9 and stats.wait_share > 0.9 and stats.ratio == pytest.approx(1.4, rel=0.1)
    assert stats.median_lateness_ns == pytest.approx(4 * MS, rel=0.3)


def test_a_rank_late_because_it_waited_on_a_receive_is_not_named():
    """Its arrival is as late as a straggler's, but the lateness is a wait, not its own work."""
    instances, messages = _dp_job(4, {}, {2: 4.0})
    assert _named(instances, messages) == []
    stats = compare_arrivals(compute_arrival_samples(instances, messages), instances, 1.2)[2]
    assert stats.last_share > 0.9  # last every time: arrival order alone would name it
    assert _named(instances, []) == [2]  # without the receive on record it would be named


def test_a_receivers_cold_compute_after_a_long_wait_is_explained_by_the_wait():
    """Own work a little above the peers' (cold after waiting), lateness mostly the wait."""
    instances, messages = _dp_job(4, {1: 12.5}, {1: 20.0})
    assert _named(instances, messages) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_clean_run_names_nobody(seed):
    instances, messages = _dp_job(4, {}, {}, iterations=24, seed=seed)
    assert _named(instances, messages) == []


def test_a_straggler_late_only_at_the_first_of_many_collectives_per_iteration_is_named():
    """FSDP2-like: ten collectives an iteration, the straggler's extra work before the first one
    only; afterwards it is in lockstep with the others (last about as often as they)."""
    rng = random.Random(3)
    instances = _ten_collectives_an_iteration(
        12, lambda r, k: (8.0 if (r == 1 and k == 0) else 2.0) * MS * rng.uniform(0.97, 1.03)
    )
    assert _named(instances, []) == [1]
    stats = compare_arrivals(compute_arrival_samples(instances, []), instances, 1.2)[1]
    assert stats.last_share < 0.5 < 0.9 < stats.wait_share  # last at a few, but the cause of nearly all waiting


def test_the_first_instance_has_no_window_and_is_skipped():
    instances, messages = _dp_job(2, {1: 15.0}, {}, iterations=3)
    samples = compute_arrival_samples(instances, messages)
    assert sorted({s.seq for s in samples}) == [1, 2]


def test_a_rank_late_because_its_send_waited_for_a_blocked_receiver_is_not_named():
    """The receiver of a rate-limited link sends back to the link's blocked sender: its send returns
    only once that rank posts the receive (a PP2 x DP2 design run named it 1.76x by its own work).
    Here rank 2 spends 4 of its 14 ms before each all-reduce in such a send."""
    instances, _ = _dp_job(4, {2: 14.0}, {})
    messages = []
    for prev, inst in zip(instances, instances[1:]):  # to rank 4 (outside the group), posted 4 ms late
        start = prev.spans[2][1] + MS
        messages.append(
            P2PMessage(
                2,
                4,
                inst.iteration,
                inst.seq,
                1024,
                start,
                start + 4 * MS,
                start + 4 * MS,
                start + 4 * MS + MS // 10,
                send_end=start + 4 * MS + MS // 10,
            )
        )
    assert _named(instances, messages) == []
    blind = [
        P2PMessage(m.src, m.dst, m.iteration, m.seq, m.bytes, m.send_start, m.recv_start, m.wait_start, m.recv_end)
        for m in messages
    ]  # the send's end unknown: its wait is not seen
    assert _named(instances, blind) == [2]


def _jittery_fsdp_job(extra_ms: float, seed: int) -> list[CollectiveInstance]:
    """Ten collectives an iteration among 4 ranks, each rank's work before each one 2 ms plus an
    exponential jitter of mean 1 ms (CPU processes sharing cores); rank 1 works extra_ms more
    before the first one only (its data step)."""
    rng = random.Random(seed)
    return _ten_collectives_an_iteration(
        16, lambda r, k: (2.0 + (extra_ms if (r == 1 and k == 0) else 0.0) + rng.expovariate(1.0)) * MS
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_straggler_whose_share_the_others_jitter_dilutes_is_named(seed):
    """The jitter of nine lockstep collectives leaves the straggler 0.55-0.57 of the waiting at dp 4:
    more than twice a fair share, yet short of a flat 0.6. The bar is measured from a fair share."""
    instances = _jittery_fsdp_job(10.0, seed)
    stats = compare_arrivals(compute_arrival_samples(instances, []), instances, 1.2)
    assert 0.5 < stats[1].wait_share < 0.6
    assert _named(instances, []) == [1]
    assert _named(_jittery_fsdp_job(0.0, seed), []) == []


def test_the_wait_share_bar_is_measured_from_a_fair_share():
    excess = DetectConfig().arrival_min_excess_share
    assert min_wait_share(0.5, excess) == pytest.approx(0.75)  # 1.5x a fair share binds at 2 members
    assert min_wait_share(0.25, excess) == pytest.approx(0.25 + 0.75 * excess)
    assert min_wait_share(0.25, 1.0) == pytest.approx(1.0)


def _job_with_stretched_receives(stretched: set[int], send_end_known: bool) -> tuple[list, list]:
    """4 DP ranks working 10 ms an iteration; before its work rank 2 receives from rank 4 (outside the
    group), sent 1 ms into the iteration. In `stretched` iterations the sender was frozen inside that
    send: it returned, and the message landed, 20 ms later."""
    instances, messages, t = [], [], 0
    for it in range(12):
        landed = t + (21 if it in stretched else 1) * MS
        messages.append(
            P2PMessage(4, 2, it, it, 1024, t + MS, t, t, landed, send_end=landed - MS // 10 if send_end_known else -1)
        )
        spans = dict.fromkeys((0, 1, 3), t + 10 * MS) | {2: landed + 10 * MS}
        end = spans[2] + MS
        instances.append(CollectiveInstance(GROUP, "dp", it, it, {r: (s, end) for r, s in spans.items()}, 2, spans[2]))
        t = end
    return instances, messages


def test_a_receive_stretched_by_a_sender_frozen_mid_send_is_waiting_not_own_work():
    """A throttled sender frozen inside its send returns late, and the message lands when it does: the
    receiver waited on it, however much longer than the link's usual transfer that took. Read without
    the send's return, the stretch is the receiver's own work in those iterations (a pipeline
    neighbour of a quota-throttled stage was named intermittently slow this way)."""
    stretched = {3, 7, 10}
    own = {
        it: s
        for s in compute_arrival_samples(*_job_with_stretched_receives(stretched, True))
        if s.rank == 2
        for it in [s.iteration]
    }
    assert own and all(s.own_ns < 1.2 * s.peer_own_ns for s in own.values())
    blind = {
        s.iteration: s for s in compute_arrival_samples(*_job_with_stretched_receives(stretched, False)) if s.rank == 2
    }
    assert all(blind[it].own_ns > 2 * blind[it].peer_own_ns for it in stretched)


def test_a_send_blocked_by_a_receiver_frozen_mid_receive_is_waiting_not_own_work():
    """Rank 2 sends to rank 4 (outside the group) before its work; in three iterations the receiver,
    frozen mid-receive behind a full link, drains the message 20 ms late and rank 2's send returns
    only then. That is rank 2 waiting, not working (two faults at once: the slow link's sender was
    named a slow rank when the slow rank was its receiver)."""
    stretched = {3, 7, 10}
    instances, messages, t = [], [], 0
    for it in range(12):
        drained = t + (21 if it in stretched else 1) * MS
        messages.append(P2PMessage(2, 4, it, it, 1024, t, t, t, drained, send_end=drained - MS // 10))
        spans = dict.fromkeys((0, 1, 3), t + 10 * MS) | {2: drained + 10 * MS}
        end = spans[2] + MS
        instances.append(CollectiveInstance(GROUP, "dp", it, it, {r: (s, end) for r, s in spans.items()}, 2, spans[2]))
        t = end
    own = [s for s in compute_arrival_samples(instances, messages) if s.rank == 2]
    assert own and all(s.own_ns < 1.2 * s.peer_own_ns for s in own)


def test_time_in_another_groups_slow_collective_is_not_own_work():
    """Rank 2 (a last stage) first syncs its embedding with rank 0 across a slow pipeline link (20 ms
    of transfer after both arrived, every iteration), while its DP peer 3 syncs with rank 1 in 1 ms;
    both then work 10 ms before their DP all-reduce. Rank 2 arrives there 19 ms late, yet not by its
    own work (a slow link's sender was named a slow rank this way)."""
    instances, t = [], 0
    for it in range(12):
        spans = {}
        for r, peer, transfer in ((2, 0, 20), (3, 1, 1)):
            end = t + transfer * MS
            instances.append(CollectiveInstance(f"emb:[{peer},{r}]", "pp", it, it, {peer: (t, end), r: (t, end)}, r, t))
            spans[r] = end + 10 * MS
        end = max(spans.values()) + MS
        instances.append(
            CollectiveInstance("2:[2,3]", "dp", it, it, {r: (s, end) for r, s in spans.items()}, 2, spans[2])
        )
        t = end
    samples = [s for s in compute_arrival_samples(instances, []) if s.family == "dp" and s.rank == 2]
    assert samples and all(s.lateness_ns > 15 * MS and s.own_ns < 1.2 * s.peer_own_ns for s in samples)
    assert _named(instances, []) == []
