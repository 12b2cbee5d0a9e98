"""Load -> align -> detect: the one analysis pipeline over a trace directory.

The `trace detect` CLI, the end-of-run report of `megatronapp train --trace` / `trace run`,
`trace whatif`, `trace report` and the evaluation harness all call `analyze_trace_dir` (or, to
detect several times with different thresholds, `load_aligned_traces` then `analyze_aligned`), so
they judge exactly the same events the same way. The online detector (detect_online.py) sees no
trace, only per-iteration compute times, and judges them with the same peers and ratio
(detect_rules.build_compute_peers, detect_rules.peer_median_ratio).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from megatronapp.scan.analyze.budget_summary import BudgetSummary, compute_budget_summary
from megatronapp.scan.analyze.detect import detect
from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport
from megatronapp.scan.analyze.impact_gate import apply_impact_gate
from megatronapp.scan.analyze.iteration_keys import align_iterations
from megatronapp.scan.analyze.link_probe_verdicts import apply_link_probe
from megatronapp.scan.analyze.measured_ranks import add_measured_ranks
from megatronapp.scan.analyze.verdict_filters import drop_link_receiver_echoes, drop_measured_tp_echoes
from megatronapp.scan.merge.align import AlignmentReport, align_traces
from megatronapp.scan.probe_config import ProbeResult, load_probe
from megatronapp.scan.record.format import RankTrace, load_trace_dir


@dataclass(frozen=True)
class TraceAnalysis:
    """Aligned traces of one run, how they were aligned, and what detection found."""

    traces: list[RankTrace]
    alignment: AlignmentReport
    detection: DetectionReport
    budget: BudgetSummary | None = None  # of the analysed iterations; None when there were none


def analyze_traces(traces: list[RankTrace], config: DetectConfig = DetectConfig()) -> TraceAnalysis:
    """Align already loaded traces and run detection on them."""
    aligned, alignment = align_traces(traces)
    return analyze_aligned(aligned, alignment, config)


def analyze_aligned(
    aligned: list[RankTrace],
    alignment: AlignmentReport,
    config: DetectConfig = DetectConfig(),
    probe: ProbeResult | None = None,
) -> TraceAnalysis:
    """Detection on traces align_traces already put on one timeline, their iterations first joined
    by the collectives and messages they share (iteration_keys.py); then the link probe's verdicts
    (`probe`: the run's probe.json, None without one), the late receivers of named slow links
    dropped as their echoes (verdict_filters.py), the slow ranks the time budget measures
    (measured_ranks.py), TP peers of a measured slow rank that are not measured slow dropped as
    its victims (verdict_filters.py) and the impact gate."""
    keyed, iterations = align_iterations(aligned)
    detection = detect(keyed, config=config)
    detection = dataclasses.replace(
        detection, notes=(*iterations.notes, *detection.notes), unjoined_ranks=iterations.unjoined
    )
    its = detection.iterations_analyzed
    budget = compute_budget_summary(keyed, its) if its else None
    detection = apply_link_probe(detection, probe, config)
    suspects, echoes = drop_link_receiver_echoes(list(detection.suspects))
    detection = dataclasses.replace(detection, suspects=tuple(suspects), notes=(*detection.notes, *echoes))
    detection = add_measured_ranks(detection, keyed, config, budget)
    measured_slow = {rb.rank for rb in budget.ranks if rb.slow and rb.measured} if budget else set()
    suspects, partners = drop_measured_tp_echoes(list(detection.suspects), measured_slow)
    detection = dataclasses.replace(detection, suspects=tuple(suspects), notes=(*detection.notes, *partners))
    detection = apply_impact_gate(detection, config)
    return TraceAnalysis(keyed, alignment, detection, budget)


def load_aligned_traces(
    trace_dir: str | os.PathLike, ranks: Sequence[int] | None = None
) -> tuple[list[RankTrace], AlignmentReport]:
    """Load every rank file of `trace_dir` (or `ranks`) and align them: the first two steps of
    analyze_trace_dir, for callers that detect several times (threshold tuning)."""
    return align_traces(load_trace_dir(trace_dir, ranks=ranks))


def analyze_trace_dir(
    trace_dir: str | os.PathLike, config: DetectConfig = DetectConfig(), ranks: Sequence[int] | None = None
) -> TraceAnalysis:
    """Load every rank file of `trace_dir` (or `ranks`) and its probe.json, align and detect.

    Raises what load_trace_dir raises (FileNotFoundError, TraceFormatError) and
    DetectInputError; all are OSError or ValueError, with a message naming the file."""
    probe = load_probe(trace_dir)
    return analyze_aligned(*load_aligned_traces(trace_dir, ranks), config, probe)
