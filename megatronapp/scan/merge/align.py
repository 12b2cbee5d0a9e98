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
3. Keep the wall clock where the trace agrees with it. For each component, if no
   rank's correction is significant (> 5 standard errors of the fit, noise from the
   pooled MAD, at least 20 us) and the wall clock breaks no causality bound (step 4),
   the wall clock is kept: on one host it is exact, while collective ends on a busy
   machine carry scheduling noise.
4. Causality. A recv cannot finish before its matching send starts
   (x_dst - x_src >= send_start - recv_end), and nobody leaves a synchronising
   collective before its last member arrived (x_i - x_j >= start_j - end_i).
   Violated bounds are fixed by the smallest shift: whole collective components
   first (keeping their internal agreement), then single ranks, by alternating
   projections (each projection splits the violation between the two ends).
5. The timeline is re-anchored so that rank 0 (or the lowest rank) keeps its
   wall-clock mapping, and the residuals and remaining p2p violations are reported.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.scan.merge.matching import CommEnd, CommIndex, index_comm_events
from megatronapp.scan.record.format import RankTrace

DEFAULT_MIN_DRIFT_SPAN_NS = 30_000_000_000  # shorter calibration spans cannot see ppm drift
_MAX_PROJECTION_ROUNDS = 2000
_MAX_PROJECTION_WORK = 2_000_000  # constraint visits
_WALL_CLOCK_Z = 5.0  # standard errors a correction must exceed to overrule the wall clock
# Floor of that standard error: corrections under 100 us never overrule the wall clock,
# since members of one collective legitimately finish that far apart.
_MIN_EDGE_SE_NS = 20_000
_ALL_PAIRS_MAX_MEMBERS = 32  # larger collectives get O(members) causality bounds


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


def collect_comm_events(traces: list[RankTrace], mappings: dict[int, ClockMapping]) -> CommIndex:
    """Every rank's keyed comm spans on its wall-mapped timeline (see matching.py)."""
    return index_comm_events(traces, {r: m.apply for r, m in mappings.items()})


def compute_pairwise_end_differences(collectives: dict[tuple, list[CommEnd]]) -> dict[tuple[int, int], list[int]]:
    """(i, j) -> end_j - end_i for every collective instance both joined (star from
    the instance's lowest rank, so cost is linear in the members)."""
    diffs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for members in collectives.values():
        if len(members) < 2:
            continue
        ref, *rest = sorted(members, key=lambda m: m.rank)
        for m in rest:
            if m.rank != ref.rank:
                diffs[ref.rank, m.rank].append(m.end - ref.end)
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


@dataclass(frozen=True)
class CollectiveFit:
    """Least-squares corrections from collective ends: x per rank (its component's root
    at 0), component root per rank, and var_units[r] = Var(x_r) / Var(one instance's
    end difference), from the inverse of the weighted graph Laplacian."""

    x: dict[int, float]
    comp: dict[int, int]
    var_units: dict[int, float]


def compute_collective_offsets(ranks: list[int], diffs: dict[tuple[int, int], list[int]]) -> CollectiveFit:
    """Corrections x (to add to each rank's times) making collective ends coincide.

    Solves min sum_e w_e (x_j - x_i + d_e)^2, d_e the median end difference of edge e
    and w_e its number of instances, with each component's lowest rank fixed at 0."""
    comp = _components(ranks, diffs)
    index = {r: k for k, r in enumerate(ranks)}
    n = len(ranks)
    lap, rhs = np.zeros((n, n)), np.zeros(n)
    for (i, j), values in diffs.items():
        a, b, w = index[i], index[j], float(len(values))
        d = float(np.median(np.asarray(values, dtype=np.float64)))
        lap[a, a] += w
        lap[b, b] += w
        lap[a, b] -= w
        lap[b, a] -= w
        rhs[b] -= w * d  # normal equations of w (x_b - x_a + d)^2
        rhs[a] += w * d
    for root in set(comp.values()):  # pin each component's root at 0
        k = index[root]
        lap[k, :] = 0.0
        lap[k, k] = 1.0
        rhs[k] = 0.0
    inverse = np.linalg.inv(lap) if n else np.zeros((0, 0))
    x = inverse @ rhs
    return CollectiveFit(
        x={r: float(x[index[r]]) for r in ranks},
        comp=comp,
        var_units={r: 0.0 if comp[r] == r else float(inverse[index[r], index[r]]) for r in ranks},
    )


def compute_causality_bounds(comm: CommIndex) -> dict[tuple[int, int], int]:
    """(a, b) -> lower bound on x_b - x_a implied by causality: p2p (a sent to b) and
    synchronising collectives (a's arrival precedes b's departure)."""
    bounds: dict[tuple[int, int], int] = {}
    get = bounds.get  # the loops below run once per pair of members: kept free of calls
    for (src, dst, _), send, recv in comm.messages():
        lower = send.start - recv.end
        if lower > get((src, dst), lower - 1):
            bounds[src, dst] = lower
    for members in comm.sync_instances().values():
        if len(members) < 2:
            continue
        if len(members) <= _ALL_PAIRS_MAX_MEMBERS:
            pairs = [(a, b) for a in members for b in members if a.rank != b.rank]
        else:  # the tightest bounds: the last arrival and the first departure
            last, first_out = max(members, key=lambda m: m.start), min(members, key=lambda m: m.end)
            pairs = [(last, m) for m in members if m.rank != last.rank]
            pairs += [(m, first_out) for m in members if m.rank != first_out.rank]
        for j, i in pairs:
            lower = j.start - i.end
            if lower > get((j.rank, i.rank), lower - 1):
                bounds[j.rank, i.rank] = lower
    return bounds


def keep_wall_clock(fit: CollectiveFit, diffs: dict, bounds: dict) -> dict[int, float | None]:
    """fit.x with every component where the wall clock is consistent with the trace set
    to None (keep the wall-clock mapping): no rank's correction exceeds _WALL_CLOCK_Z
    standard errors and the wall clock breaks no causality bound.

    The noise of one instance's end difference is pooled over all edges (MAD around
    each edge's median, x1.2533 for a median's efficiency): per-edge MADs of a handful
    of instances are too unstable to judge by."""
    if not diffs:
        return dict.fromkeys(fit.x)
    spread = np.concatenate([np.abs(np.asarray(v, dtype=np.float64) - np.median(v)) for v in diffs.values()])
    sigma = 1.2533 * 1.4826 * float(np.median(spread))
    rejected = {
        fit.comp[r]
        for r, v in fit.x.items()
        if abs(v) > _WALL_CLOCK_Z * max(sigma * math.sqrt(fit.var_units[r]), _MIN_EDGE_SE_NS)
    }
    rejected |= {fit.comp[a] for (a, b), lower in bounds.items() if fit.comp[a] == fit.comp[b] and lower > 0}
    return {r: v if fit.comp[r] in rejected else None for r, v in fit.x.items()}


def _project(values: dict, bounds: dict[tuple, int], node_of) -> None:
    """Alternating projections in integer ns until every bound holds. Feasible inputs
    (true clocks are causal) converge quickly; the work is capped for inconsistent ones."""
    rounds = min(_MAX_PROJECTION_ROUNDS, max(50, _MAX_PROJECTION_WORK // max(len(bounds), 1)))
    for _ in range(rounds):
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


def enforce_causality(x: dict[int, int], comp: dict[int, int], bounds: dict[tuple[int, int], int]) -> dict[int, int]:
    """Shift x minimally so x_b - x_a >= bound for every bound (a, b): whole collective
    components first (keeping their internal agreement), then single ranks."""
    shifts = dict.fromkeys(set(comp.values()), 0)
    comp_bounds = {
        (src, dst): lower - (x[dst] - x[src]) for (src, dst), lower in bounds.items() if comp[src] != comp[dst]
    }
    _project(shifts, comp_bounds, lambda r: comp[r])
    out = {r: x[r] + shifts[comp[r]] for r in x}
    _project(out, bounds, lambda r: r)
    return out


def count_p2p_violations(comm: CommIndex, x: dict[int, int]) -> int:
    """Matched messages whose recv ends before the send starts after adding x."""
    return sum(
        1 for (src, dst, _), send, recv in comm.messages() if recv.end + x.get(dst, 0) < send.start + x.get(src, 0)
    )


def compute_collective_residuals(collectives: dict, x: dict[int, int]) -> tuple[dict[int, float], float]:
    """Per rank, median |end - instance median end| after corrections; and overall."""
    per_rank: dict[int, list[int]] = defaultdict(list)
    for members in collectives.values():
        if len(members) < 2:
            continue
        ends = [m.end + x[m.rank] for m in members]  # exact ints; few per instance, so no numpy
        centre = sorted(ends)[(len(ends) - 1) // 2]  # _int_median
        for m, end in zip(members, ends):
            per_rank[m.rank].append(abs(end - centre))
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
        events = events.set_column(
            events.schema.get_field_index(name), events.schema.field(name), pa.array(aligned, pa.int64())
        )
    meta = {
        **trace.meta,
        "alignment": {"offset_ns": mapping.offset_ns + correction_ns, "drift": mapping.drift, "ref_ns": mapping.ref_ns},
    }
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
    sync = comm.sync_instances()
    diffs = compute_pairwise_end_differences(sync)
    fit = compute_collective_offsets(ranks, diffs)
    comp = fit.comp
    bounds = compute_causality_bounds(comm)
    x_float = keep_wall_clock(fit, diffs, bounds)
    estimated = {r: 0 if v is None else int(round(v)) for r, v in x_float.items()}
    before = count_p2p_violations(comm, {})  # with the wall-clock mapping alone
    x = enforce_causality(estimated, comp, bounds)
    anchor = 0 if 0 in x else (min(ranks) if ranks else 0)
    base = x.get(anchor, 0)
    x = {r: v - base for r, v in x.items()}
    residual, overall = compute_collective_residuals(sync, x)
    report = AlignmentReport(
        offset_ns={r: mappings[r].offset_ns + x[r] for r in ranks},
        drift_ppm={r: mappings[r].drift * 1e6 for r in ranks},
        residual_ns={r: residual.get(r, math.nan) for r in ranks},
        median_residual_ns=overall,
        anchors=sum(1 for m in sync.values() if len(m) > 1),
        p2p_messages=comm.message_count(),
        violations_before=before,
        violations=count_p2p_violations(comm, x),
        method=_describe_methods(x_float, estimated, x),
    )
    return [apply_alignment(t, mappings[t.rank], x[t.rank]) for t in traces], report


def _describe_methods(
    x_float: dict[int, float | None], estimated: dict[int, int], final: dict[int, int]
) -> dict[int, str]:
    """How each rank's offset was set: "wall-clock" or "collectives", "+causality" if
    a causality bound then moved it (relative to rank 0)."""
    base = {r: "wall-clock" if v is None else "collectives" for r, v in x_float.items()}
    anchor = min(final) if final else 0
    moved = {r for r in final if final[r] - final[anchor] != estimated[r] - estimated[anchor]}
    return {r: base[r] + ("+causality" if r in moved else "") for r in final}
