"""Intermittently descheduled ranks, from the run-queue delay each iteration measured (pure).

A process that competes for a rank's core in bursts, or a CPU quota that bites now and then,
takes the rank's CPU in a few iterations only: its medians do not move (measured_ranks.py judges
medians), and the time may fall between its spans, where the span rules do not look. The
run-queue delay each iteration records (budget.py: "descheduled", cgroup throttling included)
shows it where it happens. Per rank, over its baseline peers (measured_ranks.baseline_peers):

  1. Bursts: iterations where the rank's delay exceeds the median of its peers' by at least
     `burst_min_ns` and by `burst_min_share` of their median wall time there.
  2. The clean rate p0: the bursts of each baseline peer counted the same way against the others
     (the rank itself left out), (bursts + 1/2) / (iterations + 1) over them, so never zero. Ranks
     sharing cores all wait for CPU now and then; what stands out is a rank that waits far more
     often than its peers do.
  3. Intermittent: bursts in at most `intermittent_max_share` of the iterations (more is a
     constant slowdown, the median rule's), at least `intermittent_min_iterations`, and
     P(Binomial(n, p0) >= episodes) x (ranks judged) <= `intermittent_alpha`, adjacent burst
     iterations counting as one episode (contention that lasts is one event), as for the span
     rules' intermittent test (detect_intermittent.py).
  4. Its saving: per burst iteration min(excess, the median of the other ranks' waiting - its
     own waiting), the same critical-path bound as measured_ranks' step 2, summed over the
     bursts and divided by the run's iterations: a mean, as every intermittent suspect's; the
     impact gate judges it on the burst iterations (impact_gate.gated_share).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatronapp.scan.analyze.budget_summary import RankBudget
from megatronapp.scan.analyze.detect_intermittent import binomial_tail, count_episodes


@dataclass(frozen=True)
class Bursts:
    rank: int
    iterations: int  # iterations judged
    burst_iterations: tuple[int, ...]
    excess_ns: dict[int, float]  # burst iteration -> its delay over the peers' median
    clean_rate: float  # p0 (step 2)
    p_value: float  # step 3, Bonferroni over the ranks judged
    saving_ns: float  # step 4: mean per iteration


def _excess_by_iteration(rank: RankBudget, peers: list[RankBudget]) -> dict[int, tuple[float, float]]:
    """iteration -> (the rank's delay - the peers' median delay, the peers' median wall time)."""
    mine = rank.per_iteration_ns.get("descheduled", {})
    out = {}
    for it, delay in mine.items():
        theirs = [
            p.per_iteration_ns["descheduled"][it] for p in peers if it in p.per_iteration_ns.get("descheduled", {})
        ]
        if theirs:
            walls = [p.per_iteration_ns["wall"][it] for p in peers if it in p.per_iteration_ns.get("wall", {})]
            out[it] = (delay - float(np.median(theirs)), float(np.median(walls)) if walls else 0.0)
    return out


def find_bursts(rank: RankBudget, peers: list[RankBudget], min_ns: float, min_share: float) -> dict[int, float]:
    """Step 1: burst iteration -> its excess delay over the peers'."""
    return {
        it: excess
        for it, (excess, wall) in _excess_by_iteration(rank, peers).items()
        if excess >= max(min_ns, min_share * wall)
    }


def compute_clean_rate(peers: list[RankBudget], min_ns: float, min_share: float) -> float:
    """Step 2: the rate at which the baseline peers burst against each other."""
    bursts = judged = 0
    for p in peers:
        others = [q for q in peers if q is not p]
        if others:
            bursts += len(find_bursts(p, others, min_ns, min_share))
            judged += len(_excess_by_iteration(p, others))
    return (bursts + 0.5) / (judged + 1)


def _saving_ns(bursts: dict[int, float], rank: int, by_rank: dict[int, RankBudget], n: int) -> float:
    """Step 4."""
    total = 0.0
    for it, excess in bursts.items():
        others = [r.per_iteration_ns["waiting"].get(it) for q, r in by_rank.items() if q != rank]
        others = [w for w in others if w is not None]
        own = by_rank[rank].per_iteration_ns["waiting"].get(it, 0.0)
        if others:
            total += max(0.0, min(excess, float(np.median(others)) - own))
    return total / max(n, 1)


def judge_bursts(
    rank: RankBudget,
    peers: list[RankBudget],
    by_rank: dict[int, RankBudget],
    judged_ranks: int,
    min_ns: float,
    min_share: float,
) -> Bursts | None:
    """Steps 1-4 for one rank against its baseline peers; None without a peer or an iteration."""
    n = len(_excess_by_iteration(rank, peers))
    if not peers or n == 0:
        return None
    bursts = find_bursts(rank, peers, min_ns, min_share)
    p0 = compute_clean_rate(peers, min_ns, min_share)
    p = min(1.0, binomial_tail(count_episodes(sorted(bursts)), n, p0) * max(judged_ranks, 1)) if bursts else 1.0
    saving = _saving_ns(bursts, rank.rank, by_rank, n)
    return Bursts(rank.rank, n, tuple(sorted(bursts)), bursts, p0, p, saving)


def is_intermittent_burst(b: Bursts, min_iterations: int, max_share: float, alpha: float) -> bool:
    """Step 3."""
    k = len(b.burst_iterations)
    return min_iterations <= k <= max_share * b.iterations and b.p_value <= alpha
