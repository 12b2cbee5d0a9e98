"""Ranks descheduled in bursts, from per-iteration run-queue delay (measured_intermittent.py): a
rank whose waits for a CPU cost the job far more than any other rank's is named with those
iterations; the same waits spread over every rank name nobody."""

from __future__ import annotations

import random

from megatronapp.scan.analyze.budget_summary import RankBudget
from megatronapp.scan.analyze.detect_config import DetectConfig
from megatronapp.scan.analyze.measured_intermittent import (
    find_bursts,
    is_burst_slow,
    is_intermittent_burst,
    judge_bursts,
)

MS = 1_000_000
N = 200  # iterations: a traced lab run has 100-300
CONFIG = DetectConfig()


def _rank(rank: int, delays: dict[int, float], waiting: dict[int, float] | None = None) -> RankBudget:
    """A rank of a 4-replica job, 40 ms iterations, `delays` (iteration -> ms) of run-queue delay."""
    series = {
        "wall": dict.fromkeys(range(N), 40.0 * MS),
        "descheduled": {i: delays.get(i, 1.0) * MS for i in range(N)},
        "waiting": {i: (waiting or {}).get(i, 5.0) * MS for i in range(N)},
    }
    peers = tuple(p for p in range(4) if p != rank)
    median = dict.fromkeys(("wall", "own", "descheduled", "throttled", "waiting", "transfer", "rest"), 0.0)
    return RankBudget(rank, {}, N, True, median, peers, 1.0, {}, False, None, series)


def _noise(seed: int) -> dict[int, float]:
    """A shared machine: every rank now and then waits 6-15 ms for a core (3 % of iterations)."""
    rng = random.Random(seed)
    return {i: rng.uniform(6.0, 15.0) for i in range(N) if rng.random() < 0.03}


def _job(burst_rank: int | None, burst_every: int = 12) -> dict[int, RankBudget]:
    ranks = {}
    for r in range(4):
        delays = _noise(r)
        waiting = {}
        if r == burst_rank:  # a competing process 25 ms in every 12th iteration; the others wait for it
            delays |= dict.fromkeys(range(3, N, burst_every), 26.0)
        elif burst_rank is not None:
            waiting = dict.fromkeys(range(3, N, burst_every), 30.0)
        ranks[r] = _rank(r, delays, waiting)
    return ranks


def _judge(ranks: dict[int, RankBudget], explained: frozenset = frozenset()):
    return judge_bursts(list(ranks.values()), ranks, 2 * MS, 0.1, explained)


def _named(ranks: dict[int, RankBudget], explained: frozenset = frozenset()) -> list[int]:
    return [
        r
        for r, b in _judge(ranks, explained).items()
        if r not in explained and is_burst_slow(b, CONFIG.burst_min_iterations, CONFIG.burst_min_lead)
    ]


def test_a_rank_descheduled_in_every_twelfth_iteration_is_named_with_those_iterations():
    ranks = _job(2)
    b = _judge(ranks)[2]
    assert set(range(3, N, 12)) <= set(b.burst_iterations)
    assert _named(ranks) == [2] and is_intermittent_burst(b, 0.5)
    assert 1.5 * MS < b.saving_ns < 2.5 * MS  # 25 ms in 17 of 200 iterations, all of it waited for
    assert b.lead > 3.0


def test_waits_for_a_core_spread_over_every_rank_name_nobody():
    ranks = _job(None)
    assert _named(ranks) == []
    assert all(b.lead < CONFIG.burst_min_lead for b in _judge(ranks).values())


def test_a_burst_must_stand_above_the_peers_by_the_floor_and_the_share():
    peers = [_rank(p, {}) for p in (0, 1, 3)]
    small = _rank(2, {5: 2.5, 6: 3.5, 7: 5.5})  # 1.5, 2.5 and 4.5 ms over the peers' 1 ms; share 10 % = 4 ms
    assert find_bursts(small, peers, 2 * MS, 0.1) == {7: 4.5 * MS}


def test_a_few_long_stalls_are_not_enough_to_name_a_rank():
    ranks = {r: _rank(r, _noise(r), {40: 30.0, 90: 30.0, 150: 30.0}) for r in (0, 1, 3)}  # waiting for rank 2
    ranks[2] = _rank(2, {40: 30.0, 90: 30.0, 150: 30.0})
    b = _judge(ranks)[2]
    assert b.lead > CONFIG.burst_min_lead and len(b.burst_iterations) < CONFIG.burst_min_iterations
    assert _named(ranks) == []


def test_a_rank_descheduled_in_most_iterations_is_named_but_not_intermittent():
    ranks = _job(None)
    many = set(range(0, N, 2)) | set(range(1, N, 3))
    ranks[2] = _rank(2, _noise(2) | dict.fromkeys(many, 26.0))
    for r in (0, 1, 3):
        ranks[r] = _rank(r, _noise(r), dict.fromkeys(many, 30.0))
    b = _judge(ranks)[2]
    assert len(b.burst_iterations) > 0.5 * N and _named(ranks) == [2] and not is_intermittent_burst(b, 0.5)


def test_a_rank_already_named_does_not_hide_a_second_one():
    first, second = range(5, N, 4), range(3, N, 12)  # disjoint: rank 0 bursts 40 ms, rank 2 26 ms
    ranks = {}
    for r in range(4):
        delays = _noise(r) | (dict.fromkeys(first, 40.0) if r == 0 else dict.fromkeys(second, 26.0) if r == 2 else {})
        waiting = (dict.fromkeys(first, 45.0) if r != 0 else {}) | (dict.fromkeys(second, 30.0) if r != 2 else {})
        ranks[r] = _rank(r, delays, waiting)
    assert _named(ranks) == [0]  # rank 0's bursts cost the job several times rank 2's
    assert 2 not in _named(ranks)
    assert _named(ranks, frozenset({0})) == [2]
