"""Ranks descheduled in bursts, from the run-queue delay each iteration measured (pure).

A process that competes for a rank's core in bursts, or a CPU quota that bites now and then,
takes the rank's CPU in some iterations only: its medians move little (measured_ranks.py judges
medians), and the time may fall between its spans, where the span rules do not look. The
run-queue delay each iteration records (budget.py: "descheduled", cgroup throttling included)
shows it where it happens. Every rank is compared with all the others judged: the machine gives
every rank the same CPU whatever its role, and a rank's one DP replica or TP partner alone is
too noisy a baseline.

  1. Bursts: iterations where the rank's delay exceeds the median of the other ranks' by at least
     `burst_min_ns` and by `burst_min_share` of their median wall time there.
  2. Its cost: per burst iteration min(excess, the median of the other ranks' waiting - its own
     waiting), the critical-path bound of measured_ranks' step 2, summed over the bursts and
     divided by the run's iterations: a mean, as every intermittent suspect's.
  3. Named: at least `burst_min_iterations` bursts, and a cost at least `burst_min_lead`
     times the largest of the other ranks', each counted the same way. Ranks sharing cores all
     wait for CPU, and on an oversubscribed host every rank bursts in 10-50% of its iterations;
     what a fault adds is a rank whose bursts cost the job far more than anybody else's. On the
     2-core machine's design runs the faults this rule alone found (a competing process or a
     CPU quota in 300 ms bursts) led the next rank by 4.6-27x; clean and noisy runs by at most
     1.6x (2.5x once, at 0.5 % of the iteration), the pipeline neighbour of a stage slowed in
     bursts by 2.2x. Frequency alone does not separate them: a rank a quota holds back bursts
     less often than its busy peers, but for longer.
  4. Intermittent when the bursts are in at most `intermittent_max_share` of the iterations; in
     more, the rank is slow in most iterations yet below the median rule's bar (a competing
     process holding the core 300 ms of every second moves the median 1.5-2.5x).
  The impact gate then judges the cost on the burst iterations (impact_gate.gated_share).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatronapp.scan.analyze.budget_summary import RankBudget


@dataclass(frozen=True)
class Bursts:
    rank: int
    iterations: int  # iterations judged
    burst_iterations: tuple[int, ...]
    excess_ns: dict[int, float]  # burst iteration -> its delay over the others' median
    saving_ns: float  # step 2: mean per iteration
    lead: float  # step 3: its saving over the largest of the other ranks' (inf when theirs is 0)


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


def burst_saving_ns(bursts: dict[int, float], rank: int, by_rank: dict[int, RankBudget], n: int) -> float:
    """Step 2."""
    total = 0.0
    for it, excess in bursts.items():
        others = [r.per_iteration_ns["waiting"].get(it) for q, r in by_rank.items() if q != rank]
        others = [w for w in others if w is not None]
        own = by_rank[rank].per_iteration_ns["waiting"].get(it, 0.0)
        if others:
            total += max(0.0, min(excess, float(np.median(others)) - own))
    return total / max(n, 1)


def judge_bursts(
    ranks: list[RankBudget],
    by_rank: dict[int, RankBudget],
    min_ns: float,
    min_share: float,
    explained: frozenset = frozenset(),
) -> dict[int, Bursts]:
    """Steps 1-3 for every rank of `ranks` against the others of `ranks`: rank -> Bursts (ranks
    without an iteration shared with another left out). `by_rank`: every rank of the job, whose
    waiting bounds the cost; `explained`: ranks already named, whose cost no other rank must
    outdo (a second fault stays visible beside the first)."""
    out = {}
    for rb in ranks:
        others = [q for q in ranks if q is not rb]
        n = len(_excess_by_iteration(rb, others))
        if n:
            bursts = find_bursts(rb, others, min_ns, min_share)
            out[rb.rank] = (n, bursts, burst_saving_ns(bursts, rb.rank, by_rank, n))
    judged = {}
    for r, (n, bursts, saving) in out.items():
        rest = max((s for q, (_, _, s) in out.items() if q != r and q not in explained), default=0.0)
        lead = saving / rest if rest > 0 else float("inf") if saving > 0 else 0.0
        judged[r] = Bursts(r, n, tuple(sorted(bursts)), bursts, saving, lead)
    return judged


def is_burst_slow(b: Bursts, min_iterations: int, min_lead: float) -> bool:
    """Step 3."""
    return len(b.burst_iterations) >= min_iterations and b.saving_ns > 0 and b.lead >= min_lead


def is_intermittent_burst(b: Bursts, max_share: float) -> bool:
    """Step 4."""
    return len(b.burst_iterations) <= max_share * b.iterations
