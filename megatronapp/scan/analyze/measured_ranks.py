"""Slow ranks from measured causes: a rank the time budget (budget_summary.py) measures slow, on
the iteration's critical path, is named even where the trace's span rules missed it.

The span rules judge wall-clock time. A rank the operating system deschedules (a CPU quota, a
competing process) wakes late from every receive, so in a pipeline its time reads as waiting and
its incoming links read slow; the rules then miss the rank. The budget measures the rank's own
CPU time and its run-queue delay instead. `add_measured_ranks`, over a DetectionReport (before
the impact gate):

  1. Candidates: ranks the budget calls slow whose CPU time and run-queue delay were both
     recorded (`measured`: a fallback to span wall time would be the rules' signal again), by
     being descheduled: a run-queue delay at least `config.descheduled_min_ratio` times their
     peers' (median over iterations each). Ranks sharing cores all wait for CPU, and in clean
     runs of four ranks on two cores one replica's delay reads 1.2-2x its peer's; a CPU quota or
     a competing process takes several times that. A peer that receives over a named slow link
     waits blocked, not runnable, and is left out of the baseline (a PP2 x DP2 job with 1 -> 3
     rate-limited read rank 2's delay as several times rank 3's on a shared 2-core machine). Only the descheduled part is the excess: a
     rank slow by its own work is the rules' to find (they time its compute against its peers').
  2. Critical path: fixing a rank saves what the others spend waiting for it, so its saving is
     min(its excess, the median of the other ranks' waiting - its own waiting), medians per
     iteration. A slow rank that waits as long as everyone else is not what they wait for.
  3. A candidate not already named slow becomes a slow-compute suspect with the budget's numbers
     and cause as its evidence (basis "time_budget"); the impact gate then judges its saving
     like any other suspect's.
  4. A rank the rules named that the budget measures slow (by any part) keeps the rules'
     evidence, with the measured cause beside it, and the larger of the two savings; but one
     they named for a constant compute ratio against its replicas or TP peers whose whole
     measured excess is run-queue delay below `descheduled_min_ratio` times its peers' is
     dropped, with a note: its CPU time is its peers', and a busy machine deschedules some rank
     that much (background noise on shared cores can hold one replica at ~2x its peers' delay
     for a whole short run, its compute then reading ~1.4x theirs).
  5. A rank still not named whose run-queue delay bursts far above the other ranks' in some
     iterations, at a cost to the job well above any other rank's bursts (measured_intermittent.py),
     is named with those iterations; the impact gate judges its saving on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatronapp.scan.analyze.budget_summary import CAUSES, BudgetSummary, RankBudget, compute_budget_summary
from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport, Suspect
from megatronapp.scan.analyze.detect_rules import to_ms
from megatronapp.scan.analyze.measured_intermittent import Bursts, is_burst_slow, is_intermittent_burst, judge_bursts

_SELF_PARTS = ("own", "descheduled", "rest")


def _excess_ns(rb: RankBudget, basis: str) -> float:
    """The time the rank took beyond its peers, from the parts that are comparable: stages differ
    in their own work by design, not in the CPU the machine gives them."""
    if basis == "pipeline_stages":
        return max(0.0, rb.excess_ns["descheduled"])
    return max(0.0, sum(rb.excess_ns[p] for p in _SELF_PARTS))


def baseline_peers(rb: RankBudget, by_rank: dict[int, RankBudget], asleep: frozenset = frozenset()) -> list[int]:
    """The ranks whose CPU waiting `rb`'s is compared with: its peers but those in `asleep`, or
    where those were all its peers, every other rank not in `asleep` (descheduled_ratio)."""
    baseline = [p for p in rb.peers if p in by_rank and p not in asleep]
    if not baseline and rb.peers:
        baseline = [p for p in by_rank if p != rb.rank and p not in asleep]
    return baseline


def descheduled_ratio(rb: RankBudget, by_rank: dict[int, RankBudget], asleep: frozenset = frozenset()) -> float:
    """Step 1: the rank's median run-queue delay over the median of its peers' (0 without peers;
    inf where only the rank was ever descheduled). Peers in `asleep` (receivers of a named slow
    link) spend their wait blocked, not runnable, so their delay is no baseline: the other ranks'
    is used where they were its only peers (the machine gives every stage the same CPU)."""
    peers = [by_rank[p].median_ns["descheduled"] for p in baseline_peers(rb, by_rank, asleep)]
    mine, ref = rb.median_ns["descheduled"], float(np.median(peers)) if peers else 0.0
    if ref > 0:
        return mine / ref
    return float("inf") if peers and mine > 0 else 0.0


def _saving_ns(rb: RankBudget, excess: float, waiting_by_rank: dict[int, float]) -> float:
    """Step 2: what the others would stop waiting were the rank as fast as its peers."""
    others = [w for r, w in waiting_by_rank.items() if r != rb.rank]
    if not others:
        return 0.0
    return max(0.0, min(excess, float(np.median(others)) - waiting_by_rank[rb.rank]))


def _suspect(rb: RankBudget, excess: float, saving: float, iteration_ns: float, basis: str) -> Suspect:
    peers = ", ".join(str(p) for p in rb.peers)
    own, desched = rb.median_ns["own"], rb.median_ns["descheduled"]
    summary = (
        f"rank {rb.rank} took {to_ms(excess)} ms per iteration beyond its peers [{peers}] outside communication "
        f"(measured: {to_ms(own)} ms CPU in its spans, {to_ms(desched)} ms runnable but not running); "
        f"cause: {rb.cause}; the other ranks wait {to_ms(saving)} ms for it"
    )
    evidence = {
        "summary": summary,
        "basis": "time_budget",
        "peer_basis": basis,
        "peers": list(rb.peers),
        "ratio": None if rb.self_ratio is None else round(rb.self_ratio, 3),
        "measured_cause": rb.cause,
        "excess_ms_per_iteration": to_ms(excess),
        "median_ms": {part: to_ms(v) for part, v in rb.median_ns.items()},
    }
    confidence = min(1.0, 0.5 + saving / max(iteration_ns, 1.0))
    return Suspect(rb.rank, rb.coords, "slow_compute", round(confidence, 3), evidence, None,
                   iteration_ns, iteration_ns - saving)  # fmt: skip


def add_measured_ranks(
    report: DetectionReport, traces: list, config: DetectConfig = DetectConfig(), summary: BudgetSummary | None = None
) -> DetectionReport:
    """`report` with the slow ranks the budget measures on the critical path (module docstring);
    `summary`: the budget of the report's iterations where the caller has it already."""
    if not report.iterations_analyzed or report.iteration_ns <= 0:
        return report
    summary = summary or compute_budget_summary(traces, report.iterations_analyzed)
    waiting = {rb.rank: rb.median_ns["waiting"] for rb in summary.ranks}
    by_rank = {rb.rank: rb for rb in summary.ranks}
    asleep = frozenset(s.link[1] for s in report.suspects if s.cause == "slow_link")
    found, added, notes = list(report.suspects), [], []
    for rb in summary.ranks:
        if not (rb.slow and rb.measured):
            continue
        named = next((i for i, s in enumerate(found) if s.cause == "slow_compute" and s.rank == rb.rank), None)
        if named is not None and _descheduled_by_chance(found[named], rb, by_rank, asleep, config):
            notes.append(_chance_note(rb, descheduled_ratio(rb, by_rank, asleep), config))
            del found[named]
        elif named is not None:
            saving = _saving_ns(rb, _excess_ns(rb, summary.basis), waiting)
            found[named] = _with_measured_saving(found[named], rb, saving)
        elif descheduled_ratio(rb, by_rank, asleep) >= config.descheduled_min_ratio:
            excess = max(0.0, rb.excess_ns["descheduled"])
            saving = _saving_ns(rb, excess, waiting)
            if saving > 0:
                added.append(_suspect(rb, excess, saving, report.iteration_ns, summary.basis))
    named = {s.rank for s in found if s.cause == "slow_compute"} | {s.rank for s in added}
    added += _intermittent_suspects(summary, by_rank, named, asleep, report.iteration_ns, config)
    return dataclasses.replace(report, suspects=_merge(tuple(found), added), notes=(*report.notes, *notes))


def _descheduled_by_chance(s: Suspect, rb: RankBudget, by_rank: dict, asleep: frozenset, config: DetectConfig) -> bool:
    """Step 4's exception: the rules timed the rank's compute slow in most iterations against peers
    doing identical work, and the budget finds nothing behind it but a run-queue delay in the
    range ranks sharing busy cores show (step 1)."""
    constant_ratio = s.evidence.get("basis") in ("dp_replicas", "tp_peers") and not s.evidence.get("intermittent")
    return (
        constant_ratio
        and rb.cause == CAUSES["descheduled"]
        and descheduled_ratio(rb, by_rank, asleep) < config.descheduled_min_ratio
    )


def _chance_note(rb: RankBudget, ratio: float, config: DetectConfig) -> str:
    return (
        f"rank {rb.rank} computes slower than its peers, but the time budget measures its CPU time as "
        f"theirs and its run-queue delay at {ratio:.1f}x theirs (below {config.descheduled_min_ratio:g}x: "
        f"what ranks sharing busy cores show): not named"
    )


def _intermittent_suspects(
    summary: BudgetSummary, by_rank: dict, named: set, asleep: frozenset, iteration_ns: float, config: DetectConfig
) -> list[Suspect]:
    """Step 5: ranks not named yet that the run-queue delay of a few iterations gives away."""
    ranks = [rb for rb in summary.ranks if rb.measured and rb.rank not in asleep]
    bursts = judge_bursts(ranks, by_rank, config.burst_min_ns, config.burst_min_share, frozenset(named))
    return [
        _burst_suspect(by_rank[r], b, iteration_ns, is_intermittent_burst(b, config.intermittent_max_share))
        for r, b in bursts.items()
        if r not in named
        and is_burst_slow(b, config.burst_min_iterations, config.burst_min_lead)
        and b.saving_ns >= config.intermittent_min_saving * iteration_ns  # as the span rules' (detect.py)
    ]


def _burst_suspect(rb: RankBudget, b: Bursts, iteration_ns: float, intermittent: bool) -> Suspect:
    its = list(b.burst_iterations)
    mean_excess = float(np.mean(list(b.excess_ns.values())))
    summary = (
        f"rank {rb.rank} waited for a CPU {to_ms(mean_excess)} ms longer than the other ranks "
        f"in iterations {its} ({len(its)} of {b.iterations}; measured run-queue delay)"
        f"{': intermittent' if intermittent else ''}; "
        f"the other ranks wait {to_ms(b.saving_ns)} ms per iteration for it on average, {_lead_text(b.lead)}"
    )
    evidence = {
        "summary": summary,
        "basis": "time_budget",
        "measured_cause": "descheduled",
        "intermittent": intermittent,
        "slow_iterations": its,
        "iterations": b.iterations,
        "lead": None if b.lead == float("inf") else round(b.lead, 2),
        "slow_iteration_excess_ms": {i: to_ms(v) for i, v in b.excess_ns.items()},
        "excess_ms_per_iteration": to_ms(b.saving_ns),
    }
    confidence = min(1.0, 0.5 + b.saving_ns * b.iterations / max(len(its), 1) / max(iteration_ns, 1.0))
    return Suspect(rb.rank, rb.coords, "slow_compute", round(confidence, 3), evidence, None,
                   iteration_ns, iteration_ns - b.saving_ns)  # fmt: skip


def _lead_text(lead: float) -> str:
    return (
        "while no other rank's waits cost them anything; that is more than" if lead == float("inf") else f"{lead:.1f}x"
    )


def _with_measured_saving(s: Suspect, rb: RankBudget, saving: float) -> Suspect:
    """Step 4: a rank the rules named too keeps their evidence; its what-if becomes the budget's
    where that saves more (the rules time its compute spans, not what the others wait for it)."""
    evidence = {**s.evidence, "measured_cause": rb.cause, "budget_saving_ms": to_ms(saving)}
    what_if = min(s.what_if_iteration_ns, s.iteration_ns - saving)
    return dataclasses.replace(s, evidence=evidence, what_if_iteration_ns=what_if)


def _merge(found: tuple[Suspect, ...], added: list[Suspect]) -> tuple[Suspect, ...]:
    """The rules' suspects in their order, each added one before the first that saves less."""
    out = list(found)
    for s in sorted(added, key=lambda s: -s.saving_ns):
        at = next((i for i, f in enumerate(out) if f.saving_ns < s.saving_ns and f not in added), len(out))
        out.insert(at, s)
    return tuple(out)
