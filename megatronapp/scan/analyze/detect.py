"""MegaScan slow-node / slow-link detection: name the root cause, not the victims.

A slow rank makes everybody around it wait: pipeline neighbours in recv, TP peers inside
their TP all-reduces, DP replicas in grad_reduce. Waiting is therefore never evidence
against a rank; only its *own* work is. Algorithm of `detect` (pure, over aligned traces):

  0. Iterations: those with an "iteration" span on every rank, inside `config.iterations`
     (half-open [A, B)); without an explicit range, warm-up iterations (index <
     `warmup_iterations`) are skipped unless nothing else is left.
  1. Compute (detect_rules.compare_compute). Pure compute of every forward/backward span
     (nested comm and loss spans subtracted) is divided by the median of the *same*
     (iteration, chunk, microbatch, kind) on peers doing identical work: DP replicas (same
     tp, pp); with dp_size 1, TP peers (same dp, pp); with tp_size 1 too, the other
     pipeline stages (weak: the middle stages are the reference, first/last stages need
     `edge_stage_allowance` more for their embedding/head/loss work, and weight is lower).
     Spans that start just after a long wait run cold and are left out of the rank's own
     samples; the reference is the peers' warm spans where that comparison passes the rule,
     else all of their spans (detect_rules: cold span). `config.compute_rule` decides; the default wants, over >= `min_samples` samples, either
     a constant slowdown (a median ratio >= `compute_min_ratio`, reached by the median of >=
     `compute_min_consistency` of the iterations, with a robust (median/MAD) z >=
     `compute_min_z`) or an intermittent one: a subset of iterations in which the rank is slow
     that a clean run would produce with probability <= `intermittent_alpha`, by the noise
     model of detect_intermittent.py (per-iteration evidence against the run's own jitter).
  2. Collectives (detect_rules.collect_collectives). Each (group, seq) instance splits into
     wait (last start - my start) and transfer (end - last start). Chronic last arrival
     (share >= `straggler_min_share`) corroborates a slow-compute verdict (+0.1 confidence).
     Arrival order is also evidence of its own (detect_arrival.py): a rank that caused most of
     the waiting at its collectives (its share beyond a fair one >= `arrival_min_excess_share` of what is
     left above a fair share), `arrival_min_lateness_ns` after its peers, with
     more *own* work since the group last synchronised (its waits subtracted, so a rank held up
     by its pipeline is a victim, not a straggler) by the compute bars (ratio, consistency, z)
     is named slow_compute even where its compute spans look normal (work outside the spans,
     a CPU quota that freezes it between spans). The same own work per iteration feeds the
     intermittent test too (detect_intermittent_arrival.py): a rank frozen in bursts between
     its spans has its own work inflated in a few iterations while its spans look normal.
  3. P2P (detect_links.compare_links). Effective transfer per directed link against links
     carrying same-size messages in the same pipeline direction; `config.link_rule` decides
     (default: median ratio >= `link_min_ratio`, excess >= `link_min_excess_ns`, and >=
     `link_min_consistency` of messages above those bars and above the
     `link_peer_quantile` of the peer links' own messages). A slow link is reported with
     rank = its source, by convention.
  4. Combine. Suspects are ranks whose own compute or own link is slow, so pure victims are
     never listed; a TP peer dragged along in lockstep and the reverse of a slow link are
     dropped as echoes of the stronger suspect, and slow links into one rank from every
     sender it has become that rank (verdict_filters.py). Confidence = basis weight x (0.5 + 0.5 x effect) x consistency, effect =
     (ratio - 1) / (strong ratio - 1) capped at 1. Order: confidence, then saving.
  5. What-if (detect_path): the iteration time if the suspect were as fast as its peers,
     from each iteration's critical path.
"""

from __future__ import annotations

import io
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np
from rich.console import Console
from rich.table import Table

from megatronapp.scan.analyze import detect_path as paths
from megatronapp.scan.analyze import detect_arrival as arrivals
from megatronapp.scan.analyze import detect_intermittent_arrival as own_intermittent
from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.analyze.detect_intermittent import compare_intermittent
from megatronapp.scan.analyze.verdict_filters import drop_echoes
from megatronapp.scan.merge.matching import index_comm_events

CAUSES = ("slow_compute", "slow_link")
_BASIS_WEIGHT = {"dp_replicas": 1.0, "tp_peers": 0.9, "pipeline_stages": 0.6}
_LINK_WEIGHT = 0.9
_VICTIM_MIN_SHARE = 0.05  # of the iteration time spent waiting, to be listed as a victim


class DetectInputError(ValueError):
    """Traces that cannot be analysed together; the message names the file."""


def is_constant(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Slow in most iterations: median ratio, consistency and robust z above their bars."""
    edge = stats.basis == "pipeline_stages" and stats.edge_stage
    threshold = config.compute_min_ratio * (config.edge_stage_allowance if edge else 1.0)
    return (stats.ratio >= threshold and stats.consistency >= config.compute_min_consistency
            and stats.z >= config.compute_min_z)


def is_intermittent(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Slow in a subset of iterations that a clean run produces with probability <= intermittent_alpha
    (detect_intermittent.py: the p-value covers every rank and subset size tried), slower there
    than its peers (not only than its usual self) at the same significance, and by a ratio worth
    naming (>= intermittent_min_ratio) both against its peers and against its own compute in the
    other iterations (a victim's ratio moves only because its peers' compute did)."""
    it = stats.intermittent
    return (it is not None and len(it.slow_iterations) >= config.intermittent_min_iterations
            and it.p_value <= config.intermittent_alpha
            and it.slow_z >= NormalDist().inv_cdf(1.0 - config.intermittent_alpha)
            and min(it.slow_ratio, it.self_ratio) >= config.intermittent_min_ratio)


def is_slow_compute(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Default compute rule (see the module docstring, step 1): constant or intermittent."""
    return stats.samples >= config.min_samples and (is_constant(stats, config) or is_intermittent(stats, config))


def is_late_by_own_work(stats: arrivals.ArrivalStats, config: DetectConfig) -> bool:
    """Default arrival rule (module docstring, step 2): the compute bars on own work before arrival."""
    return arrivals.is_arrival_straggler(
        stats, min_samples=config.min_samples, min_excess_share=config.arrival_min_excess_share, min_ratio=config.compute_min_ratio,
        min_consistency=config.compute_min_consistency, min_z=config.compute_min_z,
        min_lateness_ns=config.arrival_min_lateness_ns)


def is_slow_link(stats: p2p.LinkStats, config: DetectConfig) -> bool:
    """Default link rule (see the module docstring, step 3)."""
    return (stats.samples >= config.min_samples and stats.ratio >= config.link_min_ratio
            and stats.excess_ns >= config.link_min_excess_ns and stats.consistency >= config.link_min_consistency)


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detector. Margins are wide on purpose: 8 ranks of a tiny model on a
    2-core CPU showed per-span jitter of 0.1x-10x, fault-free DP replicas 1.22x apart in median
    (>= 1.2x in 3 of 5 iterations) and fault-free p2p links with medians of 0.2-2.1 ms, so
    verdicts rest on medians and on consistency across iterations."""

    compute_min_ratio: float = 1.2  # rank / peer median of pure compute
    compute_min_consistency: float = 0.7  # share of iterations whose median ratio reaches compute_min_ratio
    compute_min_z: float = 3.0  # robust significance of the median log-ratio
    strong_compute_ratio: float = 1.5  # ratio at which the effect size saturates
    intermittent_alpha: float = 0.005  # bound on the chance that a clean run names anybody intermittently slow
    # (noise model: detect_intermittent.py). At 0.02 the model predicts ~1 false alarm in 50 clean runs, and
    # heldout2 had exactly one (p = 0.0067); at 0.005, P(any in 50) <= 22%. 0.002 (<= 9.5%) lost a DDP rank
    # 2x slow in every 3rd iteration (p = 0.0033) on the design runs; 0.005 keeps it
    intermittent_max_share: float = 0.5  # of iterations: slower in more of them is a constant slowdown
    intermittent_min_iterations: int = 2
    intermittent_min_ratio: float = 1.1  # to its peers in the slow iterations: smaller is not worth naming
    intermittent_min_saving: float = 0.001  # of the mean iteration, by the what-if: an intermittent suspect whose
    # fix would save less is noise, not a straggler (the README demo's clean TP2xPP2 run: 1.14x in 4 of 119
    # iterations, p = 0.0021, saving 0.07 of 325 ms = 0.02%; the faintest true ones in simulation save >= 0.4%)
    edge_stage_allowance: float = 1.3  # cross-stage only: first/last stages carry embedding/head/loss work
    # (measured 1.19x on a fault-free 4-stage CPU run), so they need compute_min_ratio x this
    min_samples: int = 4
    cold_idle_ns: int = 3_000_000  # a rank idle this long computes slower for a while (detect_rules: cold span);
    # on the 2-core VM a 1 ms matmul chain is 1.04x after a 1 ms sleep, 1.3x after 5 ms, 1.5x after 45 ms
    cold_recovery_ns: int = 3_000_000  # ... and is back to 1.1x / 1.0x in its 2nd / 3rd ms of work
    link_min_ratio: float = 2.0  # link transfer / peer links' median
    link_min_excess_ns: int = 2_000_000  # and this much slower: CPU p2p medians jitter by ~1-2 ms
    link_min_consistency: float = 0.5  # of messages: a delay hides behind a sender later than it
    link_peer_quantile: float = 0.9  # a slow message must also beat this quantile of peer links' messages
    strong_link_ratio: float = 3.0
    straggler_min_share: float = 0.6  # share of last arrivals that corroborates a slow rank
    arrival_min_excess_share: float = 0.3  # of the waiting at its collectives, the share a rank caused beyond a
    # fair one (1 / members), as a fraction of what lies above a fair share: with own-work evidence, names it; at
    # least 1.5x a fair share too (detect_arrival.py). Needs 0.75 at dp2 and 0.475 at dp4: a flat 0.6 missed an
    # FSDP2 dp4 straggler 1.3x slow per iteration (1.9x its peers' own work in 93% of iterations, 55% of the
    # waiting: FSDP2 meets ~11 times an iteration and only the first meeting sees the data step, so the jitter
    # of the other ten dilutes its share)
    arrival_min_lateness_ns: int = 1_000_000  # median lead of its peers' arrival over its own
    warmup_iterations: int = 1  # iterations with a smaller index are skipped (no explicit range)
    iterations: tuple[int, int] | None = None  # half-open [A, B); None: all, warm-up skipped
    compute_rule: Callable[[rules.ComputeStats, DetectConfig], bool] = is_slow_compute
    link_rule: Callable[[p2p.LinkStats, DetectConfig], bool] = is_slow_link
    arrival_rule: Callable[[arrivals.ArrivalStats, DetectConfig], bool] = is_late_by_own_work

    def __post_init__(self) -> None:
        for name in ("compute_min_ratio", "strong_compute_ratio", "link_min_ratio", "strong_link_ratio",
                     "edge_stage_allowance", "intermittent_min_ratio"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be >= 1.0 (a ratio to the peers' median), got {getattr(self, name)}")
        for name in ("compute_min_consistency", "link_min_consistency", "link_peer_quantile", "straggler_min_share",
                     "intermittent_max_share", "intermittent_min_saving", "arrival_min_excess_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.intermittent_alpha < 0.5:
            raise ValueError(f"intermittent_alpha must be a probability in (0, 0.5), got {self.intermittent_alpha}")
        if (self.min_samples < 1 or self.warmup_iterations < 0 or self.link_min_excess_ns < 0
                or self.cold_idle_ns < 0 or self.cold_recovery_ns < 0):
            raise ValueError("min_samples must be >= 1; warmup_iterations, link_min_excess_ns and cold_* >= 0")
        if self.iterations is not None and self.iterations[1] <= self.iterations[0]:
            raise ValueError(f"iteration range {self.iterations[0]}:{self.iterations[1]} is empty; give A:B with B > A")


@dataclass(frozen=True)
class Suspect:
    """One root-cause candidate. For a slow link, rank is the link's source (convention)."""

    rank: int
    coords: dict
    cause: str  # one of CAUSES
    confidence: float  # 0..1
    evidence: dict  # numbers plus a one-line "summary"
    link: tuple[int, int] | None = None
    iteration_ns: float = 0.0  # median iteration time (critical path); the mean for an intermittent suspect
    what_if_iteration_ns: float = 0.0  # the same, estimated were the suspect as fast as its peers

    @property
    def saving_ns(self) -> float:
        return self.iteration_ns - self.what_if_iteration_ns


@dataclass(frozen=True)
class DetectionReport:
    suspects: tuple[Suspect, ...]  # most likely first
    iterations_analyzed: tuple[int, ...]
    iteration_ns: float  # median iteration time over the analysed iterations
    iteration_mean_ns: float  # their mean (what an intermittent suspect's what-if is compared with)
    what_if_all_fixed_ns: float  # all suspects fixed at once (savings added up)
    world_size: int
    layout: dict
    victims: tuple[tuple[int, float], ...]  # (rank, wait ns per iteration) of non-suspects, when suspects exist
    notes: tuple[str, ...]


def _check_traces(traces: list) -> tuple[dict[int, rules.RankEvents], dict, int]:
    if not traces:
        raise DetectInputError("no traces to analyse")
    first = traces[0]
    events: dict[int, rules.RankEvents] = {}
    for tr in traces:
        for key in ("rank", "world_size", "coords", "layout"):
            if key not in tr.meta:
                raise DetectInputError(f"{tr.path}: trace meta lacks {key!r}")
        if tr.meta["world_size"] != first.meta["world_size"] or tr.meta["layout"] != first.meta["layout"]:
            raise DetectInputError(f"{tr.path}: world size/layout differ from {first.path}: traces of different runs")
        if int(tr.meta["rank"]) in events:
            raise DetectInputError(f"{tr.path}: rank {tr.meta['rank']} appears twice")
        events[int(tr.meta["rank"])] = rules.build_rank_events(tr)
    return events, dict(first.meta["layout"]), int(first.meta["world_size"])


def select_iterations(iteration_spans: dict[int, dict], config: DetectConfig) -> tuple[tuple[int, ...], list[str]]:
    """Iterations complete on every rank, in config.iterations, warm-up skipped (step 0)."""
    common = set.intersection(*(set(s) for s in iteration_spans.values())) if iteration_spans else set()
    notes = []
    if config.iterations is not None:
        a, b = config.iterations
        return tuple(sorted(i for i in common if a <= i < b)), notes
    warm = sorted(i for i in common if i < config.warmup_iterations)
    rest = sorted(i for i in common if i >= config.warmup_iterations)
    if warm and rest:
        notes.append(f"skipped warm-up iteration(s) {warm}")
    return tuple(rest or warm), notes


def _confidence(weight: float, ratio: float, strong: float, consistency: float) -> float:
    effect = min(1.0, max(0.0, (ratio - 1.0) / max(strong - 1.0, 1e-9)))
    return round(float(min(1.0, weight * (0.5 + 0.5 * effect) * consistency)), 3)


def _ms(ns: float) -> float:
    return round(float(ns) / 1e6, 3)


def _compute_evidence(st: rules.ComputeStats, config: DetectConfig) -> tuple[bool, float, str, dict]:
    """(intermittent, ratio, summary, evidence fields) of a slow-compute suspect."""
    peers = {"dp_replicas": "DP replicas", "tp_peers": "TP peers", "pipeline_stages": "other pipeline stages"}
    it = st.intermittent
    if is_constant(st, config) or not is_intermittent(st, config):
        return False, st.ratio, (f"rank {st.rank} forward/backward compute is {st.ratio:.2f}x its {peers[st.basis]} "
                                 f"{list(st.peers)} (median of {st.samples} microbatch samples; slower in "
                                 f"{st.consistency:.0%} of {st.iterations} iterations)"), {"intermittent": False}
    fields = {"intermittent": True, "slow_iterations": list(it.slow_iterations),
              "slow_iteration_ratio": round(it.slow_ratio, 3), "other_iteration_ratio": round(it.base_ratio, 3),
              "intermittent_p": float(f"{it.p_value:.3g}"), "periodic": it.periodic}
    period = f", every {it.slow_iterations[1] - it.slow_iterations[0]}" if it.periodic else ""
    summary = (f"rank {st.rank} forward/backward compute is {it.slow_ratio:.2f}x its {peers[st.basis]} "
               f"{list(st.peers)} in iterations {list(it.slow_iterations)} ({len(it.slow_iterations)} of "
               f"{it.iterations}{period}; {it.base_ratio:.2f}x in the others): intermittent, "
               f"p = {it.p_value:.2g} for a clean run")
    return True, it.slow_ratio, summary, fields


def _compute_suspect(st: rules.ComputeStats, stragglers: dict, coords: dict, config: DetectConfig) -> Suspect:
    strag = stragglers.get(st.rank)
    shares = {fam: round(strag.share(fam), 3) for fam in strag.instances} if strag else {}
    corroborated = any(s >= config.straggler_min_share for s in shares.values())
    intermittent, ratio, summary, fields = _compute_evidence(st, config)
    conf = _confidence(_BASIS_WEIGHT[st.basis], ratio, config.strong_compute_ratio, max(st.consistency, 0.5))
    conf = round(min(1.0, conf + (0.1 if corroborated else 0.0)), 3)
    if corroborated:
        summary += f"; last to arrive at {max(shares.values()):.0%} of its collectives"
    evidence = {"summary": summary, "basis": st.basis, "peers": list(st.peers), "ratio": round(st.ratio, 3),
                **fields, "consistency": round(st.consistency, 3), "sample_share": round(st.sample_share, 3),
                "z": round(min(st.z, 1e6), 2), "samples": st.samples, "iterations": st.iterations,
                "rank_median_ms": _ms(st.rank_median_ns), "peer_median_ms": _ms(st.peer_median_ns),
                "excess_ms_per_iteration": _ms(st.excess_ns_per_iteration), "last_arrival_share": shares}
    return Suspect(st.rank, coords[st.rank], "slow_compute", conf, evidence)


def _arrival_suspects(instances, messages, compute_suspects: list[Suspect], coords: dict,
                      config: DetectConfig) -> list[Suspect]:
    """Ranks named by arrival order (module docstring, step 2) that compute did not name already;
    a compute suspect gets the arrival evidence added to its own."""
    samples = arrivals.compute_arrival_samples(instances, messages)
    stats = arrivals.compare_arrivals(samples, instances, config.compute_min_ratio)
    named = {s.rank: s for s in compute_suspects}
    out = []
    for rank, st in sorted(stats.items()):
        if not config.arrival_rule(st, config):
            continue
        summary, fields = arrivals.describe_arrivals(st)
        if rank in named:
            s = named[rank]
            s.evidence.update({k: v for k, v in fields.items() if k != "last_arrival_share"})
            continue
        conf = _confidence(_BASIS_WEIGHT["dp_replicas"], st.ratio, config.strong_compute_ratio, st.consistency)
        evidence = {"summary": summary, "basis": "arrival_order", "peers": [], "ratio": round(st.ratio, 3),
                    "intermittent": False, "consistency": round(st.consistency, 3), "z": round(min(st.z, 1e6), 2),
                    "samples": st.samples, "iterations": st.iterations,
                    "excess_ms_per_iteration": _ms(st.excess_ns_per_iteration), **fields}
        out.append(Suspect(rank, coords[rank], "slow_compute", conf, evidence))
    named.update({s.rank: s for s in out})
    return out + _own_work_intermittent_suspects(samples, named, coords, config)


def _own_work_intermittent_suspects(samples, named: dict, coords: dict, config: DetectConfig) -> list[Suspect]:
    """Ranks not named yet whose own work before arrivals is inflated in a few iterations
    (detect_intermittent_arrival.py): a CPU taken away now and then, outside the compute spans."""
    out = []
    for rank, it in sorted(own_intermittent.compare_own_work_intermittent(
            samples, config.intermittent_min_iterations, config.intermittent_max_share).items()):
        stats = rules.ComputeStats(rank, "arrival_order", (), it.iterations, it.iterations, 1.0, 0.0, 0.0, 0.0,
                                   0.0, 0.0, 0.0, False, it)
        if rank in named or not is_intermittent(stats, config):
            continue
        excess = own_intermittent.compute_slow_iteration_excess(samples, rank, it.slow_iterations)
        summary = (f"rank {rank}'s own work before its collectives (waits subtracted) is {it.slow_ratio:.2f}x "
                   f"its peers' in iterations {list(it.slow_iterations)} ({len(it.slow_iterations)} of "
                   f"{it.iterations}; {it.base_ratio:.2f}x in the others): intermittent, p = {it.p_value:.2g} "
                   f"for a clean run; its compute spans do not show it (frozen between or around them)")
        evidence = {"summary": summary, "basis": "arrival_order", "peers": [], "ratio": round(it.slow_ratio, 3),
                    "intermittent": True, "slow_iterations": list(it.slow_iterations),
                    "slow_iteration_ratio": round(it.slow_ratio, 3), "other_iteration_ratio": round(it.base_ratio, 3),
                    "intermittent_p": float(f"{it.p_value:.3g}"), "periodic": it.periodic,
                    "iterations": it.iterations, "slow_iteration_excess_ms": {i: _ms(v) for i, v in excess.items()}}
        conf = _confidence(_BASIS_WEIGHT["dp_replicas"], it.slow_ratio, config.strong_compute_ratio, 0.5)
        out.append(Suspect(rank, coords[rank], "slow_compute", conf, evidence))
    return out


def _judge_links(messages, coords: dict, config: DetectConfig) -> dict[tuple, p2p.LinkStats]:
    """Per link, its stats over the messages whose time is the link's own (p2p.select_timed_messages)
    if they pass the link rule, else over all of its messages: a real rate limit shows in the former,
    a delay added at the receiver after arrival (the in-process injector) only in the latter."""
    views = [p2p.compare_links(messages, coords, config.link_min_ratio, config.link_min_excess_ns,
                                 config.link_peer_quantile, timed_only=timed) for timed in (True, False)]
    return {link: st if config.link_rule(st, config) or link not in views[1] else views[1][link]
            for link, st in views[0].items()}


def _link_suspect(st: p2p.LinkStats, coords: dict, config: DetectConfig) -> Suspect:
    conf = _confidence(_LINK_WEIGHT, st.ratio, config.strong_link_ratio, st.consistency)
    summary = (f"link {st.src}->{st.dst} takes {_ms(st.median_ns)} ms per message vs {_ms(st.peer_median_ns)} ms "
               f"on {st.peer_links} comparable links ({st.ratio:.1f}x) in {st.consistency:.0%} of {st.samples} "
               f"messages; rank {st.src} is the link's source (convention), its compute is not implicated")
    evidence = {"summary": summary, "transfer_median_ms": _ms(st.median_ns), "peer_median_ms": _ms(st.peer_median_ns),
                "ratio": round(st.ratio, 3), "excess_ms": _ms(st.excess_ns), "consistency": round(st.consistency, 3),
                "samples": st.samples, "peer_links": st.peer_links,
                "excess_ms_per_iteration": _ms(st.excess_ns_per_iteration)}
    return Suspect(st.src, coords.get(st.src, {}), "slow_link", conf, evidence, link=(st.src, st.dst))


def _with_what_if(s: Suspect, crit: list[paths.CriticalPath], busy: list[dict], spans: dict, links: dict) -> Suspect:
    """`s` with its iteration time and the estimate were it fixed: medians over the iterations,
    or means for an intermittent suspect (slow in a few iterations only: the median iteration
    is an unaffected one, so it would hide the cost), whose saving counts only where it was slow."""
    if not crit:
        return s
    intermittent = s.evidence.get("intermittent", False)
    if s.evidence.get("basis") == "arrival_order" and intermittent:  # only its slow iterations cost
        excess = s.evidence["slow_iteration_excess_ms"]
        savings = [excess.get(p.iteration, 0.0) * 1e6 for p in crit]
        floors = [max((v for r, v in b.items() if r != s.rank), default=0) for b in busy]
    elif s.evidence.get("basis") in ("arrival_order", "incoming_links"):  # its excess lies outside its spans
        savings = [s.evidence["excess_ms_per_iteration"] * 1e6] * len(crit)
        floors = [max((v for r, v in b.items() if r != s.rank), default=0) for b in busy]
    elif s.cause == "slow_compute":
        ratio = s.evidence["slow_iteration_ratio"] if intermittent else s.evidence["ratio"]
        slow = set(s.evidence["slow_iterations"]) if intermittent else None
        savings = [paths.estimate_compute_saving(p, s.rank, spans.get(s.rank, []), ratio)
                   if slow is None or p.iteration in slow else 0.0 for p in crit]
        floors = [max((v for r, v in b.items() if r != s.rank), default=0) for b in busy]
    else:
        savings = [paths.estimate_link_saving(p, s.link, links[s.link].peer_median_ns) for p in crit]
        floors = [max(b.values(), default=0) for b in busy]
    average = np.mean if intermittent else np.median
    t = float(average([p.duration_ns for p in crit]))
    what_if = float(average([min(p.duration_ns, max(p.duration_ns - v, f)) for p, v, f in zip(crit, savings, floors)]))
    return Suspect(s.rank, s.coords, s.cause, s.confidence, s.evidence, s.link, t, min(what_if, t))


def _victims(instances, messages, n_iterations: int, iteration_ns: float, exclude: set) -> tuple:
    wait = defaultdict(float)
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            wait[r] += inst.last_start - start
    for m in messages:
        wait[m.dst] += max(0, m.send_start - m.wait_start)
    per_it = {r: w / max(n_iterations, 1) for r, w in wait.items() if r not in exclude}
    keep = [(r, round(w, 1)) for r, w in per_it.items() if w >= _VICTIM_MIN_SHARE * iteration_ns]
    return tuple(sorted(keep, key=lambda x: -x[1]))


def _coverage_notes(layout: dict, world: int, events: dict, basis: str, instances, messages) -> list[str]:
    notes = []
    missing = sorted(set(range(world)) - set(events))
    if missing:
        notes.append(f"no trace for ranks {missing}: they cannot be judged and their peers have fewer references")
    if basis == "pipeline_stages":
        notes.append("no DP replicas or TP peers: compute compared across pipeline stages (weak evidence)")
    elif basis == "none":
        notes.append("a single rank: no peers to compare compute against")
    if layout.get("tp_size", 1) > 1 and not any(i.family == "tp" for i in instances):
        notes.append("tp_size > 1 but no TP collectives traced: TP peers of a slow rank will look slow too")
    if layout.get("pp_size", 1) > 1 and not messages:
        notes.append("no matched send/recv pairs: slow links cannot be detected")
    return notes


def _judge_compute(spans: dict, peers: dict, basis: str, pp_size: int, coords: dict, slow_its: dict,
                   config: DetectConfig) -> dict[int, rules.ComputeStats]:
    """Per rank, its compute against the peers' warm spans if that comparison passes the compute
    rule, else against all of their spans (detect_rules: cold span)."""
    judged = {ref: {r: replace(st, intermittent=slow_its.get(r)) for r, st in
                    rules.compare_compute(spans, peers, basis, pp_size, coords, config.compute_min_ratio, ref).items()}
              for ref in ("warm", "all")}
    out = {}
    for rank in sorted(judged["warm"].keys() | judged["all"].keys()):
        warm, everything = judged["warm"].get(rank), judged["all"].get(rank)
        out[rank] = warm if warm is not None and (everything is None or config.compute_rule(warm, config)) else everything
    return out


def _cold_notes(spans: dict, compute: dict, config: DetectConfig) -> list[str]:
    """Ranks left with too few warm spans to be judged for a constant slowdown (detect_rules:
    cold span), e.g. a slow link's receiver."""
    notes = []
    for rank, rank_spans in sorted(spans.items()):
        cold = sum(s.cold for s in rank_spans)
        judged = compute[rank].samples if rank in compute else 0
        if cold and judged < config.min_samples:
            notes.append(f"rank {rank}: {cold} of {len(rank_spans)} compute spans start within "
                         f"{_ms(config.cold_recovery_ns)} ms of a wait >= {_ms(config.cold_idle_ns)} ms, "
                         f"so its constant slowness is not judged (work after a long wait runs slower)")
    return notes


def _negligible_note(s: Suspect) -> str:
    ev = s.evidence
    return (f"rank {s.rank} is {ev['slow_iteration_ratio']}x its peers in {len(ev['slow_iterations'])} of "
            f"{ev['iterations']} iterations, but fixing it would save {_ms(s.saving_ns)} of {_ms(s.iteration_ns)} "
            f"ms per iteration ({s.saving_ns / max(s.iteration_ns, 1):.2%}): not named")


def detect(traces: list, *, config: DetectConfig = DetectConfig()) -> DetectionReport:
    """Root-cause suspects of slowness in aligned per-rank traces (algorithm: module docstring).

    Raises DetectInputError when the traces do not belong together or no iteration is
    complete on every rank."""
    events, layout, world = _check_traces(traces)
    iter_spans = {r: rules.compute_iteration_spans(ev) for r, ev in events.items()}
    iterations, notes = select_iterations(iter_spans, config)
    if not iterations:
        held = sorted(set().union(*(set(s) for s in iter_spans.values())))
        wanted = "" if config.iterations is None else f" in [{config.iterations[0]}, {config.iterations[1]})"
        where = os.path.dirname(str(traces[0].path)) or str(traces[0].path)
        raise DetectInputError(f"{where}: no iteration{wanted} is complete on all {len(events)} ranks "
                               f"(iterations present on some rank: {held[:10]}); nothing to analyse")
    its = set(iterations)
    coords = {r: ev.coords for r, ev in events.items()}
    spans = {r: rules.compute_pure_spans(ev, its, config.cold_idle_ns, config.cold_recovery_ns)
             for r, ev in events.items()}
    basis, peers = rules.build_compute_peers(coords, layout)
    slow_its = compare_intermittent(spans, peers, config.intermittent_min_iterations, config.intermittent_max_share)
    compute = _judge_compute(spans, peers, basis, layout.get("pp_size", 1), coords, slow_its, config)
    index = index_comm_events(traces)
    instances = rules.collect_collectives(index, events, its)
    stragglers = rules.compute_straggler_stats(instances)
    messages = p2p.collect_p2p_messages(index, events, its)
    links = _judge_links(messages, coords, config)
    suspects = [_compute_suspect(st, stragglers, coords, config) for st in compute.values()
                if config.compute_rule(st, config)]
    suspects += _arrival_suspects(instances, messages, suspects, coords, config)
    suspects += [_link_suspect(st, coords, config) for st in links.values() if config.link_rule(st, config)]
    crit = [paths.compute_critical_path(i, {r: s[i] for r, s in iter_spans.items()},
                                        paths.build_blocking_events(i, messages, instances)) for i in iterations]
    busy = [paths.compute_busy_ns(i, {r: s[i] for r, s in iter_spans.items()}, messages, instances)
            for i in iterations]
    incoming = defaultdict(set)
    for m in messages:
        incoming[m.dst].add(m.src)
    suspects, echoes = drop_echoes(suspects, layout.get("tp_size", 1), coords, incoming)
    notes += echoes
    suspects = [_with_what_if(s, crit, busy, spans, links) for s in suspects]
    negligible = [s for s in suspects if s.evidence.get("intermittent")
                  and s.saving_ns < config.intermittent_min_saving * s.iteration_ns]
    suspects = [s for s in suspects if s not in negligible]
    notes += [_negligible_note(s) for s in negligible]
    suspects.sort(key=lambda s: (-s.confidence, -s.saving_ns, s.rank))
    durations = [p.duration_ns for p in crit]
    t = float(np.median(durations))
    fixed = t - sum(max(0.0, s.saving_ns) for s in suspects)
    # Pipeline bubbles make every clean run "wait": victims only mean something next to a culprit.
    victims = _victims(instances, messages, len(iterations), t, {s.rank for s in suspects}) if suspects else ()
    notes += _coverage_notes(layout, world, events, basis, instances, messages) + _cold_notes(spans, compute, config)
    return DetectionReport(tuple(suspects), iterations, t, float(np.mean(durations)), max(fixed, 0.0), world, layout, victims, tuple(notes))


# -- output ----------------------------------------------------------------------------------


def report_to_json(report: DetectionReport) -> dict:
    """JSON-ready dict: suspects (most likely first), iterations_analyzed, what_if, victims, notes."""
    suspects = [{"rank": s.rank, "coords": dict(s.coords), "cause": s.cause,
                 "link": list(s.link) if s.link else None, "confidence": s.confidence,
                 "evidence": dict(s.evidence),
                 "what_if": {"iteration_ms": _ms(s.iteration_ns), "iteration_if_fixed_ms": _ms(s.what_if_iteration_ns),
                             "saving_ms": _ms(s.saving_ns),
                             "over_iterations": "mean" if s.evidence.get("intermittent") else "median"}}
                for s in report.suspects]
    return {
        "suspects": suspects,
        "iterations_analyzed": list(report.iterations_analyzed),
        "what_if": {"iteration_ms": _ms(report.iteration_ns), "iteration_mean_ms": _ms(report.iteration_mean_ns),
                    "iteration_if_all_fixed_ms": _ms(report.what_if_all_fixed_ns)},
        "victims": [{"rank": r, "wait_ms_per_iteration": _ms(w)} for r, w in report.victims],
        "world_size": report.world_size,
        "layout": dict(report.layout),
        "notes": list(report.notes),
    }


def render_report(report: DetectionReport, width: int | None = None) -> str:
    """The report as terminal text (a rich table of suspects, then victims and notes).

    `width` defaults to the terminal's (80 when not a terminal), so printing the text
    through another rich console does not re-wrap it."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=False)
    lay = report.layout
    its = report.iterations_analyzed
    console.print(f"MegaScan detect: {report.world_size} ranks (TP={lay.get('tp_size')} PP={lay.get('pp_size')} "
                  f"DP={lay.get('dp_size')}), iterations {its[0]}..{its[-1]} ({len(its)}), "
                  f"iteration time {_ms(report.iteration_ns)} ms", markup=False)
    if not report.suspects:
        console.print("No slow rank or slow link found.")
    else:
        table = Table(show_lines=False)
        for col in ("#", "rank", "tp,dp,pp", "cause", "confidence", "iteration if fixed"):
            table.add_column(col, no_wrap=True)
        for i, s in enumerate(report.suspects, 1):
            c = s.coords
            cause = f"slow_link {s.link[0]}->{s.link[1]}" if s.link else s.cause
            table.add_row(str(i), str(s.rank), f"{c.get('tp')},{c.get('dp')},{c.get('pp')}", cause,
                          f"{s.confidence:.2f}", f"{_ms(s.what_if_iteration_ns)} ms (-{_ms(s.saving_ns)})")
        console.print(table)
        for i, s in enumerate(report.suspects, 1):  # evidence below the table: it is a sentence
            console.print(f"#{i}: {s.evidence['summary']}", markup=False)
        if report.victims:
            console.print("Waiting on them (victims, ms/iteration): "
                          + ", ".join(f"rank {r} {_ms(w)}" for r, w in report.victims), markup=False)
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    return console.export_text()
