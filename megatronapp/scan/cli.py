"""`megatronapp trace ...` subcommands: their flags, and the frozen run each builds from them
(scan/commands.py runs merge, detect, whatif, report and check; trace_run.py and probe_run.py
the launching ones).

The top-level CLI calls `add_trace_subcommands(subparsers)`; every leaf parser sets `build_run`
(parsed flags -> frozen run) and `launch` (run, argv -> exit code); cli/validate.py checks the
run in between.
"""

from __future__ import annotations

import argparse

from megatronapp.flags import add_flags, read_flags
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.commands import (
    CheckRun,
    DetectRun,
    MergeRun,
    ReportRun,
    WhatIfRun,
    run_check,
    run_detect,
    run_merge,
    run_report,
    run_whatif,
)
from megatronapp.scan.probe_run import add_probe_arguments
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


def build_merge_run(args: argparse.Namespace) -> MergeRun:
    ranks = None if args.ranks is None else tuple(args.ranks)
    return MergeRun(args.dir, args.out, args.iterations, ranks, args.split_iterations)


def build_detect_run(args: argparse.Namespace) -> DetectRun:
    its = args.iterations  # a range from parse_iteration_range, or None
    window = None if its is None else (its.start, its.stop)
    return DetectRun(
        args.trace_dir, DetectConfig(iterations=window, **read_flags(args, DETECT_FLAGS)), args.json, args.budget
    )


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
    parser.set_defaults(build_run=build_detect_run, launch=run_detect)


def _add_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check", help="load a timeline into Perfetto's trace processor: import errors and backward flows"
    )
    check.add_argument("timeline", help="Chrome trace JSON written by `trace merge` (.json or .json.gz)")
    check.add_argument("--json", action="store_true", help="print the report (or the query's rows) as JSON")
    check.add_argument("--sql", default=None, help="run one Perfetto SQL query instead and print its rows as TSV")
    check.set_defaults(build_run=lambda a: CheckRun(a.timeline, a.json, a.sql), launch=run_check)


def _add_analysis_commands(sub: argparse._SubParsersAction) -> None:
    whatif = sub.add_parser("whatif", help="predict the iteration time with each diagnosed fault removed")
    whatif.add_argument("trace_dir", help="directory holding the rank*.mscan files of one run")
    whatif.add_argument("--json", action="store_true", help="print the estimates as one JSON object")
    whatif.set_defaults(build_run=lambda a: WhatIfRun(a.trace_dir, a.json), launch=run_whatif)
    report = sub.add_parser("report", help="write one self-contained HTML page about a traced run")
    report.add_argument("trace_dir", help="directory holding the rank*.mscan files of one run")
    report.add_argument("--out", required=True, help="HTML file to write")
    report.set_defaults(build_run=lambda a: ReportRun(a.trace_dir, a.out), launch=run_report)


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
    merge.set_defaults(build_run=build_merge_run, launch=run_merge)
    _add_detect(sub)
    _add_analysis_commands(sub)
    _add_check(sub)
    add_trace_run_arguments(sub.add_parser("run", help="trace an unmodified PyTorch program: run -- SCRIPT.py ARGS"))
    add_probe_arguments(sub.add_parser("probe", help="measure the bandwidth of every directed link of a layout"))
    return trace
