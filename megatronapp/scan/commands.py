"""`megatronapp trace merge|detect|whatif|report|check`: each a frozen run, its checks (run by
cli/validate.py before any file is read in earnest) and what runs it.

scan/cli.py turns the parsed flags into these runs; from here on only the run is read. A run that
breaks a check is one line (`megatronapp: error: ...`) and exit code 2; what the work itself finds
wrong (a damaged rank file, no complete iteration) is one line and exit code 2 too.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatronapp.files import check_writable_path
from megatronapp.scan.analyze.budget_output import budget_to_json, render_budget_text
from megatronapp.scan.analyze.detect_config import DetectConfig
from megatronapp.scan.analyze.detect_output import render_report, report_to_json
from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir
from megatronapp.scan.merge.merge import ALIGN_SAMPLE_ITERATIONS, merge_traces, merge_traces_split
from megatronapp.scan.notes import truncated_traces_as_notes
from megatronapp.scan.record.format import TraceFormatError, select_trace_files


@dataclass(frozen=True)
class MergeRun:
    trace_dir: str
    out: str
    iterations: range | None = None  # half-open, as parse_iteration_range gives it
    ranks: tuple[int, ...] | None = None
    split_iterations: int | None = None  # one file per N traced iterations


@dataclass(frozen=True)
class DetectRun:
    trace_dir: str
    config: DetectConfig
    json: bool = False
    budget: bool = False


@dataclass(frozen=True)
class WhatIfRun:
    trace_dir: str
    json: bool = False


@dataclass(frozen=True)
class ReportRun:
    trace_dir: str
    out: str


@dataclass(frozen=True)
class CheckRun:
    timeline: str
    json: bool = False
    sql: str | None = None


def _check_trace_dir(trace_dir: str, ranks=None) -> None:
    """A folder holding the rank files asked for (FileNotFoundError, one line, otherwise)."""
    select_trace_files(trace_dir, ranks)


def check_merge_run(run: MergeRun) -> None:
    if run.split_iterations is not None and run.iterations is not None:
        raise ValueError("--split-iterations and --iterations cannot be combined")
    if run.split_iterations is not None and run.split_iterations < 1:
        raise ValueError(f"--split-iterations must be >= 1, got {run.split_iterations}")
    _check_trace_dir(run.trace_dir, run.ranks)
    check_writable_path(run.out, "--out")


def check_analysis_run(run: DetectRun | WhatIfRun | ReportRun) -> None:
    _check_trace_dir(run.trace_dir)
    if isinstance(run, ReportRun):
        check_writable_path(run.out, "--out")


def check_check_run(run: CheckRun) -> None:
    if not Path(run.timeline).is_file():
        raise FileNotFoundError(f"{run.timeline}: no such timeline file")


def _fail(command: str, exc: Exception) -> int:
    print(f"megatronapp trace {command}: {exc}", file=sys.stderr)
    return 2


def _report_split(summaries: list) -> int:
    for summary in summaries:
        print(f"wrote {summary.out}: {summary.events} events, {summary.flows} flow arrows")
    print(f"{len(summaries)} files; open each at https://ui.perfetto.dev")
    return 0


def run_merge(run: MergeRun, argv: list[str]) -> int:
    """Write the Chrome trace and print a summary."""
    try:
        with truncated_traces_as_notes():
            if run.split_iterations is not None:
                return _report_split(merge_traces_split(run.trace_dir, run.out, run.split_iterations, ranks=run.ranks))
            summary = merge_traces(run.trace_dir, run.out, iterations=run.iterations, ranks=run.ranks)
    except (TraceFormatError, OSError, ValueError) as exc:
        return _fail("merge", exc)
    report = summary.report
    print(
        f"wrote {summary.out}: {len(summary.ranks)} ranks, {summary.events} events, {summary.flows} flow arrows "
        f"({summary.arrivals} p2p messages)"
    )
    print(f"merged in {summary.seconds:.2f} s ({summary.events_per_s:,.0f} events/s)")
    print(
        f"alignment (first {ALIGN_SAMPLE_ITERATIONS} traced iterations): {report.anchors} collective anchors, "
        f"{report.p2p_messages} p2p messages, "
        f"median residual {report.median_residual_ns / 1e3:.1f} us, "
        f"{report.violations} causality violations left (of {report.violations_before})"
    )
    print("open it at https://ui.perfetto.dev or chrome://tracing")
    return 0


def run_detect(run: DetectRun, argv: list[str]) -> int:
    """Load, align, detect, print. Exit code 0 nobody found, 3 suspects found, 2 bad input."""
    try:
        with truncated_traces_as_notes(sys.stderr if run.json else None):  # --json: stdout is one object
            analysis = analyze_trace_dir(run.trace_dir, run.config)
    except (OSError, ValueError) as exc:  # TraceFormatError and DetectInputError are ValueErrors
        return _fail("detect", exc)
    report = analysis.detection
    budget = analysis.budget if run.budget else None
    if run.json:
        doc = report_to_json(report) | ({"budget": budget_to_json(budget)} if budget else {})
        print(json.dumps(doc, indent=2))
    else:
        print(render_report(report) + (render_budget_text(budget) if budget else ""), end="\n")
    return 3 if report.suspects else 0


def run_whatif(run: WhatIfRun, argv: list[str]) -> int:
    """The iteration time with each diagnosed fault removed."""
    try:
        with truncated_traces_as_notes(sys.stderr if run.json else None):
            report = analyze_trace_dir(run.trace_dir).detection
    except (OSError, ValueError) as exc:
        return _fail("whatif", exc)
    doc = report_to_json(report)
    rows = [
        {
            "fault": f"slow link {s['link'][0]}->{s['link'][1]}" if s["link"] else f"{s['cause']} rank {s['rank']}",
            **s["what_if"],
        }
        for s in doc["suspects"]
    ]
    if run.json:
        print(json.dumps({**doc["what_if"], "faults": rows}, indent=2))
        return 0
    print(
        f"iteration time now: {doc['what_if']['iteration_ms']} ms (median critical path; mean "
        f"{doc['what_if']['iteration_mean_ms']} ms)"
    )
    for row in rows:
        basis = "" if row["over_iterations"] == "median" else f"; intermittent: mean of now {row['iteration_ms']} ms"
        print(f"without {row['fault']}: {row['iteration_if_fixed_ms']} ms (-{row['saving_ms']} ms{basis})")
    if rows:
        print(f"without all of them: {doc['what_if']['iteration_if_all_fixed_ms']} ms")
    else:
        print("no fault diagnosed: nothing to remove")
    return 0


def run_report(run: ReportRun, argv: list[str]) -> int:
    """Write the self-contained HTML page."""
    from megatronapp.scan.analyze.report import write_report

    try:
        with truncated_traces_as_notes():
            analysis = analyze_trace_dir(run.trace_dir)
    except (OSError, ValueError) as exc:
        return _fail("report", exc)
    timeline = Path(run.trace_dir) / "timeline.json"
    link = os.path.relpath(timeline, Path(run.out).resolve().parent) if timeline.is_file() else None
    write_report(analysis, run.out, f"MegaScan report: {run.trace_dir}", link)
    print(f"wrote {run.out}")
    return 0


def run_check(run: CheckRun, argv: list[str]) -> int:
    """Exit 0 clean, 1 import errors or backward flows, 2 bad input or an engine that could not run."""
    from megatronapp.scan.perfetto.check import check_timeline, format_rows, query_timeline, render_check
    from megatronapp.scan.perfetto.engine import EngineError

    try:
        if run.sql is not None:
            print(format_rows(*query_timeline(run.timeline, run.sql), run.json))
            return 0
        report = check_timeline(run.timeline)
    except (OSError, EngineError) as exc:
        return _fail("check", exc)
    print(json.dumps(report, indent=1) if run.json else render_check(report))
    return 0 if report["ok"] else 1
