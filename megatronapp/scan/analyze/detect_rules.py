"""The evidence MegaScan's detector weighs: per-rank compute, collective arrivals, p2p links.

Each function here is pure (traces in, numbers out) and documented with the exact quantity it
measures; `detect.py` turns the numbers into suspects. Times are nanoseconds on the aligned
timeline. Four quantities matter:

  * pure compute of a forward/backward span = its duration minus the union of the comm spans
    and "loss" spans fully nested in it. A TP victim waits *inside* its forward (in the TP
    all-reduce), so without the subtraction it would look as slow as the culprit. Async ops
    that outlive the span (overlapped DP bucket reduces) are not fully nested and stay.
  * a collective instance (group, seq): member i's span splits into wait = last_start -
    start_i and transfer = end_i - last_start; the last member to arrive is the straggler.
  * a cold span: one that starts less than `recovery_ns` after its rank waited for at least
    `idle_ns` (between compute spans, inside comm spans). Work right after a long wait runs
    slower on the same hardware: on the 2-core VM a 1 ms matmul chain takes 1.5x after a 5-45 ms sleep and ~3 ms
    to recover (caches, clocks, a descheduled vCPU; GPUs lower clocks when idle too). The
    victims of a slow link or a slow stage wait the longest, so their cold spans read as
    1.3-1.8x their replicas' (PP2xDP2 design runs). A rank is judged on its warm spans only,
    against its peers' warm spans and against all of their spans (compare_compute's two
    references; detect.py names it if either comparison passes the rule). Warm with warm is
    the unbiased one: a cold reference hides a culprit as surely as a cold sample makes a
    victim (a 1.36x rank whose replica received a slow link read 1.09x, consistency 0.39,
    against all of the replica's spans, and 1.78x, 0.81, against its warm ones: heldout4 run 4,
    a miss this was then written for, so heldout5 judges it). But where the peers are cold
    nearly always, few keys are warm on both, and all of their spans, a colder reference that
    only makes the rank look less slow, give the stronger evidence (design runs: 7 samples at
    z 15 against 5 at z 2.6).
    The price: a rank cold before nearly every span (a slow link's receiver) cannot be judged
    on constant slowness; the report says so. Dividing cold spans by a cold/warm ratio
    measured on the run's other ranks instead was tried on the design runs and failed both
    ways: from the same rank's streams it comes from short waits (~1.1x) and undercorrects
    long ones; from the other ranks' ratios to their peers it reads 1.5-2.3x (their warm
    reference includes cold spans) and hides a real 1.36x. The intermittent rule keeps every
    span: a victim is cold in all iterations, which is no subset, and dropping spans cost it
    most of its power on the loaded VM.
  * a p2p message: effective transfer = recv_end - max(send_start, recv_wait_start), where
    recv_wait_start is when the receiver stopped doing other work (the later of the recv's
    posting and the end of any local compute inside the recv span). A slow *sender* posts
    late, so its messages still transfer quickly: only a slow link inflates this number
    (detect_links.py).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megatronapp.scan.merge.matching import CommIndex
from megatronapp.spans import COMPUTE_KINDS, ITERATION, NESTED_NON_COMPUTE, UNKEYED_DP_COLLECTIVES

_MAD_TO_SIGMA = 1.4826
_MEDIAN_SE = 1.2533  # standard error of a median, in units of sigma / sqrt(n)


@dataclass(frozen=True)
class RankEvents:
    """One rank's events as numpy columns: the detector's working view of a RankTrace."""

    rank: int
    coords: dict
    path: str
    cols: dict  # column name -> np.ndarray (strings as object arrays)

    def mask(self, **equal) -> np.ndarray:
        m = np.ones(len(self.cols["start_ns"]), dtype=bool)
        for key, value in equal.items():
            m &= self.cols[key] == value
        return m


def build_rank_events(trace) -> RankEvents:
    """Decode a RankTrace's table once (dictionary strings become plain object arrays)."""
    cols = {}
    for name in trace.events.column_names:
        col = trace.events.column(name)
        if name in ("name", "cat", "op", "group"):
            cols[name] = np.array(col.to_pylist(), dtype=object)
        else:
            cols[name] = col.to_numpy().astype(np.int64)
    return RankEvents(rank=int(trace.meta["rank"]), coords=dict(trace.meta["coords"]), path=str(trace.path), cols=cols)


def compute_iteration_spans(ev: RankEvents) -> dict[int, tuple[int, int]]:
    """iteration -> (start, end) of this rank's "iteration" step span."""
    c, m = ev.cols, ev.mask(cat="step", name=ITERATION)
    return {int(i): (int(s), int(e)) for i, s, e in zip(c["iteration"][m], c["start_ns"][m], c["end_ns"][m]) if e >= s}


# -- compute ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeSpan:
    key: tuple[int, int, int, str]  # (iteration, chunk, microbatch, kind)
    start: int
    end: int
    pure_ns: int
    cold: bool = False  # starts within the recovery window after a long wait (module docstring)


def union_length(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of (start, end) intervals, in any order."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0 if cur_e is None else cur_e - cur_s)


def _wake_times(c: dict, idle_ns: int) -> np.ndarray:
    """Sorted ends of the rank's long waits: gaps between its compute spans in which it sat in
    communication for at least idle_ns. A gap without comm is untraced work (zero-code traces
    leave optimizer steps and data loading out), and comm overlapped with compute (a receive
    posted ahead, a gradient bucket) is no wait at all."""
    comp = c["cat"] == "compute"
    if comp.sum() < 2:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(c["start_ns"][comp], kind="stable")
    starts, reach = c["start_ns"][comp][order], np.maximum.accumulate(c["end_ns"][comp][order])
    gap_lo, gap_hi = reach[:-1], starts[1:]
    long_gap = gap_hi - gap_lo >= idle_ns
    comm = c["cat"] == "comm"
    by_start = np.argsort(c["start_ns"][comm], kind="stable")
    c_start, c_end = c["start_ns"][comm][by_start], c["end_ns"][comm][by_start]
    longest = int((c_end - c_start).max()) if len(c_start) else 0
    wakes = []
    for lo, hi in zip(gap_lo[long_gap], gap_hi[long_gap]):  # only comm that starts in [lo - longest, hi) can overlap
        a, b = np.searchsorted(c_start, lo - longest, "left"), np.searchsorted(c_start, hi, "left")
        clipped = [(max(int(x), int(lo)), min(int(y), int(hi))) for x, y in zip(c_start[a:b], c_end[a:b]) if y > lo]
        if union_length(clipped) >= idle_ns:
            wakes.append(int(hi))
    return np.asarray(wakes, dtype=np.int64)


def compute_pure_spans(
    ev: RankEvents, iterations: set[int], idle_ns: int = 0, recovery_ns: int = 0
) -> list[ComputeSpan]:
    """Forward/backward spans of `iterations` with their pure compute time and whether they are
    cold (module docstring; idle_ns 0: none is)."""
    c = ev.cols
    wakes = _wake_times(c, idle_ns) if idle_ns > 0 else np.zeros(0, dtype=np.int64)
    it_ok = np.isin(c["iteration"], list(iterations))
    nested_ok = (c["cat"] == "comm") | np.isin(c["name"], NESTED_NON_COMPUTE)
    order = np.argsort(c["start_ns"][nested_ok], kind="stable")
    n_start, n_end = c["start_ns"][nested_ok][order], c["end_ns"][nested_ok][order]
    spans = []
    for i in np.flatnonzero(it_ok & (c["cat"] == "compute") & np.isin(c["name"], COMPUTE_KINDS)):
        s, e = int(c["start_ns"][i]), int(c["end_ns"][i])
        lo, hi = np.searchsorted(n_start, s, "left"), np.searchsorted(n_start, e, "right")
        inside = [(int(a), int(b)) for a, b in zip(n_start[lo:hi], n_end[lo:hi]) if b <= e]
        key = (int(c["iteration"][i]), int(c["chunk"][i]), int(c["microbatch"][i]), str(c["name"][i]))
        last = int(np.searchsorted(wakes, s, "right")) - 1
        cold = last >= 0 and s - int(wakes[last]) < recovery_ns
        spans.append(ComputeSpan(key, s, e, max(0, e - s - union_length(inside)), cold))
    return spans


@dataclass(frozen=True)
class IntermittentStats:
    """One rank's most significant subset of slow iterations and how unlikely it is in a clean run
    (computed by detect_intermittent.py, whose docstring gives the steps; defined here because it
    travels in ComputeStats)."""

    rank: int
    iterations: int  # with evidence for this rank
    slow_iterations: tuple[int, ...]  # the subset, ascending
    p_value: float  # family-wise over subset sizes and ranks (detect_intermittent docstring, step 5)
    periodic: bool  # the slow iterations are evenly spaced (gaps >= 2) over the whole run
    slow_ratio: float  # median compute ratio to the peers in the slow iterations (1.0: as fast as they)
    slow_z: float  # significance of log(slow_ratio) > 0 (median of k levels: SE 1.2533 sigma / sqrt(k))
    base_ratio: float  # median compute ratio to the peers in the other iterations
    self_ratio: float  # its own compute in the slow iterations over the others': ~1 for a victim, whose
    # ratio only moved because its peers' did (with two peers each is the other's reference)
    evidence_sigmas: float  # median evidence e of the slow iterations, in units of sigma


@dataclass(frozen=True)
class ComputeStats:
    """One rank's compute against peers doing identical work (per-sample ratios to the peer median)."""

    rank: int
    basis: str  # "dp_replicas" | "tp_peers" | "pipeline_stages"
    peers: tuple[int, ...]
    samples: int
    iterations: int
    ratio: float  # median over samples of my / median(peers)
    consistency: float  # fraction of iterations whose median sample ratio >= threshold
    sample_share: float  # fraction of single samples with ratio >= threshold (noisier)
    z: float  # robust significance of log(ratio) > 0 (median / its MAD-based standard error)
    rank_median_ns: float
    peer_median_ns: float
    excess_ns_per_iteration: float  # median over iterations of sum(my - peer median)
    edge_stage: bool  # first/last pipeline stage (extra embedding/loss work)
    intermittent: IntermittentStats | None = None  # its slow iterations, if any (detect_intermittent.py)


def robust_z(logs: np.ndarray) -> float:
    """Median of `logs` over the standard error of a median (MAD-based): how surely it is above 0."""
    med = float(np.median(logs))
    se = _MEDIAN_SE * _MAD_TO_SIGMA * float(np.median(np.abs(logs - med))) / np.sqrt(len(logs))
    return med / se if se > 0 else (np.inf if med > 0 else 0.0)


def peer_median_ratio(value: float, peer_values) -> float | None:
    """value / median(peer_values): how many times longer than its peers doing identical work a
    rank took (None without peers or positive times). The compute rule of the trace detector and
    of the online detector (detect_online.py)."""
    ref = float(np.median(peer_values)) if len(peer_values) else 0.0
    return value / ref if ref > 0 and value > 0 else None


def _paired_samples(mine: dict, refs: dict, peer_ranks) -> dict:
    """key -> (my pure ns, median of the peers' pure ns) over the keys some peer holds in refs."""
    pairs = {}
    for key, v in mine.items():
        others = [refs[p][key] for p in peer_ranks if p in refs and key in refs[p]]
        ratio = peer_median_ratio(v, others)
        if ratio is not None:
            pairs[key] = (v, float(np.median(others)))
    return pairs


def compare_compute(
    spans_by_rank: dict[int, list[ComputeSpan]],
    peers: dict[int, tuple[int, ...]],
    basis: str,
    pp_size: int,
    coords: dict[int, dict],
    threshold: float,
    reference: str = "warm",
) -> dict[int, ComputeStats]:
    """Per rank: its warm pure compute per (iteration, chunk, microbatch, kind) over the peers'
    median, against the peers' warm spans (reference "warm") or all of their spans ("all"; module
    docstring).

    Consistency is judged per iteration (the median of its samples against `threshold`):
    single spans on a shared CPU jitter too much to be counted one by one. Ranks without
    peers or without any matching sample are left out."""
    if reference not in ("warm", "all"):
        raise ValueError(f"reference must be 'warm' or 'all', not {reference!r}")
    warm = {r: {s.key: s.pure_ns for s in spans if not s.cold} for r, spans in spans_by_rank.items()}
    refs = warm if reference == "warm" else {r: {s.key: s.pure_ns for s in spans} for r, spans in spans_by_rank.items()}
    out = {}
    for rank, mine in warm.items():
        pairs = _paired_samples(mine, refs, peers.get(rank, ()))
        if not pairs:
            continue
        per_it: dict[int, list[float]] = defaultdict(list)
        excess: dict[int, float] = defaultdict(float)
        for key, (v, ref) in pairs.items():
            per_it[key[0]].append(v / ref)
            excess[key[0]] += v - ref
        ratios = np.concatenate([np.asarray(r) for r in per_it.values()])
        pp = coords[rank]["pp"]
        out[rank] = ComputeStats(
            rank=rank,
            basis=basis,
            peers=tuple(peers.get(rank, ())),
            samples=len(ratios),
            iterations=len(per_it),
            ratio=float(np.exp(np.median(np.log(ratios)))),
            consistency=float(np.mean([np.median(r) >= threshold for r in per_it.values()])),
            sample_share=float(np.mean(ratios >= threshold)),
            z=float(robust_z(np.log(ratios))),
            rank_median_ns=float(np.median([v for v, _ in pairs.values()])),
            peer_median_ns=float(np.median([ref for _, ref in pairs.values()])),
            excess_ns_per_iteration=float(np.median(list(excess.values()))),
            edge_stage=pp_size > 1 and pp in (0, pp_size - 1),
        )
    return out


def build_compute_peers(coords: dict[int, dict], layout: dict) -> tuple[str, dict[int, tuple[int, ...]]]:
    """Peers doing identical work, by the strongest basis the layout offers.

    DP replicas (same tp, pp) when dp_size > 1; else TP peers (same dp, pp); else the other
    pipeline stages (weak: first/last stages carry embedding/loss work, so the middle stages
    are the reference whenever there are any)."""
    if layout["dp_size"] > 1:
        basis, same = "dp_replicas", ("tp", "pp")
    elif layout["tp_size"] > 1:
        basis, same = "tp_peers", ("dp", "pp")
    elif layout["pp_size"] > 1:
        basis, same = "pipeline_stages", ("tp", "dp")
    else:
        return "none", {}
    by_key: dict[tuple, list[int]] = defaultdict(list)  # grouped once: linear in the ranks
    for r in sorted(coords):
        by_key[tuple(coords[r][k] for k in same)].append(r)
    peers = {r: tuple(p for p in by_key[tuple(c[k] for k in same)] if p != r) for r, c in coords.items()}
    if basis == "pipeline_stages":  # middle stages are the clean reference: edges do extra work
        last = layout["pp_size"] - 1
        for r, ps in peers.items():
            middle = tuple(p for p in ps if 0 < coords[p]["pp"] < last)
            peers[r] = middle or ps
    return basis, peers


# -- collectives -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveInstance:
    group: str
    family: str  # which axis the group spans: "tp", "dp", "pp", "mp", "world" or "mixed"
    seq: int
    iteration: int
    spans: dict  # rank -> (start, end)
    last_rank: int
    last_start: int


def _group_family(members, coords: dict[int, dict]) -> str:
    varying = {k for k in ("tp", "dp", "pp") if len({coords[r][k] for r in members if r in coords}) > 1}
    if len(varying) == 1:
        return varying.pop()
    return {frozenset({"tp", "pp"}): "mp", frozenset({"tp", "dp", "pp"}): "world"}.get(frozenset(varying), "mixed")


def _unkeyed_dp_spans(events: dict[int, RankEvents], iterations: set[int]):
    """(group, seq, rank, start, end, iteration) of UNKEYED_DP_COLLECTIVES spans: group = name +
    the rank's DP replicas, seq = iteration."""
    coords = {r: ev.coords for r, ev in events.items()}
    for r, ev in events.items():
        c = ev.cols
        unkeyed = (c["cat"] == "comm") & np.isin(c["name"], UNKEYED_DP_COLLECTIVES) & (c["group"] == "")
        dp_peers = sorted(p for p, pc in coords.items() if pc["tp"] == ev.coords["tp"] and pc["pp"] == ev.coords["pp"])
        for i in np.flatnonzero(unkeyed & np.isin(c["iteration"], list(iterations))):
            it = int(c["iteration"][i])
            yield f"{c['name'][i]}:{dp_peers}", it, r, int(c["start_ns"][i]), int(c["end_ns"][i]), it


def collect_collectives(
    index: CommIndex, events: dict[int, RankEvents], iterations: set[int]
) -> list[CollectiveInstance]:
    """Complete collective instances of `iterations` (every member of the group present).

    Keyed instances come from `index` (matching.py); unkeyed DP spans (UNKEYED_DP_COLLECTIVES)
    become one instance per iteration among the DP replicas that recorded it."""
    coords = {r: ev.coords for r, ev in events.items()}
    raw: dict[tuple, dict] = defaultdict(dict)
    members: dict[str, set] = defaultdict(set)
    iteration_of: dict[tuple, int] = {}
    keyed = (
        (g, seq, m.rank, m.start, m.end, m.iteration)
        for (g, seq), ms in index.collectives.items()
        for m in ms
        if m.iteration in iterations
    )
    for group, seq, r, start, end, it in itertools.chain(keyed, _unkeyed_dp_spans(events, iterations)):
        raw[(group, seq)][r] = (start, end)
        members[group].add(r)
        iteration_of[(group, seq)] = it
    out = []
    for (group, seq), spans in raw.items():
        if len(spans) < 2 or len(spans) < len(members[group]):
            continue  # a member's span is missing (partial trace): no honest split possible
        last_rank = max(spans, key=lambda r: (spans[r][0], r))
        out.append(
            CollectiveInstance(
                group,
                _group_family(members[group], coords),
                seq,
                iteration_of[(group, seq)],
                spans,
                last_rank,
                spans[last_rank][0],
            )
        )
    return out


@dataclass
class StragglerStats:
    """How often a rank arrived last at its collectives, per group family."""

    instances: dict = field(default_factory=lambda: defaultdict(int))
    last: dict = field(default_factory=lambda: defaultdict(int))
    imposed_wait_ns: dict = field(default_factory=lambda: defaultdict(int))  # others' wait on me
    own_wait_ns: int = 0
    expected_share: dict = field(default_factory=lambda: defaultdict(float))

    def share(self, family: str) -> float:
        return self.last[family] / self.instances[family] if self.instances[family] else 0.0


def compute_straggler_stats(instances: list[CollectiveInstance]) -> dict[int, StragglerStats]:
    """Per rank and family: instances, last arrivals, wait imposed on others, own wait."""
    stats: dict[int, StragglerStats] = defaultdict(StragglerStats)
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            st = stats[r]
            st.instances[inst.family] += 1
            st.expected_share[inst.family] += 1.0 / len(inst.spans)
            st.own_wait_ns += inst.last_start - start
        last = stats[inst.last_rank]
        last.last[inst.family] += 1
        last.imposed_wait_ns[inst.family] += sum(inst.last_start - s for s, _ in inst.spans.values())
    for st in stats.values():
        for fam, n in st.instances.items():
            st.expected_share[fam] /= n
    return dict(stats)


def to_ms(ns: float) -> float:
    """Nanoseconds as milliseconds, rounded to the microsecond (reports and evidence)."""
    return round(float(ns) / 1e6, 3)
