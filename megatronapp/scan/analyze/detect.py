"""MegaScan slow-node / slow-link detection: name the root cause, not the victims.

A slow rank makes everybody around it wait: pipeline neighbours in recv, TP peers inside
their TP all-reduces, DP replicas in grad_reduce. Waiting is therefore never evidence
against a rank; only its *own* work is. Algorithm of `detect` (pure, over aligned traces;
thresholds and verdict rules in detect_config.py, the report as text or JSON in detect_output.py):

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
     from each iteration's critical path; every link gets one, named or not (for the probe).
  After `detect`, load_align_detect applies the link probe's verdicts (link_probe_verdicts.py),
  the slow ranks the time budget measures (measured_ranks.py) and the impact gate (impact_gate.py).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import replace

import numpy as np

from megatronapp.scan.analyze import detect_arrival as arrivals
from megatronapp.scan.analyze import detect_intermittent_arrival as own_intermittent
from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_path as paths
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.analyze.detect_config import (
    DetectConfig,
    DetectInputError,
    DetectionReport,
    Suspect,
    is_constant,
    is_intermittent,
)
from megatronapp.scan.analyze.detect_intermittent import compare_intermittent
from megatronapp.scan.analyze.detect_notes import cold_notes, compute_victims, coverage_notes, negligible_note
from megatronapp.scan.analyze.detect_rules import to_ms
from megatronapp.scan.analyze.verdict_filters import drop_echoes, root_causes_first
from megatronapp.scan.merge.matching import index_comm_events

_BASIS_WEIGHT = {"dp_replicas": 1.0, "tp_peers": 0.9, "pipeline_stages": 0.6}
_LINK_WEIGHT = 0.9


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


def _intermittent_fields(it) -> dict:
    """The evidence fields of an intermittent slowdown (detect_intermittent.IntermittentStats)."""
    return {
        "intermittent": True,
        "slow_iterations": list(it.slow_iterations),
        "slow_iteration_ratio": round(it.slow_ratio, 3),
        "other_iteration_ratio": round(it.base_ratio, 3),
        "intermittent_p": float(f"{it.p_value:.3g}"),
        "periodic": it.periodic,
    }


def _compute_evidence(st: rules.ComputeStats, config: DetectConfig) -> tuple[bool, float, str, dict]:
    """(intermittent, ratio, summary, evidence fields) of a slow-compute suspect."""
    peers = {"dp_replicas": "DP replicas", "tp_peers": "TP peers", "pipeline_stages": "other pipeline stages"}
    it = st.intermittent
    if is_constant(st, config) or not is_intermittent(st, config):
        return (
            False,
            st.ratio,
            (
                f"rank {st.rank} forward/backward compute is {st.ratio:.2f}x its {peers[st.basis]} "
                f"{list(st.peers)} (median of {st.samples} microbatch samples; slower in "
                f"{st.consistency:.0%} of {st.iterations} iterations)"
            ),
            {"intermittent": False},
        )
    fields = _intermittent_fields(it)
    period = f", every {it.slow_iterations[1] - it.slow_iterations[0]}" if it.periodic else ""
    summary = (
        f"rank {st.rank} forward/backward compute is {it.slow_ratio:.2f}x its {peers[st.basis]} "
        f"{list(st.peers)} in iterations {list(it.slow_iterations)} ({len(it.slow_iterations)} of "
        f"{it.iterations}{period}; {it.base_ratio:.2f}x in the others): intermittent, "
        f"p = {it.p_value:.2g} for a clean run"
    )
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
    evidence = {
        "summary": summary,
        "basis": st.basis,
        "peers": list(st.peers),
        "ratio": round(st.ratio, 3),
        **fields,
        "consistency": round(st.consistency, 3),
        "sample_share": round(st.sample_share, 3),
        "z": round(min(st.z, 1e6), 2),
        "samples": st.samples,
        "iterations": st.iterations,
        "rank_median_ms": to_ms(st.rank_median_ns),
        "peer_median_ms": to_ms(st.peer_median_ns),
        "excess_ms_per_iteration": to_ms(st.excess_ns_per_iteration),
        "last_arrival_share": shares,
    }
    return Suspect(st.rank, coords[st.rank], "slow_compute", conf, evidence)


def _arrival_suspects(
    instances, messages, compute_suspects: list[Suspect], coords: dict, config: DetectConfig
) -> list[Suspect]:
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
        evidence = {
            "summary": summary,
            "basis": "arrival_order",
            "peers": [],
            "ratio": round(st.ratio, 3),
            "intermittent": False,
            "consistency": round(st.consistency, 3),
            "z": round(min(st.z, 1e6), 2),
            "samples": st.samples,
            "iterations": st.iterations,
            "excess_ms_per_iteration": to_ms(st.excess_ns_per_iteration),
            **fields,
        }
        out.append(Suspect(rank, coords[rank], "slow_compute", conf, evidence))
    named.update({s.rank: s for s in out})
    return out + _own_work_intermittent_suspects(samples, named, coords, config)


def _own_work_intermittent_suspects(samples, named: dict, coords: dict, config: DetectConfig) -> list[Suspect]:
    """Ranks not named yet whose own work before arrivals is inflated in a few iterations
    (detect_intermittent_arrival.py): a CPU taken away now and then, outside the compute spans."""
    out = []
    for rank, it in sorted(
        own_intermittent.compare_own_work_intermittent(
            samples, config.intermittent_min_iterations, config.intermittent_max_share
        ).items()
    ):
        stats = rules.ComputeStats(
            rank, "arrival_order", (), it.iterations, it.iterations, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False, it
        )
        if rank in named or not is_intermittent(stats, config):
            continue
        excess = own_intermittent.compute_slow_iteration_excess(samples, rank, it.slow_iterations)
        summary = (
            f"rank {rank}'s own work before its collectives (waits subtracted) is {it.slow_ratio:.2f}x "
            f"its peers' in iterations {list(it.slow_iterations)} ({len(it.slow_iterations)} of "
            f"{it.iterations}; {it.base_ratio:.2f}x in the others): intermittent, p = {it.p_value:.2g} "
            f"for a clean run; its compute spans do not show it (frozen between or around them)"
        )
        evidence = {
            "summary": summary,
            "basis": "arrival_order",
            "peers": [],
            "ratio": round(it.slow_ratio, 3),
            **_intermittent_fields(it),
            "iterations": it.iterations,
            "slow_iteration_excess_ms": {i: to_ms(v) for i, v in excess.items()},
        }
        conf = _confidence(_BASIS_WEIGHT["dp_replicas"], it.slow_ratio, config.strong_compute_ratio, 0.5)
        out.append(Suspect(rank, coords[rank], "slow_compute", conf, evidence))
    return out


def _judge_links(messages, coords: dict, config: DetectConfig) -> dict[tuple, p2p.LinkStats]:
    """Per link, its stats over the messages whose time is the link's own (p2p.select_timed_messages)
    if they pass the link rule, else over all of its messages: a real rate limit shows in the former,
    a delay added at the receiver after arrival (the in-process injector) only in the latter."""
    views = [
        p2p.compare_links(
            messages,
            coords,
            config.link_min_ratio,
            config.link_min_excess_ns,
            config.link_peer_quantile,
            timed_only=timed,
        )
        for timed in (True, False)
    ]
    return {
        link: st if config.link_rule(st, config) or link not in views[1] else views[1][link]
        for link, st in views[0].items()
    }


def _link_suspect(st: p2p.LinkStats, coords: dict, config: DetectConfig) -> Suspect:
    conf = _confidence(_LINK_WEIGHT, st.ratio, config.strong_link_ratio, st.consistency)
    summary = (
        f"link {st.src}->{st.dst} takes {to_ms(st.median_ns)} ms per message vs {to_ms(st.peer_median_ns)} ms "
        f"on {st.peer_links} comparable links ({st.ratio:.1f}x) in {st.consistency:.0%} of {st.samples} "
        f"messages; rank {st.src} is the link's source (convention), its compute is not implicated"
    )
    evidence = {
        "summary": summary,
        "transfer_median_ms": to_ms(st.median_ns),
        "peer_median_ms": to_ms(st.peer_median_ns),
        "ratio": round(st.ratio, 3),
        "excess_ms": to_ms(st.excess_ns),
        "consistency": round(st.consistency, 3),
        "samples": st.samples,
        "peer_links": st.peer_links,
        "excess_ms_per_iteration": to_ms(st.excess_ns_per_iteration),
    }
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
        savings = [
            paths.estimate_compute_saving(p, s.rank, spans.get(s.rank, []), ratio)
            if slow is None or p.iteration in slow
            else 0.0
            for p in crit
        ]
        if not intermittent and max(s.evidence.get("last_arrival_share", {}).values(), default=0.0) >= 0.5:
            # its peers wait for it at most of its collectives, so its own excess is on the iteration's
            # critical path even where the extracted path runs through a peer that waited for it
            savings = [max(v, s.evidence.get("excess_ms_per_iteration", 0.0) * 1e6) for v in savings]
        floors = [max((v for r, v in b.items() if r != s.rank), default=0) for b in busy]
    else:
        savings = [paths.estimate_link_saving(p, s.link, links[s.link].peer_median_ns) for p in crit]
        floors = [max(b.values(), default=0) for b in busy]
    average = np.mean if intermittent else np.median
    t = float(average([p.duration_ns for p in crit]))
    what_if = float(average([min(p.duration_ns, max(p.duration_ns - v, f)) for p, v, f in zip(crit, savings, floors)]))
    return Suspect(s.rank, s.coords, s.cause, s.confidence, s.evidence, s.link, t, min(what_if, t))


def _judge_compute(
    spans: dict, peers: dict, basis: str, pp_size: int, coords: dict, slow_its: dict, config: DetectConfig
) -> dict[int, rules.ComputeStats]:
    """Per rank, its compute against the peers' warm spans if that comparison passes the compute
    rule, else against all of their spans (detect_rules: cold span)."""
    judged = {
        ref: {
            r: replace(st, intermittent=slow_its.get(r))
            for r, st in rules.compare_compute(
                spans, peers, basis, pp_size, coords, config.compute_min_ratio, ref
            ).items()
        }
        for ref in ("warm", "all")
    }
    out = {}
    for rank in sorted(judged["warm"].keys() | judged["all"].keys()):
        warm, everything = judged["warm"].get(rank), judged["all"].get(rank)
        out[rank] = (
            warm if warm is not None and (everything is None or config.compute_rule(warm, config)) else everything
        )
    return out


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
        raise DetectInputError(
            f"{where}: no iteration{wanted} is complete on all {len(events)} ranks "
            f"(iterations present on some rank: {held[:10]}); nothing to analyse"
        )
    its = set(iterations)
    coords = {r: ev.coords for r, ev in events.items()}
    spans = {
        r: rules.compute_pure_spans(ev, its, config.cold_idle_ns, config.cold_recovery_ns) for r, ev in events.items()
    }
    basis, peers = rules.build_compute_peers(coords, layout)
    slow_its = compare_intermittent(spans, peers, config.intermittent_min_iterations, config.intermittent_max_share)
    compute = _judge_compute(spans, peers, basis, layout.get("pp_size", 1), coords, slow_its, config)
    index = index_comm_events(traces)
    instances = rules.collect_collectives(index, events, its)
    stragglers = rules.compute_straggler_stats(instances)
    messages = p2p.collect_p2p_messages(index, events, its)
    links = _judge_links(messages, coords, config)
    suspects = [
        _compute_suspect(st, stragglers, coords, config) for st in compute.values() if config.compute_rule(st, config)
    ]
    suspects += _arrival_suspects(instances, messages, suspects, coords, config)
    suspects += [_link_suspect(st, coords, config) for st in links.values() if config.link_rule(st, config)]
    crit = [
        paths.compute_critical_path(
            i, {r: s[i] for r, s in iter_spans.items()}, paths.build_blocking_events(i, messages, instances)
        )
        for i in iterations
    ]
    busy = [paths.compute_busy_ns(i, {r: s[i] for r, s in iter_spans.items()}, messages, instances) for i in iterations]
    incoming = defaultdict(set)
    for m in messages:
        incoming[m.dst].add(m.src)
    suspects, echoes = drop_echoes(suspects, layout.get("tp_size", 1), coords, incoming)
    notes += echoes
    suspects = [_with_what_if(s, crit, busy, spans, links) for s in suspects]
    link_costs = tuple(
        _with_what_if(_link_suspect(st, coords, config), crit, busy, spans, links) for st in links.values()
    )
    negligible = [
        s
        for s in suspects
        if s.evidence.get("intermittent") and s.saving_ns < config.intermittent_min_saving * s.iteration_ns
    ]
    suspects = [s for s in suspects if s not in negligible]
    notes += [negligible_note(s) for s in negligible]
    suspects = root_causes_first(suspects)
    durations = [p.duration_ns for p in crit]
    t = float(np.median(durations))
    fixed = t - sum(max(0.0, s.saving_ns) for s in suspects)
    # Pipeline bubbles make every clean run "wait": victims only mean something next to a culprit.
    victims = compute_victims(instances, messages, len(iterations), t, {s.rank for s in suspects}) if suspects else ()
    notes += coverage_notes(layout, world, events, basis, instances, messages) + cold_notes(spans, compute, config)
    return DetectionReport(
        tuple(suspects),
        iterations,
        t,
        float(np.mean(durations)),
        max(fixed, 0.0),
        world,
        layout,
        victims,
        tuple(notes),
        link_candidates=link_costs,
    )
