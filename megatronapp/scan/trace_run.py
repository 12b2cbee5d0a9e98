"""`megatronapp trace run [options] -- SCRIPT ARGS...`: trace an unmodified program on local ranks.

Launches SCRIPT on `--nproc-per-node` ranks through torch's own launcher (standalone torchrun),
each rank under `python -m megatronapp.scan.record.run` (zero-code tracing, autotrace.py), then merges
the rank files into TRACE_DIR/timeline.json and prints the detection report. Settings and
faults reach the ranks as MEGATRONAPP_TRACE_* / MEGATRONAPP_INJECT_* environment variables.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatronapp.faults.inject import FaultPlan, fault_env, parse_fault_plan
from megatronapp.launch.local import remove_stale_rank_traces, run_local_ranks
from megatronapp.scan.record.autotrace import AutoTraceConfig
from megatronapp.scan.record.trace_config import add_trace_arguments, trace_fields_from_args


def add_trace_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    add_trace_arguments(parser, granularity_help="full: also every module's forward and backward")
    parser.add_argument(
        "--inject-slowdown",
        action="append",
        default=[],
        metavar="RANK:FACTOR[:EVERY]",
        help="test knob: RANK computes FACTOR x slower (every EVERY-th iteration); repeatable",
    )
    parser.add_argument(
        "--inject-link-delay",
        action="append",
        default=[],
        metavar="SRC:DST:MS[:JITTER]",
        help="test knob: messages SRC -> DST arrive MS (+- JITTER) ms late; repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print the detection report as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS...")
    parser.set_defaults(build_run=build_trace_run, launch=run_trace_run)


@dataclass(frozen=True)
class TraceRun:
    """What `trace run` will launch: a script on local ranks, traced, with injected faults."""

    command: tuple[str, ...]  # SCRIPT.py ARGS...
    nproc_per_node: int
    config: AutoTraceConfig
    faults: FaultPlan


def build_trace_run(args: argparse.Namespace) -> TraceRun:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return TraceRun(
        tuple(command),
        args.nproc_per_node,
        AutoTraceConfig(**trace_fields_from_args(args)),
        parse_fault_plan(args.inject_slowdown, args.inject_link_delay),
    )


def check_trace_run(run: TraceRun) -> None:
    """A Python script to run, ranks to run it on, faults on those ranks; ValueError (one line)."""
    if not run.command:
        raise ValueError("no program given: megatronapp trace run [options] -- SCRIPT.py ARGS...")
    if not run.command[0].endswith(".py") or not Path(run.command[0]).is_file():
        raise ValueError(f"{run.command[0]} is not a Python script file")
    if run.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {run.nproc_per_node}")
    run.faults.check(run.nproc_per_node)


def run_trace_run(args: argparse.Namespace, argv: list[str], run: TraceRun) -> int:
    """Launch the validated run: 1 if a rank failed, else 0 (report printed)."""
    remove_stale_rank_traces(run.config.trace_dir)
    os.environ.update(run.config.to_env())
    os.environ.update(fault_env(args.inject_slowdown, args.inject_link_delay))
    code = run_local_ranks(
        "megatronapp.scan.record.run", list(run.command), run.nproc_per_node, prog="megatronapp trace run"
    )
    if code:
        return code
    return _report(run.config.trace_dir, args.json)


def _report(trace_dir: str, as_json: bool) -> int:
    import json

    from megatronapp.scan.analyze.analysis import analyze_trace_dir
    from megatronapp.scan.analyze.detect_output import render_report, report_to_json
    from megatronapp.scan.cli import truncated_traces_as_notes
    from megatronapp.scan.merge.merge import merge_traces

    out = Path(trace_dir) / "timeline.json"
    with truncated_traces_as_notes(sys.stderr if as_json else None):  # --json: stdout is one object
        summary = merge_traces(trace_dir, out)
        analysis = analyze_trace_dir(trace_dir)
    if as_json:
        print(
            json.dumps(
                {
                    "timeline": str(out),
                    "events": summary.events,
                    "flows": summary.flows,
                    **report_to_json(analysis.detection),
                },
                indent=2,
            )
        )
        return 0
    print(f"MegaScan: merged {len(summary.ranks)} ranks, {summary.events} events, {summary.flows} flow arrows -> {out}")
    print("  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    print(render_report(analysis.detection), end="")
    return 0
