"""Iterations of different ranks joined by the communication they share, not by their numbers.

Each rank numbers its own iterations, and a rank that ran local optimizer steps before its first
collective, started late or restarted counts differently from its peers: joined on the number,
the detector would compare rank A's step k with rank B's step k+3 and see nothing. What ranks
do share is their communication: the k-th collective on a process group is the same operation
on every member, and the k-th message on a directed pair is one send and one receive.

Algorithm:
  1. Per rank, the iteration of each keyed comm span: collectives by (group, seq), messages by
     (src, dst, seq) on both ends (matching.comm_rows).
  2. Per pair of ranks sharing keys, the most common difference of their iteration numbers over
     the shared keys (one constant offset per pair; a rare async op that finishes in a later
     iteration does not move the mode).
  3. Ranks connected by shared keys form components; in each, every rank's offset follows from
     the pair offsets along a breadth-first tree from its lowest rank, and the offset most ranks
     have becomes 0, so the majority keep their numbers.
  4. Ranks outside the largest component share nothing with it: they keep their own numbers
     and the alignment says so, so that a report over them never reads "nothing found" as if
     they had been compared.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from megatronapp.scan.merge.matching import comm_rows
from megatronapp.scan.record.format import RankTrace
from megatronapp.spans import P2P_OPS, RECV, SEND


@dataclass(frozen=True)
class IterationAlignment:
    """What to subtract from each rank's iteration numbers, and the ranks that could not be joined."""

    shifts: dict[int, int]
    unjoined: tuple[int, ...] = ()  # ranks sharing no collective or message with the largest group
    notes: tuple[str, ...] = ()


def _keyed_iterations(trace: RankTrace) -> dict[tuple, np.ndarray]:
    """Stream key -> (seq array, iteration array) of one rank: ("coll", group), ("p2p", src, dst)."""
    cols = comm_rows(trace.events)
    rank, out = trace.rank, {}
    is_send, is_recv = cols["op"] == SEND, cols["op"] == RECV
    is_coll = ~np.isin(cols["op"], list(P2P_OPS)) & (cols["group"] != "") & (cols["op"] != "")
    streams = [(("coll", g), is_coll & (cols["group"] == g)) for g in set(cols["group"][is_coll].tolist())]
    streams += [(("p2p", rank, p), is_send & (cols["peer"] == p)) for p in set(cols["peer"][is_send].tolist())]
    streams += [(("p2p", p, rank), is_recv & (cols["peer"] == p)) for p in set(cols["peer"][is_recv].tolist())]
    for key, mask in streams:
        if mask.any():
            out[key] = (cols["seq"][mask], cols["iteration"][mask])
    return out


def _pair_offset(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> Counter:
    """Counts of (iteration on a - iteration on b) over the seqs both streams hold."""
    _, ia, ib = np.intersect1d(a[0], b[0], assume_unique=False, return_indices=True)
    return Counter((a[1][ia] - b[1][ib]).tolist())


def compute_pair_offsets(streams: dict[int, dict[tuple, tuple]]) -> dict[tuple[int, int], int]:
    """(r, s) -> most common iteration(r) - iteration(s) over their shared comm keys, r < s."""
    holders = defaultdict(list)
    for rank, keyed in streams.items():
        for key in keyed:
            holders[key].append(rank)
    counts: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for key, ranks in holders.items():
        ranks = sorted(ranks)
        for r, s in zip(ranks, ranks[1:]):  # a chain through the members joins them all
            counts[r, s] += _pair_offset(streams[r][key], streams[s][key])
    return {pair: c.most_common(1)[0][0] for pair, c in counts.items() if c}


def compute_iteration_alignment(ranks: list[int], offsets: dict[tuple[int, int], int]) -> IterationAlignment:
    """Per-rank shifts from pair offsets (steps 3 and 4 of the module docstring)."""
    edges = defaultdict(list)
    for (r, s), d in offsets.items():
        edges[r].append((s, d))  # iteration(s) = iteration(r) - d
        edges[s].append((r, -d))
    shifts, components = {}, []
    for root in sorted(ranks):
        if root in shifts:
            continue
        shifts[root], members, queue = 0, [root], deque([root])
        while queue:
            r = queue.popleft()
            for s, d in edges[r]:
                if s not in shifts:
                    shifts[s] = shifts[r] - d
                    members.append(s)
                    queue.append(s)
        usual = Counter(shifts[m] for m in members).most_common(1)[0][0]
        for m in members:
            shifts[m] -= usual
        components.append(sorted(members))
    main = max(components, key=len) if components else []
    unjoined = tuple(sorted(r for c in components if c is not main for r in c)) if len(main) > 1 else tuple(ranks)
    if len(ranks) < 2:
        unjoined = ()
    return IterationAlignment(shifts, unjoined, _notes(shifts, main, unjoined))


def _notes(shifts: dict[int, int], main: list[int], unjoined: tuple[int, ...]) -> tuple[str, ...]:
    notes = []
    moved = {r: s for r, s in sorted(shifts.items()) if s}
    if moved:
        said = ", ".join(f"rank {r} counted {abs(s)} {'ahead' if s > 0 else 'behind'}" for r, s in moved.items())
        notes.append(f"iteration numbers differ between ranks ({said}): iterations joined by their shared collectives")
    if unjoined and len(main) > 1:
        notes.append(
            f"ranks {list(unjoined)} share no collective or message with ranks {main}: their iterations could not "
            "be aligned, so they were compared by their own iteration numbers, which may not be the same steps"
        )
    elif unjoined:
        notes.append(
            "the ranks share no collective or message: their iterations could not be aligned, so ranks were "
            "compared by their own iteration numbers, which may not be the same steps"
        )
    return tuple(notes)


def apply_iteration_shifts(traces: list[RankTrace], shifts: dict[int, int]) -> list[RankTrace]:
    """Traces with `shifts[rank]` subtracted from every iteration number (calibration rows, -1, kept)."""
    out = []
    for trace in traces:
        shift = shifts.get(trace.rank, 0)
        if not shift:
            out.append(trace)
            continue
        its = trace.events.column("iteration").to_numpy()
        rekeyed = np.where(its >= 0, its - shift, its).astype(np.int32)
        index = trace.events.schema.get_field_index("iteration")
        events = trace.events.set_column(index, "iteration", pa.array(rekeyed, pa.int32()))
        out.append(dataclasses.replace(trace, events=events))
    return out


def align_iterations(traces: list[RankTrace]) -> tuple[list[RankTrace], IterationAlignment]:
    """Re-key every rank's iterations so that shared collectives and messages carry one number."""
    streams = {t.rank: _keyed_iterations(t) for t in traces}
    alignment = compute_iteration_alignment(sorted(streams), compute_pair_offsets(streams))
    return apply_iteration_shifts(traces, alignment.shifts), alignment
