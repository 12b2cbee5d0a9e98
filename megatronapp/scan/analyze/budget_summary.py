"""What the time budget (budget.py) says per rank and per directed link.

Per rank:
  1. The median of each part over the analysed iterations: one iteration that took a pause (a
     rank's last traced step running into its shutdown) does not move it. Each part has its own
     median, so they need not add up to the median wall time; each iteration's parts do.
  2. Against its peers doing identical work (detect_rules.build_compute_peers: DP replicas, else TP
     peers, else the other pipeline stages), paired by iteration: its part minus the median of the
     peers' same part in that iteration, then the median over iterations, so that an iteration slow
     on every rank (a busy machine) cancels.
  3. Slow: the time the rank took itself (own + descheduled + rest: all but blocked communication)
     is at least `slow_ratio` x its peers' in the median iteration, and the excess at least
     `slow_min_share` of the peers' iteration.
  4. Cause: the part with the largest excess, "own work", "descheduled" or "outside the spans"
     (rest: untraced work, Python); where the second largest is at least `ambiguous_share` of it,
     both are named, since the budget cannot tell which one the time belongs to.

Per directed p2p link:
  1. Its timed messages (detect_links.select_timed_messages: those whose transfer is the link's own).
  2. Clean ones only: in the message's iteration neither end was descheduled, i.e. its descheduled
     share of the iteration is at most `descheduled_margin` above that iteration's median share
     over all ranks. A descheduled receiver wakes late from every receive, and its links then look
     slow although they are not.
  3. Per-byte time = transfer / bytes; the link's median against the median of the medians of
     comparable links (median message size within a factor of 2, and the same pipeline direction
     where such links exist), over their clean messages too. A link at least `slow_link_ratio` x
     theirs is slow; one without a clean message is not compared at all (its time is not its own).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.analyze.budget import Budget, IterationBudget, compute_budget

PARTS = ("wall", "own", "descheduled", "throttled", "waiting", "transfer", "rest")
SERIES_PARTS = ("wall", "descheduled", "waiting")
CAUSES = {"own": "own work", "descheduled": "descheduled", "rest": "outside the spans"}


@dataclass(frozen=True)
class BudgetConfig:
    """How far from its peers a rank's or a link's budget must be to be called slow."""

    slow_ratio: float = 1.2  # the rank's own time over its peers' (the detector's compute ratio)
    slow_min_share: float = 0.05  # the excess, as a share of the peers' iteration
    ambiguous_share: float = 0.75  # a second cause this close to the first is named too (they explain it equally)
    descheduled_margin: float = 0.1  # descheduled share of the iteration above the iteration's median
    slow_link_ratio: float = 2.0  # a link's time per byte over comparable links'

    def __post_init__(self) -> None:
        for name in ("slow_ratio", "slow_link_ratio"):
            if getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be above 1, got {getattr(self, name)}")
        for name in ("slow_min_share", "ambiguous_share", "descheduled_margin"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class RankBudget:
    rank: int
    coords: dict
    iterations: int
    measured: bool  # every row had CPU time and the run-queue delay
    median_ns: dict[str, float]  # part (PARTS) -> median over iterations (each part's own: they need not add up)
    peers: tuple[int, ...]
    self_ratio: float | None  # own + descheduled + rest over the peers' (None without peers)
    excess_ns: dict[str, float]  # part -> median over iterations of (mine - the peers' median)
    slow: bool
    cause: str | None  # CAUSES values, " and "-joined when ambiguous; None when not slow
    # part (SERIES_PARTS) -> iteration -> ns: what per-iteration judgments read (measured_intermittent.py)
    per_iteration_ns: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkBudget:
    src: int
    dst: int
    messages: int  # timed messages
    clean_messages: int  # of those, neither end descheduled at the time
    median_bytes: float
    transfer_ns: float  # median over the clean messages (all timed ones if none is clean)
    ns_per_byte: float
    peer_ns_per_byte: float | None  # median of the comparable links' (None: no comparable link or no clean message)
    ratio: float | None
    comparable_links: int
    slow: bool  # ratio >= BudgetConfig.slow_link_ratio


@dataclass(frozen=True)
class BudgetSummary:
    iterations: tuple[int, ...]
    basis: str  # which peers ranks are compared with (detect_rules.build_compute_peers)
    ranks: tuple[RankBudget, ...]
    links: tuple[LinkBudget, ...]


def _part(row: IterationBudget, part: str) -> float:
    return row.self_ns if part == "self" else getattr(row, f"{part}_ns")


def _paired_excess(mine: dict, theirs: list[dict], part: str) -> tuple[float, float]:
    """(median excess of my part over the peers' median, median of the peers' part), by iteration."""
    excess, ref = [], []
    for it, row in mine.items():
        others = [_part(p[it], part) for p in theirs if it in p]
        if others:
            excess.append(_part(row, part) - float(np.median(others)))
            ref.append(float(np.median(others)))
    return (float(np.median(excess)), float(np.median(ref))) if excess else (0.0, 0.0)


def _cause(excess: dict[str, float], config: BudgetConfig) -> str:
    ranked = sorted(((excess[p], p) for p in CAUSES), reverse=True)
    named = [ranked[0][1]] + [p for x, p in ranked[1:] if x > 0 and x >= config.ambiguous_share * ranked[0][0]]
    return " and ".join(CAUSES[p] for p in named)


def summarize_rank(rank: int, rows: dict, peer_rows: list[dict], coords: dict, peers: tuple, config: BudgetConfig):
    """One rank's RankBudget from its rows (iteration -> row) and its peers' (module docstring)."""
    median = {p: float(np.median([_part(r, p) for r in rows.values()])) for p in PARTS}
    excess = {p: _paired_excess(rows, peer_rows, p)[0] for p in CAUSES}
    self_excess, peer_self = _paired_excess(rows, peer_rows, "self")
    _, peer_wall = _paired_excess(rows, peer_rows, "wall")
    ratio = (peer_self + self_excess) / peer_self if peer_rows and peer_self > 0 else None
    slow = ratio is not None and ratio >= config.slow_ratio and self_excess >= config.slow_min_share * peer_wall
    measured = all(r.measured for r in rows.values())
    cause = _cause(excess, config) if slow else None
    series = {p: {it: _part(r, p) for it, r in rows.items()} for p in SERIES_PARTS}
    return RankBudget(rank, coords, len(rows), measured, median, peers, ratio, excess, slow, cause, series)


def _clean_messages(budget: Budget, config: BudgetConfig) -> dict[tuple, list[p2p.P2PMessage]]:
    """Per link, its timed messages whose ends were not descheduled at the time (module docstring)."""
    share = {(r.rank, r.iteration): r.descheduled_ns / max(r.wall_ns, 1.0) for r in budget.rows}
    by_iteration = defaultdict(list)
    for (_, it), s in share.items():
        by_iteration[it].append(s)
    typical = {it: float(np.median(s)) for it, s in by_iteration.items()}

    def busy(rank: int, it: int) -> bool:
        return share.get((rank, it), 0.0) > typical.get(it, 0.0) + config.descheduled_margin

    return {
        link: [m for m in ms if not busy(m.src, m.iteration) and not busy(m.dst, m.iteration)]
        for link, ms in p2p.select_timed_messages(list(budget.messages)).items()
    }


def summarize_links(budget: Budget, config: BudgetConfig) -> tuple[LinkBudget, ...]:
    """Per directed link, its per-byte time against comparable links (module docstring)."""
    timed = p2p.select_timed_messages(list(budget.messages))
    clean = _clean_messages(budget, config)
    used = {link: clean[link] or ms for link, ms in timed.items()}
    per_byte = {
        link: float(np.median([m.transfer_ns / max(m.bytes, 1) for m in ms])) for link, ms in used.items() if ms
    }
    size = {link: float(np.median([m.bytes for m in ms])) for link, ms in used.items() if ms}
    pp = {r: c.get("pp", 0) for r, c in budget.coords.items()}

    def downstream(link: tuple) -> bool:
        return pp.get(link[1], 0) > pp.get(link[0], 0)

    out = []
    for link in sorted(per_byte):
        sized = [o for o in per_byte if o != link and clean[o] and 0.5 <= size[o] / max(size[link], 1.0) <= 2.0]
        # Same pipeline direction where there is one: activations and gradients jitter differently.
        comparable = [o for o in sized if downstream(o) == downstream(link)] or sized
        # A link none of whose messages is clean has no time of its own to compare (step 2).
        peer = float(np.median([per_byte[o] for o in comparable])) if comparable and clean[link] else None
        out.append(
            LinkBudget(
                *link,
                len(timed[link]),
                len(clean[link]),
                size[link],
                float(np.median([m.transfer_ns for m in used[link]])),
                per_byte[link],
                peer,
                per_byte[link] / peer if peer else None,
                len(comparable),
                peer is not None and per_byte[link] >= config.slow_link_ratio * peer,
            )
        )
    return tuple(out)


def summarize_budget(budget: Budget, config: BudgetConfig = BudgetConfig()) -> BudgetSummary:
    """Every rank's and link's summary (module docstring)."""
    by_rank: dict[int, dict[int, IterationBudget]] = defaultdict(dict)
    for row in budget.rows:
        by_rank[row.rank][row.iteration] = row
    basis, peers = rules.build_compute_peers(budget.coords, budget.layout) if budget.layout else ("none", {})
    ranks = tuple(
        summarize_rank(
            r,
            rows,
            [by_rank[p] for p in peers.get(r, ()) if p in by_rank],
            budget.coords.get(r, {}),
            tuple(peers.get(r, ())),
            config,
        )
        for r, rows in sorted(by_rank.items())
    )
    iterations = tuple(sorted({row.iteration for row in budget.rows}))
    return BudgetSummary(iterations, basis, ranks, summarize_links(budget, config))


def compute_budget_summary(traces: list, iterations: tuple[int, ...], config: BudgetConfig = BudgetConfig()):
    """The summary of the budget of aligned, keyed traces (TraceAnalysis.traces) in `iterations`."""
    return summarize_budget(compute_budget(traces, iterations), config)
