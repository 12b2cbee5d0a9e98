"""Intermittent slowdowns: a rank slow in a subset of iterations, tested against a noise model.

A rank slowed 1.2x in one iteration of every four adds ~5% on average: far below what a
median over all iterations can tell from noise. What gives it away is *where* the slowness
sits: all of the rank's compute in the same few iterations, while its peers doing identical
work are not slow there. Algorithm (pure; spans and peers as detect_rules.compare_compute):

  1. Per span, x = log(my pure compute / median of my peers' for the same (iteration,
     chunk, microbatch, kind)). Waiting never enters pure compute, so the victims of a slow
     rank get x <= 0: they are never the ones that look slow.
  2. Standardise per stream (chunk, microbatch, kind): minus the rank's median over
     iterations (its steady bias: edge-stage work, an unfairly shared core), divided by the
     stream's noise scale (1.4826 x MAD, pooled over ranks). Streams differ: DDP's backward,
     whose overlapped all-reduces are subtracted from it, jitters 2-5x more than its forward
     (measured on the 2-core VM) and must not drown it.
  3. Iteration evidence e(rank, it) = lower median of the rank's standardised spans of the
     iteration: a slowdown stretches *all* of a rank's compute in a slow iteration, a scheduler
     hiccup one span (with only a forward and a backward, both must rise). sigma = e's scale,
     pooled over ranks the same way.
  4. Noise model of e: a Gaussian core of scale sigma plus heavy-tailed outliers at the rate
     the run shows them. For k = min_iterations .. max_share x n, with m_k the rank's k-th
     largest e over its n iterations, one clean iteration reaches m_k with probability
     p0 = max(Gaussian tail at m_k / sigma, (cells >= m_k + 1/2) / (cells + 1)) over every
     (rank, iteration) cell but the k under test, and
     p_k = P(Binomial(n, p0) >= number of episodes), where adjacent slow iterations count as
     one episode (contention lasting a while is one event). If the k iterations are evenly
     spaced with gaps >= 2 and span the run, missing at most one term of the period at either
     end (a periodic fault: every 3rd iteration, all run long), p_k is multiplied by the chance
     that k of n iterations drawn at random are (exact for exchangeable iterations, whatever the
     noise's shape). A window of every other iteration is contention aliasing with the
     iteration period, not a period: it gets no such factor.
  5. p-value = min_k p_k x (subset sizes tried) x (ranks judged): Bonferroni, so it bounds the
     chance that a clean run names anybody. detect.is_intermittent compares it to
     DetectConfig.intermittent_alpha, and also asks the slow iterations to be slower than the
     *peers* (slow_z), not only than the rank's usual self: with two peers each is the
     other's reference, so a slow rank's partner looks "slow" in exactly its fast iterations.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from megatronapp.scan.analyze.detect_rules import ComputeSpan, IntermittentStats, peer_median_ratio

_MAD_TO_SIGMA = 1.4826
_MEDIAN_SE = 1.2533  # standard error of a median, in units of sigma / sqrt(n)
_MIN_SCALE = 1e-3  # log-ratio units: a stream with no spread at all (identical simulated spans)


def compute_log_ratios(
    spans_by_rank: dict[int, list[ComputeSpan]], peers: dict[int, tuple[int, ...]]
) -> dict[int, dict[tuple, dict[int, float]]]:
    """rank -> stream (chunk, microbatch, kind) -> iteration -> log(pure compute / peers' median)."""
    values = {r: {s.key: s.pure_ns for s in spans} for r, spans in spans_by_rank.items()}
    out: dict[int, dict[tuple, dict[int, float]]] = {}
    for rank, mine in values.items():
        streams: dict[tuple, dict[int, float]] = defaultdict(dict)
        for key, v in mine.items():
            ratio = peer_median_ratio(v, [values[p][key] for p in peers.get(rank, ()) if key in values.get(p, {})])
            if ratio is not None:
                streams[key[1:]][key[0]] = math.log(ratio)
        if streams:
            out[rank] = dict(streams)
    return out


def _pooled_scale(series: list) -> float:
    """Noise scale shared by several series (one per rank): 1.4826 x the median absolute
    deviation of each value from its own series' median."""
    deviations = [np.asarray(v, dtype=float) - np.median(v) for v in series if len(v)]
    pooled = np.concatenate(deviations) if deviations else np.zeros(1)
    return max(_MAD_TO_SIGMA * float(np.median(np.abs(pooled))), _MIN_SCALE)


def _lower_median(values: list[float]) -> float:
    return float(np.sort(values)[(len(values) - 1) // 2])


def compute_iteration_evidence(log_ratios: dict[int, dict[tuple, dict[int, float]]]) -> tuple[dict, float]:
    """(rank -> iteration -> e, sigma): steps 2-3 of the module docstring; e is centred at the
    rank's median over iterations."""
    by_stream: dict[tuple, list] = defaultdict(list)
    for streams in log_ratios.values():
        for k, its in streams.items():
            by_stream[k].append(list(its.values()))
    scale = {k: _pooled_scale(series) for k, series in by_stream.items()}
    raw = {}
    for r, streams in log_ratios.items():
        per_it: dict[int, list[float]] = defaultdict(list)
        for k, its in streams.items():
            level = float(np.median(list(its.values())))
            for it, x in its.items():
                per_it[it].append((x - level) / scale[k])
        raw[r] = {it: _lower_median(z) for it, z in per_it.items()}
    sigma = _pooled_scale([list(e.values()) for e in raw.values()])
    return {r: {it: v - float(np.median(list(e.values()))) for it, v in e.items()} for r, e in raw.items()}, sigma


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k)."""
    if k <= 0:
        return 1.0
    if p <= 0.0 or k > n:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * log_p + (n - j) * log_q
        for j in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _spans_the_run(first: int, gap: int, k: int, n: int) -> bool:
    """A progression first, first + gap, ... (k terms) in positions 0..n-1 misses at most one
    term of its period at each end: a periodic fault slows the whole run, whereas a burst of
    contention that happens to alias with the iteration period fills only a window of it."""
    return first < 2 * gap and n - 1 - (first + (k - 1) * gap) < 2 * gap


def evenly_spaced_chance(k: int, n: int) -> float:
    """Chance that k of n consecutive positions drawn at random are evenly spaced with gaps of
    at least 2 and span the run (_spans_the_run); 1.0 for k < 3 (two points are always evenly
    spaced). Gap 1 is left out on purpose: consecutive slow iterations are a burst (contention
    lasting a while), not a period."""
    if k < 3:
        return 1.0
    progressions = sum(
        1
        for gap in range(2, (n - 1) // (k - 1) + 1)
        for first in range(n - (k - 1) * gap)
        if _spans_the_run(first, gap, k, n)
    )
    return min(1.0, progressions / math.comb(n, k))


def _is_periodic(positions, n: int) -> bool:
    """Evenly spaced with gaps >= 2 and spanning positions 0..n-1 (_spans_the_run)."""
    p = np.sort(np.asarray(positions))
    if len(p) < 3:
        return False
    gaps = np.diff(p)
    return bool(np.all(gaps == gaps[0]) and gaps[0] >= 2 and _spans_the_run(int(p[0]), int(gaps[0]), len(p), n))


def count_episodes(positions) -> int:
    """Runs of consecutive positions: adjacent slow iterations are one event, not independent ones."""
    p = np.sort(np.asarray(positions))
    return int(len(p) - np.count_nonzero(np.diff(p) == 1)) if len(p) else 0


def _gaussian_tail(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _best_subset(e: np.ndarray, pooled: np.ndarray, sigma: float, sizes: range) -> tuple[float, np.ndarray]:
    """(min_k p_k, positions of that subset): step 4 for one rank's evidence `e` (positions =
    indices into e, iterations ascending); `pooled` = every rank's evidence, sorted."""
    order = np.argsort(-e, kind="stable")
    best = (1.0, order[:0])
    for k in sizes:
        m = float(e[order[k - 1]])
        exceed = len(pooled) - int(np.searchsorted(pooled, m)) - k  # every cell but the k under test
        p0 = max(_gaussian_tail(m / sigma), (exceed + 0.5) / (len(pooled) - k + 1.0))
        p = binomial_tail(count_episodes(order[:k]), len(e), p0)
        if _is_periodic(order[:k], len(e)):
            p *= evenly_spaced_chance(k, len(e))
        if p < best[0]:
            best = (p, order[:k])
    return best


def compare_intermittent(
    spans_by_rank: dict[int, list[ComputeSpan]],
    peers: dict[int, tuple[int, ...]],
    min_iterations: int = 2,
    max_share: float = 0.5,
) -> dict[int, IntermittentStats]:
    """Per rank with peers: its most significant subset of min_iterations .. max_share x n slow
    iterations and the effect sizes there (module docstring)."""
    log_ratios = compute_log_ratios(spans_by_rank, peers)
    evidence, sigma = compute_iteration_evidence(log_ratios)
    levels = {r: _iteration_levels(streams) for r, streams in log_ratios.items()}
    level_sigma = _pooled_scale([list(v.values()) for v in levels.values()])
    pooled = np.sort(np.concatenate([list(e.values()) for e in evidence.values()])) if evidence else np.zeros(0)
    out = {}
    for rank, ev in evidence.items():
        its = sorted(ev)
        e = np.array([ev[i] for i in its])
        sizes = range(max(1, min_iterations), int(max_share * len(e)) + 1)
        p, subset = _best_subset(e, pooled, sigma, sizes)
        family = max(len(sizes), 1) * len(evidence)
        sigmas = float(np.median(e[subset])) / sigma if len(subset) else 0.0
        own = _iteration_levels(_own_log_durations(spans_by_rank[rank]), centre=True)
        out[rank] = _stats(
            rank,
            levels[rank],
            level_sigma,
            own,
            sorted(its[i] for i in subset),
            min(1.0, p * family),
            sigmas,
            _is_periodic(subset, len(e)),
        )
    return out


def _iteration_levels(streams: dict[tuple, dict[int, float]], centre: bool = False) -> dict[int, float]:
    """iteration -> median over the rank's streams of their value (minus the stream's median
    over iterations, with `centre`)."""
    per_it: dict[int, list[float]] = defaultdict(list)
    for by_it in streams.values():
        mid = float(np.median(list(by_it.values()))) if centre else 0.0
        for it, x in by_it.items():
            per_it[it].append(x - mid)
    return {it: float(np.median(v)) for it, v in per_it.items()}


def _own_log_durations(spans: list[ComputeSpan]) -> dict[tuple, dict[int, float]]:
    """stream -> iteration -> log(pure compute): the rank's own work, whatever its peers did."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for s in spans:
        if s.pure_ns > 0:
            out[s.key[1:]][s.key[0]] = math.log(s.pure_ns)
    return out


def _stats(
    rank: int,
    level: dict[int, float],
    level_sigma: float,
    own: dict[int, float],
    slow: list[int],
    p: float,
    sigmas: float,
    periodic: bool,
) -> IntermittentStats:
    """Effect sizes: how much slower than its peers the rank is in its slow iterations (level:
    log-ratio to them), how significantly, how fast in the others, and how much longer its own
    compute took there than in the others (own: its log durations, per stream centred)."""
    base = [v for it, v in level.items() if it not in set(slow)] or [0.0]
    slow_level = float(np.median([level[it] for it in slow])) if slow else float(np.median(base))
    z = slow_level / (_MEDIAN_SE * level_sigma / math.sqrt(len(slow))) if slow else 0.0
    rest = [v for it, v in own.items() if it not in set(slow)]
    rise = float(np.median([own[it] for it in slow if it in own]) - np.median(rest)) if slow and rest else 0.0
    return IntermittentStats(
        rank,
        len(level),
        tuple(slow),
        p,
        periodic,
        math.exp(slow_level),
        z,
        math.exp(float(np.median(base))),
        math.exp(rise),
        sigmas,
    )
