"""Put every rank's events on one timeline, using only what the traces contain.

Algorithm (pure functions over RankTrace lists; no process group involved):

1. Wall-clock mapping. Each rank's calibration pairs (device ns, wall ns) give
   wall = device + offset, plus a linear drift term when the pairs span at least
   `min_drift_span_ns` (least squares on the pairs). This alone aligns ranks whose
   host clocks agree.
2. Collective anchors. Members of a synchronising collective (same group key and
   seq) leave it at nearly the same moment, so their end times should coincide. For
   each pair of ranks that share collectives, the median end difference is a robust
   measurement of their relative offset; a weighted least-squares solve over that
   graph gives one correction per rank, the lowest rank of each connected component
   held at 0.
3. P2P causality. A recv cannot finish before its matching send (same src, dst, seq)
   starts: x_dst - x_src >= send_start - recv_end. Violated constraints are fixed by
   the smallest shift: first moving whole collective components rigidly, then single
   ranks, by alternating projections (each projection splits the violation between
   the two ends).
4. The timeline is re-anchored so that rank 0 (or the lowest rank) keeps its
   wall-clock mapping, and the residuals and remaining violations are reported.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.scan.format import RankTrace

# Collectives whose members all leave together; broadcast is not (the root need not wait).
SYNC_COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
DEFAULT_MIN_DRIFT_SPAN_NS = 30_000_000_000  # shorter calibration spans cannot see ppm drift
_MAX_PROJECTION_ROUNDS = 2000


@dataclass(frozen=True)
class ClockMapping:
    """wall = device + offset_ns + drift * (device - ref_ns)."""

    offset_ns: int = 0
    drift: float = 0.0
    ref_ns: int = 0

    def apply(self, t: np.ndarray) -> np.ndarray:
        out = t + np.int64(self.offset_ns)
        if self.drift:
            out = out + np.rint(self.drift * (t - self.ref_ns).astype(np.float64)).astype(np.int64)
        return out


@dataclass
class AlignmentReport:
    """What alignment did. offset_ns[r] is what was added to rank r's device timestamps
    (at the mapping's reference time); collective-based corrections are in it.
    violations_before counts p2p messages breaking causality with the wall-clock
    mapping alone, violations those left after alignment."""

    offset_ns: dict[int, int] = field(default_factory=dict)
    drift_ppm: dict[int, float] = field(default_factory=dict)
    residual_ns: dict[int, float] = field(default_factory=dict)
    median_residual_ns: float = math.nan
    anchors: int = 0
    p2p_messages: int = 0
    violations_before: int = 0
    violations: int = 0
    method: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN becomes None, rank keys become strings)."""
        def clean(v: float) -> float | None:
            return None if isinstance(v, float) and math.isnan(v) else v

        return {
            "offset_ns": {str(r): v for r, v in self.offset_ns.items()},
            "drift_ppm": {str(r): v for r, v in self.drift_ppm.items()},
            "residual_ns": {str(r): clean(v) for r, v in self.residual_ns.items()},
            "median_residual_ns": clean(self.median_residual_ns),
            "anchors": self.anchors,
            "p2p_messages": self.p2p_messages,
            "violations_before": self.violations_before,
            "violations": self.violations,
            "method": {str(r): v for r, v in self.method.items()},
        }


def _is_category(events: pa.Table, cat: str) -> np.ndarray:
    """Boolean mask of rows whose cat is `cat`."""
    mask = pc.equal(events.column("cat").cast(pa.string()), cat)
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)


def _column(events: pa.Table, name: str) -> list:
    col = events.column(name)
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.string())
    return col.to_pylist()


def _int_median(values: np.ndarray) -> int:
    """Median without float rounding (values may be ~1e18 ns)."""
    ordered = np.sort(values)
    return int(ordered[(len(ordered) - 1) // 2])


def compute_wall_mapping(trace: RankTrace, min_drift_span_ns: int = DEFAULT_MIN_DRIFT_SPAN_NS) -> ClockMapping:
    """Device -> wall-clock mapping from the rank's calibration pairs (identity if none)."""
    events = trace.events
    is_calib = _is_category(events, "calib")
    device = events.column("start_ns").to_numpy()[is_calib]
    wall = events.column("end_ns").to_numpy()[is_calib]
    if len(device) == 0:
        return ClockMapping()
    diff = wall - device
    offset = _int_median(diff)
    ref = int(device.min())
    if len(device) < 2 or int(device.max()) - ref < min_drift_span_ns:
        return ClockMapping(offset_ns=offset, ref_ns=ref)
    # Fit diff - offset = drift * (device - ref) + c in small floats.
    x = (device - ref).astype(np.float64)
    y = (diff - offset).astype(np.float64)
    drift, intercept = np.polyfit(x, y, 1)
    return ClockMapping(offset_ns=offset + int(round(intercept)), drift=float(drift), ref_ns=ref)


@dataclass
class _CommEvents:
    """Comm events of all ranks on the wall-mapped timeline, keyed for matching."""

    collectives: dict = field(default_factory=lambda: defaultdict(list))  # (group, seq) -> [(rank, end)]
    sends: dict = field(default_factory=dict)  # (src, dst, seq) -> start
    recvs: dict = field(default_factory=dict)  # (src, dst, seq) -> end


def collect_comm_events(traces: list[RankTrace], mappings: dict[int, ClockMapping]) -> _CommEvents:
    """Index every rank's collective ends and p2p send starts / recv ends."""
    found = _CommEvents()
    for trace in traces:
        ev = trace.events
        is_comm = _is_category(ev, "comm")
        if not is_comm.any():
            continue
        sub = ev.filter(pa.array(is_comm))
        starts = mappings[trace.rank].apply(sub.column("start_ns").to_numpy()).tolist()
        ends = mappings[trace.rank].apply(sub.column("end_ns").to_numpy()).tolist()
        rows = zip(_column(sub, "op"), _column(sub, "group"), _column(sub, "seq"), _column(sub, "peer"), starts, ends)
        for op, group, seq, peer, start, end in rows:
            if seq < 0:
                continue
            if op in SYNC_COLLECTIVES and group:
                found.collectives[group, seq].append((trace.rank, end))
            elif op == "send" and peer >= 0:
                found.sends[trace.rank, peer, seq] = start
            elif op == "recv" and peer >= 0:
                found.recvs[peer, trace.rank, seq] = end
    return found


def compute_pairwise_end_differences(collectives: dict) -> dict[tuple[int, int], list[int]]:
    """(i, j) -> end_j - end_i for every collective instance both joined (star from
    the instance's lowest rank, so cost is linear in the members)."""
    diffs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for members in collectives.values():
        if len(members) < 2:
            continue
        members = sorted(members)
        ref_rank, ref_end = members[0]
        for rank, end in members[1:]:
            if rank != ref_rank:
                diffs[ref_rank, rank].append(end - ref_end)
    return diffs


def _components(ranks: list[int], edges: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Rank -> lowest rank of its connected component (union-find)."""
    parent = {r: r for r in ranks}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for i, j in edges:
        a, b = find(i), find(j)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return {r: find(r) for r in ranks}


def compute_collective_offsets(ranks: list[int], diffs: dict[tuple[int, int], list[int]]) -> tuple[dict[int, float], dict[int, int]]:
    """Corrections x (to add to each rank's times) making collective ends coincide.

    Solves min sum_e w_e (x_j - x_i + d_e)^2, d_e the median end difference of edge e
    and w_e its number of instances, with each component's lowest rank fixed at 0.
    Returns (x, component of each rank)."""
    comp = _components(ranks, diffs)
    index = {r: k for k, r in enumerate(ranks)}
    n = len(ranks)
    lap = np.zeros((n, n))
    rhs = np.zeros(n)
    for (i, j), values in diffs.items():
        a, b, w = index[i], index[j], float(len(values))
        d = float(np.median(np.asarray(values, dtype=np.float64)))
        lap[a, a] += w
        lap[b, b] += w
        lap[a, b] -= w
        lap[b, a] -= w
        # gradient of w (x_b - x_a + d)^2: x_b - x_a = -d
        rhs[b] -= w * d
        rhs[a] += w * d
    for root in set(comp.values()):  # pin each component's root at 0
        k = index[root]
        lap[k, :] = 0.0
        lap[k, k] = 1.0
        rhs[k] = 0.0
    x = np.linalg.solve(lap, rhs) if n else np.zeros(0)
    return {r: float(x[index[r]]) for r in ranks}, comp


def _p2p_bounds(comm: _CommEvents) -> dict[tuple[int, int], int]:
    """(src, dst) -> largest send_start - recv_end over matched messages: the lower
    bound on x_dst - x_src."""
    bounds: dict[tuple[int, int], int] = {}
    for key, start in comm.sends.items():
        end = comm.recvs.get(key)
        if end is None:
            continue
        pair = key[:2]
        bounds[pair] = max(bounds.get(pair, start - end), start - end)
    return bounds


def _project(values: dict, bounds: dict[tuple, int], node_of) -> None:
    """Alternating projections in integer ns until every bound holds (or give up)."""
    for _ in range(_MAX_PROJECTION_ROUNDS):
        moved = False
        for (src, dst), lower in bounds.items():
            a, b = node_of(src), node_of(dst)
            if a == b:
                continue
            gap = lower - (values[b] - values[a])
            if gap > 0:
                values[b] += (gap + 1) // 2
                values[a] -= gap // 2
                moved = True
        if not moved:
            return


def enforce_p2p_causality(x: dict[int, int], comp: dict[int, int], bounds: dict[tuple[int, int], int]) -> dict[int, int]:
    """Shift x minimally so x_dst - x_src >= bound for every p2p pair: whole collective
    components first (keeping their internal agreement), then single ranks."""
    shifts = {root: 0 for root in set(comp.values())}
    comp_bounds = {
        (src, dst): lower - (x[dst] - x[src]) for (src, dst), lower in bounds.items() if comp[src] != comp[dst]
    }
    _project(shifts, comp_bounds, lambda r: comp[r])
    out = {r: x[r] + shifts[comp[r]] for r in x}
    _project(out, bounds, lambda r: r)
    return out


def count_p2p_violations(comm: _CommEvents, x: dict[int, int]) -> int:
    """Matched messages whose recv ends before the send starts after adding x."""
    return sum(
        1
        for (src, dst, seq), start in comm.sends.items()
        if (end := comm.recvs.get((src, dst, seq))) is not None and end + x.get(dst, 0) < start + x.get(src, 0)
    )


def compute_collective_residuals(collectives: dict, x: dict[int, int]) -> tuple[dict[int, float], float]:
    """Per rank, median |end - instance median end| after corrections; and overall."""
    per_rank: dict[int, list[int]] = defaultdict(list)
    for members in collectives.values():
        if len(members) < 2:
            continue
        ends = np.array([end + x[r] for r, end in members], dtype=np.int64)
        centre = _int_median(ends)
        for (rank, _), end in zip(members, ends):
            per_rank[rank].append(abs(int(end) - centre))
    residual = {r: float(np.median(v)) for r, v in per_rank.items()}
    everything = [d for v in per_rank.values() for d in v]
    return residual, float(np.median(everything)) if everything else math.nan


def apply_alignment(trace: RankTrace, mapping: ClockMapping, correction_ns: int) -> RankTrace:
    """Copy of `trace` with start_ns/end_ns of all non-calib rows on the aligned
    timeline (calib rows keep their raw device/wall pair)."""
    events = trace.events
    is_calib = _is_category(events, "calib")
    for name in ("start_ns", "end_ns"):
        raw = events.column(name).to_numpy()
        aligned = np.where(is_calib, raw, mapping.apply(raw) + np.int64(correction_ns))
        events = events.set_column(events.schema.get_field_index(name), events.schema.field(name), pa.array(aligned, pa.int64()))
    meta = {**trace.meta, "alignment": {"offset_ns": mapping.offset_ns + correction_ns, "drift": mapping.drift, "ref_ns": mapping.ref_ns}}
    return replace(trace, meta=meta, events=events)


def align_traces(
    traces: list[RankTrace], min_drift_span_ns: int = DEFAULT_MIN_DRIFT_SPAN_NS
) -> tuple[list[RankTrace], AlignmentReport]:
    """Aligned copies of `traces` (same order) and the report (see module docstring)."""
    ranks = [t.rank for t in traces]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate ranks in traces: {sorted(ranks)}")
    mappings = {t.rank: compute_wall_mapping(t, min_drift_span_ns) for t in traces}
    comm = collect_comm_events(traces, mappings)
    diffs = compute_pairwise_end_differences(comm.collectives)
    x_float, comp = compute_collective_offsets(ranks, diffs)
    x = {r: int(round(v)) for r, v in x_float.items()}
    bounds = _p2p_bounds(comm)
    before = count_p2p_violations(comm, {})  # with the wall-clock mapping alone
    x = enforce_p2p_causality(x, comp, bounds)
    anchor = 0 if 0 in x else (min(ranks) if ranks else 0)
    base = x.get(anchor, 0)
    x = {r: v - base for r, v in x.items()}
    residual, overall = compute_collective_residuals(comm.collectives, x)
    report = AlignmentReport(
        offset_ns={r: mappings[r].offset_ns + x[r] for r in ranks},
        drift_ppm={r: mappings[r].drift * 1e6 for r in ranks},
        residual_ns={r: residual.get(r, math.nan) for r in ranks},
        median_residual_ns=overall,
        anchors=sum(1 for m in comm.collectives.values() if len(m) > 1),
        p2p_messages=sum(1 for k in comm.sends if k in comm.recvs),
        violations_before=before,
        violations=count_p2p_violations(comm, x),
        method=_describe_methods(ranks, diffs, bounds),
    )
    return [apply_alignment(t, mappings[t.rank], x[t.rank]) for t in traces], report


def _describe_methods(ranks: list[int], diffs: dict, bounds: dict) -> dict[int, str]:
    in_collectives = {r for edge in diffs for r in edge}
    in_p2p = {r for edge in bounds for r in edge}
    return {
        r: "collectives" if r in in_collectives else "p2p" if r in in_p2p else "wall-clock" for r in ranks
    }
