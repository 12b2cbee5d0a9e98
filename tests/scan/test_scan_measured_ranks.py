"""Slow ranks from measured causes (scan/analyze/measured_ranks.py): a rank the time budget measures
slow and the others wait for is named even where the span rules name nobody; one that waits like
the others is not; pipeline stages are compared by the CPU the machine gave them, not their work."""

from __future__ import annotations

import dataclasses

from test_scan_budget import ITERATIONS, MS, _dp_job

from megatronapp.scan.analyze.budget_summary import RankBudget
from megatronapp.scan.analyze.detect import detect
from megatronapp.scan.analyze.measured_ranks import _excess_ns, _saving_ns, add_measured_ranks, descheduled_ratio


def _rules_missed(traces):
    """The rules' report on `traces` with their suspects taken away: what a miss looks like."""
    report = detect(traces)
    assert report.iterations_analyzed
    return dataclasses.replace(report, suspects=())


def test_a_descheduled_replica_the_rules_missed_is_named_with_its_measured_cause():
    # rank 2's forward took 30 ms of wall time for 10 ms of CPU: 20 ms runnable but not running
    traces = _dp_job({2: (30.0, 10.0)}, delay={2: (20.0, 0.0)})
    report = add_measured_ranks(_rules_missed(traces), traces)
    assert [(s.cause, s.rank) for s in report.suspects] == [("slow_compute", 2)]
    s = report.suspects[0]
    assert s.evidence["basis"] == "time_budget" and s.evidence["measured_cause"] == "descheduled"
    assert abs(s.saving_ns - 20 * MS) <= 1 * MS  # the others waited 20 ms for it


def test_a_clean_job_gets_no_measured_suspect():
    traces = _dp_job({})
    assert add_measured_ranks(_rules_missed(traces), traces).suspects == ()


def test_ranks_sharing_cores_that_wait_for_cpu_a_little_longer_than_their_peers_are_not_named():
    # every replica waits 10 ms for a core, rank 2 waits 18 ms: 1.8x, what a clean run on shared cores shows
    delays = dict.fromkeys(range(4), (10.0, 0.0)) | {2: (18.0, 0.0)}
    traces = _dp_job(dict.fromkeys(range(4), (20.0, 10.0)) | {2: (28.0, 10.0)}, delay=delays)
    assert add_measured_ranks(_rules_missed(traces), traces).suspects == ()
    delays[2] = (30.0, 0.0)  # 3x: a quota or a competing process
    traces = _dp_job(dict.fromkeys(range(4), (20.0, 10.0)) | {2: (40.0, 10.0)}, delay=delays)
    assert [s.rank for s in add_measured_ranks(_rules_missed(traces), traces).suspects] == [2]


def test_a_rank_the_rules_named_keeps_their_evidence_and_the_larger_saving():
    traces = _dp_job({2: (30.0, 10.0)}, delay={2: (20.0, 0.0)})
    found = detect(traces)
    assert [s.rank for s in found.suspects] == [2]
    weak = dataclasses.replace(found.suspects[0], what_if_iteration_ns=found.suspects[0].iteration_ns - 1 * MS)
    report = add_measured_ranks(dataclasses.replace(found, suspects=(weak,)), traces)
    (s,) = report.suspects
    assert s.evidence["basis"] == weak.evidence["basis"] and s.evidence["measured_cause"] == "descheduled"
    assert s.saving_ns > 10 * MS


def test_a_replica_the_rules_time_slow_is_dropped_when_the_budget_measures_only_a_busy_machine():
    # every replica waits 10 ms for a core, rank 2 waits 18 ms (1.8x) and its forward takes 8 ms longer
    delays = dict.fromkeys(range(4), (10.0, 0.0)) | {2: (18.0, 0.0)}
    traces = _dp_job(dict.fromkeys(range(4), (20.0, 10.0)) | {2: (28.0, 10.0)}, delay=delays)
    found = detect(traces)
    assert [(s.rank, s.evidence["basis"]) for s in found.suspects] == [(2, "dp_replicas")]
    report = add_measured_ranks(found, traces)
    assert report.suspects == ()
    assert any(n.startswith("rank 2 computes slower") and "1.8x" in n for n in report.notes)
    # the same wall time from its own work (18 ms of CPU) is the rank's: kept
    traces = _dp_job(
        dict.fromkeys(range(4), (20.0, 10.0)) | {2: (28.0, 18.0)}, delay=dict.fromkeys(range(4), (10.0, 0.0))
    )
    assert [s.rank for s in add_measured_ranks(detect(traces), traces).suspects] == [2]
    # 3x its peers' run-queue delay: a quota or a competing process, kept
    delays[2] = (30.0, 0.0)
    traces = _dp_job(dict.fromkeys(range(4), (20.0, 10.0)) | {2: (40.0, 10.0)}, delay=delays)
    assert [s.rank for s in add_measured_ranks(detect(traces), traces).suspects] == [2]


def _rank_budget(rank: int, excess: dict[str, float]) -> RankBudget:
    median = dict.fromkeys(("wall", "own", "descheduled", "throttled", "waiting", "transfer", "rest"), 0.0)
    return RankBudget(rank, {}, ITERATIONS, True, median, (0,), 1.5, excess, True, "own work")


def test_a_slow_rank_saves_only_what_the_others_wait_for_it():
    rb = _rank_budget(1, {"own": 30 * MS, "descheduled": 0.0, "rest": 0.0})
    assert _saving_ns(rb, 30 * MS, {0: 50 * MS, 1: 0.0, 2: 40 * MS}) == 30 * MS  # the others wait longer
    assert _saving_ns(rb, 30 * MS, {0: 10 * MS, 1: 0.0, 2: 10 * MS}) == 10 * MS
    assert _saving_ns(rb, 30 * MS, {0: 10 * MS, 1: 12 * MS, 2: 10 * MS}) == 0.0  # it waits as long: off the path


def test_pipeline_stages_are_compared_by_their_descheduled_time_only():
    rb = _rank_budget(1, {"own": 30 * MS, "descheduled": 5 * MS, "rest": 1 * MS})
    assert _excess_ns(rb, "pipeline_stages") == 5 * MS  # the last stage's loss is its work, not a fault
    assert _excess_ns(rb, "dp_replicas") == 36 * MS


def _delayed(rank: int, descheduled_ms: float, peers: tuple[int, ...]) -> RankBudget:
    median = dict.fromkeys(("wall", "own", "throttled", "waiting", "transfer", "rest"), 0.0)
    median["descheduled"] = descheduled_ms * MS
    return RankBudget(rank, {}, ITERATIONS, True, median, peers, 1.5, {}, True, "descheduled")


def test_a_peer_blocked_on_a_slow_link_is_no_baseline_for_waiting_on_the_cpu():
    # PP2 x DP2 on shared cores, 1 -> 3 rate-limited: rank 3 sleeps in its receives, so rank 2
    # (its only peer) reads 5x it, no more than ranks 0 and 1 wait for a core
    ranks = {
        0: _delayed(0, 9.0, (1,)),
        1: _delayed(1, 11.0, (0,)),
        2: _delayed(2, 10.0, (3,)),
        3: _delayed(3, 2.0, (2,)),
    }
    assert descheduled_ratio(ranks[2], ranks) == 5.0
    assert descheduled_ratio(ranks[2], ranks, frozenset({3})) == 1.0  # against ranks 0 and 1
    assert descheduled_ratio(ranks[0], ranks, frozenset({3})) == 9.0 / 11.0  # its own peer still counts
    ranks[2] = _delayed(2, 40.0, (3,))  # a competing process on rank 2: still several times the others
    assert descheduled_ratio(ranks[2], ranks, frozenset({3})) == 4.0
