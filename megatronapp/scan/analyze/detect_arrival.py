"""Arrival order at collectives: who keeps everybody waiting, and is it its own fault?

A straggler need not show in its compute spans: extra work in a data step lies outside every
span, and a rank throttled by a CPU quota runs at full speed between freezes, so the median of
its spans barely moves. What does not hide is when it arrives at the collectives that its peers
are already waiting in. Algorithm (pure, over CollectiveInstance and P2PMessage lists):

  1. Own work before each arrival. For a rank r at instance I of group G: the window starts at
     the latest end of r's earlier instances of G that ended before r arrived at I (the last
     time the group synchronised; members leave a collective together, so windows of all
     members start at about the same moment) and ends at r's arrival. From its length subtract
     the time r spent outside its own work: in collectives of other groups (its start to the
     last member's start, then that group's usual transfer), in receives (the receiver's wait
     start until the send returned, plus the link's usual transfer) and in sends (until the
     receiver posted its receive and had the message, plus the link's usual transfer); a stretch
     beyond "usual" is r itself stopped. What is left is r's own work: a rank that is late
     because it waited on somebody else is not late by its own work (a pipeline neighbour of a
     slow stage).
  2. Per sample: own ratio = r's own work / the median of the other members' own work at I,
     lateness = r's start - the median of the other members' starts, whether r was last, and
     its extra wait: r's waits in the window minus the median of the others' waits in theirs.
  3. Per (rank, family of groups): the share of all the waiting at its instances that r caused
     by arriving last (a rank no slower than the others causes 1 / members of it), and per
     iteration its own work summed over the iteration's instances against the peers' (only the
     first collective after a data step sees that step, and FSDP2 meets ~10 times an
     iteration): the median of that ratio, the share of iterations where it reaches `min_ratio`
     (consistency), a robust z of the log ratios; and, at each iteration's latest arrival, the
     median lateness and the median extra wait.
     `is_arrival_straggler` asks all of them to point the same way (thresholds in
     detect_config.DetectConfig), and the lateness not to be explained by waiting: a median extra wait
     of half the median lateness or more means r was late mostly because it waited on somebody
     (a receiver of a slow link, which then computes cold for a while, shows own work a little
     above its peers' and would otherwise be named).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megatronapp.scan.analyze.detect_links import P2PMessage, group_by_link
from megatronapp.scan.analyze.detect_rules import CollectiveInstance, robust_z, union_length

ALIKE_FAMILIES = ("dp", "tp")  # group families whose members do identical work


@dataclass(frozen=True)
class ArrivalSample:
    """One rank at one collective instance (module docstring, steps 1-2)."""

    rank: int
    family: str
    group: str
    seq: int
    iteration: int
    own_ns: int  # own work between the group's previous synchronisation and this arrival
    peer_own_ns: float  # median of the other members' own work at the same instance
    lateness_ns: float  # my start - median of the other members' starts
    last: bool
    extra_wait_ns: float  # my waits in the window - median of the other members' waits in theirs


@dataclass(frozen=True)
class ArrivalStats:
    """One rank's arrivals at the collectives of one family (module docstring, step 3)."""

    rank: int
    family: str
    samples: int
    iterations: int
    last_share: float  # of its instances, those it arrived last at
    wait_share: float  # of the waiting its groups' members did at its instances, the share it caused
    expected_share: float  # 1 / members, averaged: what a rank no slower than the others gets
    ratio: float  # median over iterations of own work / the peers' (each summed over the iteration's instances)
    consistency: float
    z: float
    median_lateness_ns: float
    median_extra_wait_ns: float
    excess_ns_per_iteration: float  # own work beyond the peers' before its latest arrival of an iteration (median)
    # (median_lateness_ns and median_extra_wait_ns are medians over iterations of that latest arrival too)
    worst: tuple[tuple[str, int, int, float], ...]  # (group, seq, iteration, lateness_ns): latest arrivals


def _wait_intervals(instances: list[CollectiveInstance], messages: list[P2PMessage]) -> dict[tuple, np.ndarray]:
    """(rank, group) -> sorted (start, end) rows of the rank's time outside its own work, outside
    `group`: in collectives of other groups (waiting for the last member, then the transfer for as
    long as that group's transfers usually take: a first and last stage's embedding all-reduce
    crosses the pipeline's links, its DP peers' does not; longer than usual, the member itself
    stopped), and in receives and sends. Time in the same group is an earlier, still open instance
    (DDP's overlapped buckets), not a reason to be late to this one."""
    per_rank: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    transfers: dict[str, list[int]] = defaultdict(list)
    for inst in instances:
        transfers[inst.group] += [end - inst.last_start for _, end in inst.spans.values()]
    usual = {g: int(np.median(v)) for g, v in transfers.items()}
    for inst in instances:
        for r, (start, end) in inst.spans.items():
            per_rank[r].append((start, min(end, max(start, inst.last_start + usual[inst.group])), inst.group))
    typical = {link: float(np.median([m.transfer_ns for m in ms])) for link, ms in group_by_link(messages).items()}
    # Not widened where the link rule names the link: a receiver slowed by a competing process wakes
    # late from every receive, so its incoming link reads slow, and excusing the link's messages would
    # hide the receiver (faultlab test: PP2 x DP2, rank 1 beside seven busy loops)
    for m in messages:
        # waiting on the sender until its send returned, then on the link for as long as its messages
        # usually take: a receive that completes later than that stretched because the receiver itself
        # stopped (a throttled process is frozen wherever it is, inside a receive too), which is no one
        # else's doing. A sender frozen in the middle of its send returns late, so its receiver waited on it
        end = min(m.recv_end, max(m.send_start, m.wait_start, m.send_end) + int(typical[(m.src, m.dst)]))
        if end > m.wait_start:
            per_rank[m.dst].append((m.wait_start, end, ""))
        # a send blocks until its receiver has posted the receive and, once buffers are full (a slow
        # link), until the receiver has drained it: a receiver frozen mid-receive keeps its sender
        # waiting, as a sender frozen mid-send keeps its receiver waiting (above). Either way the stretch
        # is nobody's own work here: a throttled rank shows its freezes in its other work
        end = min(m.send_end, max(m.send_start, m.recv_start, m.recv_end) + int(typical[(m.src, m.dst)]))
        if end > m.send_start:
            per_rank[m.src].append((m.send_start, end, ""))
    groups = {inst.group for inst in instances}
    out = {}
    for r, rows in per_rank.items():
        for g in groups:
            kept = sorted((s, e) for s, e, grp in rows if grp != g)
            out[(r, g)] = np.asarray(kept, dtype=np.int64).reshape(-1, 2)
    return out


def _covered_ns(intervals: np.ndarray, lo: int, hi: int) -> int:
    """Length of the union of `intervals` ((n, 2) starts and ends) clipped to [lo, hi)."""
    if not len(intervals):
        return 0
    inside = intervals[(intervals[:, 1] > lo) & (intervals[:, 0] < hi)]
    return union_length([(max(int(s), lo), min(int(e), hi)) for s, e in inside])


def _own_work(instances: list[CollectiveInstance], waits: dict) -> dict[tuple, tuple[int, int]]:
    """(group, seq, rank) -> (own work, waits) before the arrival (step 1); instances without an
    earlier synchronisation of the group on that rank have none."""
    ends: dict[tuple, list[int]] = defaultdict(list)  # (group, rank) -> ends of its instances
    for inst in instances:
        for r, (_, end) in inst.spans.items():
            ends[(inst.group, r)].append(end)
    for v in ends.values():
        v.sort()
    empty = np.zeros((0, 2), dtype=np.int64)
    own = {}
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            prior = ends[(inst.group, r)]
            k = int(np.searchsorted(prior, start, "left"))
            if k == 0:
                continue
            lo = prior[k - 1]
            waited = _covered_ns(waits.get((r, inst.group), empty), lo, start)
            own[(inst.group, inst.seq, r)] = (max(0, start - lo - waited), waited)
    return own


def compute_arrival_samples(instances: list[CollectiveInstance], messages: list[P2PMessage]) -> list[ArrivalSample]:
    """Steps 1-2 of the module docstring, for every member of every instance that has a window."""
    own = _own_work(instances, _wait_intervals(instances, messages))
    samples = []
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            mine = own.get((inst.group, inst.seq, r))
            others = [own[(inst.group, inst.seq, p)] for p in inst.spans if p != r and (inst.group, inst.seq, p) in own]
            if mine is None or not others:
                continue
            lateness = start - float(np.median([s for p, (s, _) in inst.spans.items() if p != r]))
            extra_wait = mine[1] - float(np.median([w for _, w in others]))
            samples.append(
                ArrivalSample(
                    r,
                    inst.family,
                    inst.group,
                    inst.seq,
                    inst.iteration,
                    mine[0],
                    float(np.median([o for o, _ in others])),
                    lateness,
                    inst.last_rank == r,
                    extra_wait,
                )
            )
    return samples


def _family_stats(
    rank: int, family: str, rows: list[ArrivalSample], members: float, min_ratio: float, wait_share: float
) -> ArrivalStats:
    by_it: dict[int, list[ArrivalSample]] = defaultdict(list)
    for s in rows:
        by_it[s.iteration].append(s)
    # Per iteration: own work summed over its instances (only the first collective after a data step
    # sees that step: FSDP2 meets ~10 times an iteration), and its latest arrival.
    logs = np.log(
        np.array([max(1, sum(s.own_ns for s in v)) / max(1.0, sum(s.peer_own_ns for s in v)) for v in by_it.values()])
    )
    latest = [max(v, key=lambda s: s.lateness_ns) for v in by_it.values()]
    worst = sorted(rows, key=lambda s: -s.lateness_ns)[:5]
    return ArrivalStats(
        rank,
        family,
        len(rows),
        len(by_it),
        sum(s.last for s in rows) / len(rows),
        wait_share,
        1.0 / members,
        float(np.exp(np.median(logs))),
        float(np.mean(np.exp(logs) >= min_ratio)),
        robust_z(logs),
        float(np.median([s.lateness_ns for s in latest])),
        float(np.median([s.extra_wait_ns for s in latest])),
        float(np.median([max(0.0, s.own_ns - s.peer_own_ns) for s in latest])),
        tuple((s.group, s.seq, s.iteration, s.lateness_ns) for s in worst),
    )


def compare_arrivals(
    samples: list[ArrivalSample], instances: list[CollectiveInstance], min_ratio: float
) -> dict[int, ArrivalStats]:
    """Per rank, step 3 for the family of groups where its own-work ratio is highest (with the
    most samples on a tie): a rank slowed everywhere shows it in every family. Groups whose
    members do identical work (DP, TP) are used where the rank has any: a group spanning
    pipeline stages compares a first stage's embedding work with a last stage's loss."""
    members = {inst.group: len(inst.spans) for inst in instances}
    caused, waited = defaultdict(float), defaultdict(float)  # (rank, family) -> ns
    for inst in instances:
        total = sum(inst.last_start - start for start, _ in inst.spans.values())
        caused[(inst.last_rank, inst.family)] += total
        for r in inst.spans:
            waited[(r, inst.family)] += total
    rows: dict[tuple[int, str], list[ArrivalSample]] = defaultdict(list)
    for s in samples:
        rows[(s.rank, s.family)].append(s)
    alike = {rank for rank, family in rows if family in ALIKE_FAMILIES}
    best: dict[int, ArrivalStats] = {}
    for (rank, family), rs in sorted(rows.items()):
        if rank in alike and family not in ALIKE_FAMILIES:
            continue
        share = caused[(rank, family)] / waited[(rank, family)] if waited[(rank, family)] > 0 else 0.0
        st = _family_stats(rank, family, rs, float(np.mean([members[s.group] for s in rs])), min_ratio, share)
        if rank not in best or (st.ratio, st.samples) > (best[rank].ratio, best[rank].samples):
            best[rank] = st
    return best


def min_wait_share(fair: float, min_excess_share: float) -> float:
    """The share of its collectives' waiting a straggler must cause: `min_excess_share` of the way from a
    fair share to all of it, and at least 1.5x a fair share."""
    return max(fair + min_excess_share * (1.0 - fair), 1.5 * fair)


def is_arrival_straggler(
    st: ArrivalStats,
    *,
    min_samples: int,
    min_excess_share: float,
    min_ratio: float,
    min_consistency: float,
    min_z: float,
    min_lateness_ns: int,
) -> bool:
    """The cause of most of the waiting at its collectives, late by a margin, *and* by its own work
    (not by waiting)."""
    # evidence is per iteration, and a short run's first iterations run cold (a 6-iteration clean
    # job read 2.3x on 4 iterations): twice min_samples iterations are wanted
    return (
        st.iterations >= 2 * min_samples
        and st.wait_share >= min_wait_share(st.expected_share, min_excess_share)
        and st.median_lateness_ns >= min_lateness_ns
        and st.ratio >= min_ratio
        and st.consistency >= min_consistency
        and st.z >= min_z
        and st.median_extra_wait_ns < 0.5 * st.median_lateness_ns
    )


def describe_arrivals(st: ArrivalStats) -> tuple[str, dict]:
    """(one-line summary, evidence fields) of an arrival-order verdict."""
    summary = (
        f"rank {st.rank} arrived last at {st.last_share:.0%} of its {st.samples} {st.family.upper()} "
        f"collectives and caused {st.wait_share:.0%} of its peers' waiting there (a fair share is "
        f"{st.expected_share:.0%}), {st.median_lateness_ns / 1e6:.1f} ms after "
        f"its peers (median), with {st.ratio:.2f}x their own work since the group last synchronised "
        f"(waits subtracted) in {st.consistency:.0%} of {st.iterations} iterations"
    )
    fields = {
        "arrival_family": st.family,
        "last_arrival_share": {st.family: round(st.last_share, 3)},
        "wait_share": round(st.wait_share, 3),
        "expected_share": round(st.expected_share, 3),
        "arrival_ratio": round(st.ratio, 3),
        "median_lateness_ms": round(st.median_lateness_ns / 1e6, 3),
        "latest_arrivals": [
            {"group": g, "seq": q, "iteration": i, "lateness_ms": round(x / 1e6, 3)} for g, q, i, x in st.worst
        ],
    }
    return summary, fields
