"""What-if estimates for MegaScan suspects, from each iteration's critical path.

Algorithm (a backward walk in the style of HTA's critical-path analysis):

  1. The walk starts on the rank whose "iteration" span ends last, at that end, and stops
     at the earliest iteration start over all ranks; T = end - start is the iteration time.
  2. On the current rank it steps back to the latest *blocking* event ending before the
     current time: a matched recv or a complete collective instance (sends never block the
     sender here, so they are skipped). Time between blocking events is local to the rank
     (compute, launches, small comm) and is recorded as a path segment.
  3. If that event waited on another rank, the path jumps there: for a recv that waited on
     its sender (send posted after the receiver started waiting) to the sender at its send
     start; for a collective where someone else arrived last, to the last arrival at its
     start. Otherwise the event is local and the walk continues on the same rank.
  4. Every recv the path crosses charges its effective transfer to its link.

A suspect's saving is then the part of the path it is responsible for: for a slow rank with
compute ratio F, the pure compute on the path times (1 - 1/F); for a slow link, the transfer
on the path above the peer links' median. What-if iteration time = max(T - saving, busiest
other rank), where a rank's busy time is its iteration minus its waits on others and on
incoming transfers: once the suspect is fixed another path may become critical (in DP, the
next-slowest replica), and no rank can finish before its own work is done.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from megatronapp.scan.analyze.detect_links import P2PMessage
from megatronapp.scan.analyze.detect_rules import CollectiveInstance, ComputeSpan


@dataclass(frozen=True)
class _Leaf:
    start: int
    end: int
    jump: tuple[int, int] | None  # (rank, time) this event waited on, or None
    link: tuple[int, int, int] | None  # (src, dst, transfer_ns) for recvs


@dataclass(frozen=True)
class CriticalPath:
    iteration: int
    begin_ns: int
    end_ns: int
    segments: tuple[tuple[int, int, int], ...]  # (rank, lo, hi): rank-local time on the path
    link_transfers: tuple[tuple[int, int, int], ...]  # (src, dst, transfer_ns) crossed by the path

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.begin_ns


def build_blocking_events(
    iteration: int, messages: list[P2PMessage], instances: list[CollectiveInstance]
) -> dict[int, list[_Leaf]]:
    """Per rank, the blocking events of `iteration` sorted by end (step 2 of the algorithm)."""
    leaves: dict[int, list[_Leaf]] = defaultdict(list)
    for m in messages:
        if m.iteration == iteration:
            jump = (m.src, m.send_start) if m.waited_on_sender else None
            leaves[m.dst].append(_Leaf(m.recv_start, m.recv_end, jump, (m.src, m.dst, m.transfer_ns)))
    for inst in instances:
        if inst.iteration != iteration:
            continue
        for r, (start, end) in inst.spans.items():
            waited = inst.last_rank != r and inst.last_start > start
            leaves[r].append(_Leaf(start, end, (inst.last_rank, inst.last_start) if waited else None, None))
    for lst in leaves.values():
        lst.sort(key=lambda leaf: (leaf.end, leaf.start))
    return dict(leaves)


def compute_critical_path(
    iteration: int, iteration_spans: dict[int, tuple[int, int]], leaves: dict[int, list[_Leaf]]
) -> CriticalPath:
    """Walk back from the last iteration end to the first iteration start (module docstring)."""
    begin = min(s for s, _ in iteration_spans.values())
    rank = max(iteration_spans, key=lambda r: (iteration_spans[r][1], -r))
    end = t = iteration_spans[rank][1]
    seg_hi, cap = t, None
    segments, links = [], []
    ends = {r: [leaf.end for leaf in lst] for r, lst in leaves.items()}
    for _ in range(4 * sum(len(v) for v in leaves.values()) + 8):  # each step moves back; bound it anyway
        idx = bisect_right(ends.get(rank, []), t) - 1
        if cap is not None:
            idx = min(idx, cap)
        if idx < 0 or leaves[rank][idx].end <= begin:
            break
        leaf = leaves[rank][idx]
        if leaf.link is not None:
            links.append(leaf.link)
        if leaf.jump is None:
            t, cap = min(t, leaf.start), idx - 1
            continue
        segments.append((rank, leaf.end, seg_hi))
        rank, t = leaf.jump
        seg_hi, cap = t, None
    lo = max(begin, iteration_spans.get(rank, (begin, 0))[0])
    if seg_hi > lo:
        segments.append((rank, lo, seg_hi))
    return CriticalPath(iteration, begin, end, tuple(s for s in segments if s[2] > s[1]), tuple(links))


def compute_busy_ns(
    iteration: int,
    iteration_spans: dict[int, tuple[int, int]],
    messages: list[P2PMessage],
    instances: list[CollectiveInstance],
) -> dict[int, int]:
    """Per rank: its iteration span minus the time it waited on other ranks and on incoming
    transfers. No schedule can finish the iteration faster than the busiest rank, so the
    what-if estimate is never allowed below that of the ranks it does not speed up."""
    busy = {r: e - s for r, (s, e) in iteration_spans.items()}
    for m in messages:
        if m.iteration == iteration and m.dst in busy:
            busy[m.dst] -= m.recv_end - m.wait_start
    for inst in instances:
        if inst.iteration == iteration:
            for r, (start, _) in inst.spans.items():
                if r in busy:
                    busy[r] -= inst.last_start - start
    return busy


def estimate_compute_saving(path: CriticalPath, rank: int, spans: list[ComputeSpan], ratio: float) -> float:
    """Nanoseconds the path would lose if `rank`'s compute ran `ratio` times faster."""
    if ratio <= 1.0:
        return 0.0
    on_path = 0.0
    mine = [s for s in spans if s.key[0] == path.iteration]
    for r, lo, hi in path.segments:
        if r != rank:
            continue
        for s in mine:
            overlap = min(hi, s.end) - max(lo, s.start)
            if overlap > 0 and s.end > s.start:
                on_path += overlap * s.pure_ns / (s.end - s.start)  # nested comm is not compute
    return on_path * (1.0 - 1.0 / ratio)


def estimate_link_saving(path: CriticalPath, link: tuple[int, int], peer_median_ns: float) -> float:
    """Nanoseconds the path would lose if `link` transferred like its peers (median)."""
    return sum(max(0.0, t - peer_median_ns) for s, d, t in path.link_transfers if (s, d) == link)
