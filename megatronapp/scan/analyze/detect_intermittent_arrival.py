"""Intermittent slowdowns seen in own work before arrivals, where compute spans do not show them.

A rank whose CPU is taken away for a few hundred milliseconds at a time (a cgroup quota or a
competing process switched on and off) is frozen wherever it happens to be: often between its
compute spans (optimizer, data, Python glue) or inside a collective it already entered, so its
forward/backward spans, and the span-level test of detect_intermittent.py, barely move. What does
move is its own work between two synchronisations of a group (detect_arrival.py, step 1: the
window since the group last met, minus every wait on somebody else): in the iterations the fault
is on, the rank needs longer to reach the next collective, and its peers do not. Algorithm (pure,
over detect_arrival.ArrivalSample lists):

  1. Streams. Per rank, family of groups and iteration: its own work summed over the family's
     instances of the iteration, as one pseudo compute span keyed (iteration, -1, 0,
     "own_work:<family>"). Families whose members do identical work (DP, TP) are used where the
     rank has any, as in detect_arrival.compare_arrivals; else every family it has (its steady
     bias is removed by the per-stream centring of detect_intermittent, step 2).
  2. Peers: the other members of the rank's groups of those families.
  3. detect_intermittent.compare_intermittent over these streams: the same noise model, subset
     search and effect sizes as for compute spans. Its p-value is doubled (Bonferroni over the
     two sources of evidence, spans and own work), so the bound on a clean run naming anybody
     stays `intermittent_alpha`.
  4. Saving: in each slow iteration, the rank's own work beyond its peers' (summed over the
     iteration's instances); what fixing it would save there (detect.py's what-if).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from megatronapp.scan.analyze.detect_arrival import ALIKE_FAMILIES, ArrivalSample
from megatronapp.scan.analyze.detect_intermittent import compare_intermittent
from megatronapp.scan.analyze.detect_rules import ComputeSpan, IntermittentStats

SOURCES = 2  # spans and own work: the p-value's Bonferroni factor for this second source


def _families(samples: list[ArrivalSample]) -> dict[int, set[str]]:
    """rank -> the families its own-work streams come from (step 1)."""
    have: dict[int, set[str]] = defaultdict(set)
    for s in samples:
        have[s.rank].add(s.family)
    return {r: (fams & set(ALIKE_FAMILIES)) or fams for r, fams in have.items()}


def build_own_work_streams(
    samples: list[ArrivalSample],
) -> tuple[dict[int, list[ComputeSpan]], dict[int, tuple[int, ...]]]:
    """(rank -> pseudo spans of own work per family and iteration, rank -> peers): steps 1-2."""
    families = _families(samples)
    own: dict[tuple[int, str, int], int] = defaultdict(int)
    members: dict[str, set[int]] = defaultdict(set)
    for s in samples:
        if s.family in families[s.rank]:
            own[(s.rank, s.family, s.iteration)] += s.own_ns
            members[s.group].add(s.rank)
    spans: dict[int, list[ComputeSpan]] = defaultdict(list)
    for (rank, family, it), ns in sorted(own.items()):
        spans[rank].append(ComputeSpan((it, -1, 0, f"own_work:{family}"), 0, ns, ns))
    peers: dict[int, set[int]] = defaultdict(set)
    for group_members in members.values():
        for r in group_members:
            peers[r] |= group_members - {r}
    return dict(spans), {r: tuple(sorted(p)) for r, p in peers.items()}


def compare_own_work_intermittent(
    samples: list[ArrivalSample], min_iterations: int = 2, max_share: float = 0.5
) -> dict[int, IntermittentStats]:
    """Per rank: its most significant subset of iterations with inflated own work (step 3)."""
    spans, peers = build_own_work_streams(samples)
    stats = compare_intermittent(spans, peers, min_iterations, max_share)
    return {r: replace(st, p_value=min(1.0, SOURCES * st.p_value)) for r, st in stats.items()}


def compute_slow_iteration_excess(samples: list[ArrivalSample], rank: int, slow: tuple[int, ...]) -> dict[int, float]:
    """iteration -> the rank's own work beyond its peers' in that slow iteration, ns (step 4)."""
    families = _families(samples).get(rank, set())
    excess: dict[int, float] = defaultdict(float)
    for s in samples:
        if s.rank == rank and s.iteration in slow and s.family in families:
            excess[s.iteration] += s.own_ns - s.peer_own_ns
    return {it: max(0.0, excess.get(it, 0.0)) for it in slow}
