"""The numbers behind `trace report` (report.py draws them): pure, analysis in, numbers out.

Per rank and analysed iteration: step time, split into waiting (in collectives before their last
member arrived, and in receives before the message arrived) and own work (the rest). Per
directed p2p link: effective bandwidth (bytes over transfer time of the messages the receiver was
already waiting for). Per rank: arrival-order statistics (detect_arrival.py). Plus the verdict,
the thresholds it was judged with, and the clock alignment.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields

import numpy as np

from megatronapp.scan.analyze import detect_arrival as arrivals
from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.analyze.budget_summary import BudgetSummary, compute_budget_summary
from megatronapp.scan.analyze.detect_config import DetectConfig
from megatronapp.scan.analyze.detect_output import report_to_json
from megatronapp.scan.analyze.load_align_detect import TraceAnalysis
from megatronapp.scan.merge.matching import index_comm_events


@dataclass(frozen=True)
class LinkBandwidth:
    src: int
    dst: int
    messages: int
    median_bytes: float
    mbit_s: float  # median effective bandwidth
    transfer_ms: float  # median transfer time


@dataclass(frozen=True)
class ReportData:
    iterations: tuple[int, ...]
    ranks: tuple[int, ...]
    step_ms: dict[int, dict[int, float]]  # rank -> iteration -> step time
    wait_ms: dict[int, dict[int, float]]  # rank -> iteration -> time waiting on others
    links: tuple[LinkBandwidth, ...]
    arrivals: dict[int, arrivals.ArrivalStats]
    verdict: dict  # detect.report_to_json
    thresholds: dict  # the DetectConfig numbers the verdict used
    alignment: dict
    budget: BudgetSummary | None = None  # budget_summary.py: each rank's time budget and each link's


def describe_layout(layout: dict, world: int) -> str:
    """'TP1 x PP2 x DP2 (4 ranks)'."""
    return (
        f"TP{layout.get('tp_size', 1)} \u00d7 PP{layout.get('pp_size', 1)} \u00d7 DP{layout.get('dp_size', 1)} "
        f"({world} ranks)"
    )


def format_duration_ns(ns: float | None) -> str:
    """A duration as people read it: '1.23 ms', '45.6 us' or '789 ns'."""
    if ns is None:
        return "n/a"
    if abs(ns) >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e3:.1f} \u00b5s" if abs(ns) >= 1e3 else f"{ns:.0f} ns"


def _waits(instances, messages, its: set[int]) -> dict[int, dict[int, float]]:
    wait: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            wait[r][inst.iteration] += max(0, inst.last_start - start) / 1e6
    for m in messages:
        if m.iteration in its:
            wait[m.dst][m.iteration] += max(0, m.recv_end - m.wait_start) / 1e6
    return wait


def compute_link_bandwidth(messages: list[p2p.P2PMessage]) -> tuple[LinkBandwidth, ...]:
    """Per directed link, the median effective bandwidth of its timed messages."""
    out = []
    for (src, dst), ms in sorted(p2p.select_timed_messages(messages).items()):
        transfers = np.array([max(m.transfer_ns, 1) for m in ms], dtype=float)
        sizes = np.array([m.bytes for m in ms], dtype=float)
        out.append(
            LinkBandwidth(
                src,
                dst,
                len(ms),
                float(np.median(sizes)),
                float(np.median(sizes * 8 / transfers * 1e3)),
                float(np.median(transfers)) / 1e6,
            )
        )
    return tuple(out)


def compute_report_data(analysis: TraceAnalysis, config: DetectConfig = DetectConfig()) -> ReportData:
    """Everything the page shows (module docstring)."""
    events = {t.rank: rules.build_rank_events(t) for t in analysis.traces}
    its = analysis.detection.iterations_analyzed
    step = {
        r: {i: (e - s) / 1e6 for i, (s, e) in rules.compute_iteration_spans(ev).items() if i in its}
        for r, ev in events.items()
    }
    index = index_comm_events(analysis.traces)
    instances = rules.collect_collectives(index, events, set(its))
    messages = p2p.collect_p2p_messages(index, events, set(its))
    wait = _waits(instances, messages, set(its))
    arrival = arrivals.compare_arrivals(
        arrivals.compute_arrival_samples(instances, messages), instances, config.compute_min_ratio
    )
    thresholds = {
        f.name: getattr(config, f.name) for f in fields(config) if isinstance(getattr(config, f.name), (int, float))
    }
    return ReportData(
        tuple(its),
        tuple(sorted(events)),
        step,
        {
            r: {i: min(w.get(i, 0.0), step[r].get(i, 0.0)) for i in its}
            for r, w in ((r, wait.get(r, {})) for r in events)
        },
        compute_link_bandwidth(messages),
        arrival,
        report_to_json(analysis.detection),
        thresholds,
        analysis.alignment.to_dict(),
        compute_budget_summary(analysis.traces, tuple(its)),
    )
