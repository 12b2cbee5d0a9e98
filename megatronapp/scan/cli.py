"""`megatronapp trace ...` subcommands: argument parsing and printing; the work is in the
analysis modules (merge.py, load_align_detect.py -> align.py, detect.py).

The top-level CLI calls `add_trace_subcommands(subparsers)`; every leaf parser sets
`func`, which takes the parsed namespace and returns the process exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatronapp.flags import add_flags, read_flags
from megatronapp.scan.analyze.budget_output import budget_to_json, render_budget_text
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.analyze.detect_output import render_report, report_to_json
from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir
from megatronapp.scan.merge.merge import ALIGN_SAMPLE_ITERATIONS, merge_traces, merge_traces_split
from megatronapp.scan.notes import truncated_traces_as_notes
from megatronapp.scan.probe_run import add_probe_arguments
from megatronapp.scan.record.format import TraceFormatError
from megatronapp.scan.trace_run import add_trace_run_arguments

_NO_END = 2**31 - 1


def parse_iteration_range(text: str) -> range:
    """ "A:B" -> iterations A..B-1 (half-open, like Python slices); "A:" and ":B" leave a
    side open; "A" is the single iteration A."""
    try:
        if ":" not in text:
            start = int(text)
            return range(start, start + 1)
        lo, hi = text.split(":", 1)
        start, stop = int(lo) if lo else 0, int(hi) if hi else _NO_END
    except ValueError:
        raise argparse.ArgumentTypeError(f"iterations must look like A:B, A: , :B or A, got {text!r}") from None
    if stop <= start:
        raise argparse.ArgumentTypeError(f"iteration range {text!r} is empty (B must be greater than A)")
    return range(start, stop)


def parse_rank_list(text: str) -> list[int]:
    """ "0,1,4-7" -> [0, 1, 4, 5, 6, 7] (ranges inclusive)."""
    ranks: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks must look like 0,1,4-7, got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"ranks must be non-negative integers, got {text!r}")
    return sorted(ranks)


def _report_split(summaries: list) -> int:
    for summary in summaries:
        print(f"wrote {summary.out}: {summary.events} events, {summary.flows} flow arrows")
    print(f"{len(summaries)} files; open each at https://ui.perfetto.dev")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    """Handler of `trace merge`: write the Chrome trace and print a summary."""
    if args.split_iterations is not None and args.iterations is not None:
        print("error: --split-iterations and --iterations cannot be combined", file=sys.stderr)
        return 2
    try:
        with truncated_traces_as_notes():
            if args.split_iterations is not None:
                summaries = merge_traces_split(args.dir, args.out, args.split_iterations, ranks=args.ranks)
            else:
                summary = merge_traces(args.dir, args.out, iterations=args.iterations, ranks=args.ranks)
        if args.split_iterations is not None:
            return _report_split(summaries)
    except (TraceFormatError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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


def run_detect(args: argparse.Namespace) -> int:
    """Handler of `trace detect`: load, align, detect, print. Exit code 0 nobody found, 3 suspects
    found, 2 bad input."""
    its = args.iterations  # a range from parse_iteration_range, or None
    try:
        config = DetectConfig(
            iterations=None if its is None else (its.start, its.stop), **read_flags(args, DETECT_FLAGS)
        )
        with truncated_traces_as_notes(sys.stderr if args.json else None):  # --json: stdout is one object
            analysis = analyze_trace_dir(args.trace_dir, config)
    except (OSError, ValueError) as exc:  # TraceFormatError and DetectInputError are ValueErrors
        print(f"megatronapp trace detect: {exc}", file=sys.stderr)
        return 2
    report = analysis.detection
    budget = analysis.budget if args.budget else None
    if args.json:
        doc = report_to_json(report) | ({"budget": budget_to_json(budget)} if budget else {})
        print(json.dumps(doc, indent=2))
    else:
        print(render_report(report) + (render_budget_text(budget) if budget else ""), end="\n")
    return 3 if report.suspects else 0


def _add_detect(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("detect", help="find slow ranks and slow links in a trace directory")
    parser.add_argument("trace_dir", help="directory holding the rank*.mscan files of one run")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--budget",
        action="store_true",
        help="also print each rank's time budget (own work, descheduled, waiting, transfer, rest) and each link's",
    )
    parser.add_argument(
        "--iterations",
        type=parse_iteration_range,
        default=None,
        metavar="A:B",
        help="analyse iterations A..B-1 only (also A:, :B, A); default: every complete iteration, warm-up skipped",
    )
    add_flags(parser, DETECT_FLAGS, DetectConfig)
    parser.set_defaults(func=run_detect)


def run_whatif(args: argparse.Namespace) -> int:
    """Handler of `trace whatif`: the iteration time with each diagnosed fault removed."""
    try:
        with truncated_traces_as_notes(sys.stderr if args.json else None):
            report = analyze_trace_dir(args.trace_dir).detection
    except (OSError, ValueError) as exc:
        print(f"megatronapp trace whatif: {exc}", file=sys.stderr)
        return 2
    doc = report_to_json(report)
    rows = [
        {
            "fault": f"slow link {s['link'][0]}->{s['link'][1]}" if s["link"] else f"{s['cause']} rank {s['rank']}",
            **s["what_if"],
        }
        for s in doc["suspects"]
    ]
    if args.json:
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


def run_report(args: argparse.Namespace) -> int:
    """Handler of `trace report`: write the self-contained HTML page."""
    from pathlib import Path

    from megatronapp.scan.analyze.report import write_report

    try:
        with truncated_traces_as_notes():
            analysis = analyze_trace_dir(args.trace_dir)
    except (OSError, ValueError) as exc:
        print(f"megatronapp trace report: {exc}", file=sys.stderr)
        return 2
    timeline = Path(args.trace_dir) / "timeline.json"
    link = os.path.relpath(timeline, Path(args.out).resolve().parent) if timeline.is_file() else None
    write_report(analysis, args.out, f"MegaScan report: {args.trace_dir}", link)
    print(f"wrote {args.out}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    """Handler of `trace check`: exit 0 clean, 1 import errors or backward flows, 2 bad input or
    an engine that could not run."""
    from megatronapp.scan.perfetto.check import check_timeline, format_rows, query_timeline, render_check
    from megatronapp.scan.perfetto.engine import EngineError

    try:
        if args.sql is not None:
            print(format_rows(*query_timeline(args.timeline, args.sql), args.json))
            return 0
        report = check_timeline(args.timeline)
    except (OSError, EngineError) as exc:
        print(f"megatronapp trace check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else render_check(report))
    return 0 if report["ok"] else 1


def _add_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check", help="load a timeline into Perfetto's trace processor: import errors and backward flows"
    )
    check.add_argument("timeline", help="Chrome trace JSON written by `trace merge` (.json or .json.gz)")
    check.add_argument("--json", action="store_true", help="print the report (or the query's rows) as JSON")
    check.add_argument("--sql", default=None, help="run one Perfetto SQL query instead and print its rows as TSV")
    check.set_defaults(func=run_check)


def _add_analysis_commands(sub: argparse._SubParsersAction) -> None:
    whatif = sub.add_parser("whatif", help="predict the iteration time with each diagnosed fault removed")
    whatif.add_argument("trace_dir", help="directory holding the rank*.mscan files of one run")
    whatif.add_argument("--json", action="store_true", help="print the estimates as one JSON object")
    whatif.set_defaults(func=run_whatif)
    report = sub.add_parser("report", help="write one self-contained HTML page about a traced run")
    report.add_argument("trace_dir", help="directory holding the rank*.mscan files of one run")
    report.add_argument("--out", required=True, help="HTML file to write")
    report.set_defaults(func=run_report)


def add_trace_subcommands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `trace merge` and `trace detect` under `subparsers`; returns the `trace` parser."""
    trace = subparsers.add_parser("trace", help="MegaScan traces: merge into one timeline, detect slow ranks")
    sub = trace.add_subparsers(
        dest="trace_command", metavar="{merge,detect,run,probe,whatif,report,check}", required=True
    )
    merge = sub.add_parser("merge", help="merge rank*.mscan files into a Chrome/Perfetto trace JSON")
    merge.add_argument("dir", help="trace directory holding rank*.mscan files")
    merge.add_argument("-o", "--out", required=True, help="output JSON path (gzipped when it ends in .gz)")
    merge.add_argument(
        "--iterations", type=parse_iteration_range, default=None, help="A:B merges iterations A..B-1 (also A:, :B, A)"
    )
    merge.add_argument("--ranks", type=parse_rank_list, default=None, help="ranks to merge, e.g. 0,1,4-7")
    merge.add_argument(
        "--split-iterations",
        type=int,
        default=None,
        metavar="N",
        help="one file per N traced iterations (OUT gets .iterA-B before its extension)",
    )
    merge.set_defaults(func=run_merge)
    _add_detect(sub)
    _add_analysis_commands(sub)
    _add_check(sub)
    add_trace_run_arguments(sub.add_parser("run", help="trace an unmodified PyTorch program: run -- SCRIPT.py ARGS"))
    add_probe_arguments(sub.add_parser("probe", help="measure the bandwidth of every directed link of a layout"))
    return trace
