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

from megatronapp.flags import add_flags, read_flags
from megatronapp.injection.inject import FaultPlan, fault_env, parse_fault_plan
from megatronapp.launch.flags import NPROC_PER_NODE
from megatronapp.launch.local import remove_stale_rank_traces, run_local_ranks
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.probe_config import PROBE_FILE
from megatronapp.scan.record.autotrace import AutoTraceConfig
from megatronapp.scan.record.trace_config import TRACE_FLAGS


def add_trace_run_arguments(parser: argparse.ArgumentParser) -> None:
    """`trace run`'s own flags (its --inject-* test knobs are cli/injection.py's)."""
    add_flags(parser, (NPROC_PER_NODE, *TRACE_FLAGS), AutoTraceConfig)
    add_flags(parser, DETECT_FLAGS, DetectConfig)
    parser.add_argument("--json", action="store_true", help="print the detection report as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS...")
    parser.set_defaults(build_run=build_trace_run, launch=lambda run, argv: run_trace_run(run))


@dataclass(frozen=True)
class TraceRun:
    """What `trace run` will launch: a script on local ranks, traced, with injected faults."""

    command: tuple[str, ...]  # SCRIPT.py ARGS...
    nproc_per_node: int
    config: AutoTraceConfig
    faults: FaultPlan
    fault_specs: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # --inject-slowdown, --inject-link-delay
    as_json: bool = False  # --json
    detect: DetectConfig = DetectConfig()  # how the report at the end judges the traces


def build_trace_run(args: argparse.Namespace) -> TraceRun:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    specs = (tuple(args.inject_slowdown or ()), tuple(args.inject_link_delay or ()))
    return TraceRun(
        tuple(command),
        1 if args.nproc_per_node is None else args.nproc_per_node,
        AutoTraceConfig(**read_flags(args, TRACE_FLAGS)),
        parse_fault_plan(*specs),
        specs,
        args.json,
        DetectConfig(**read_flags(args, DETECT_FLAGS)),
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


def run_trace_run(run: TraceRun) -> int:
    """Launch the validated run: 1 if a rank failed, else 0 (report printed)."""
    remove_stale_rank_traces(run.config.trace_dir)
    (Path(run.config.trace_dir) / PROBE_FILE).unlink(missing_ok=True)  # detection must not read an old one
    os.environ.update(run.config.to_env())
    os.environ.update(fault_env(*run.fault_specs))
    code = run_local_ranks(
        "megatronapp.scan.record.run", list(run.command), run.nproc_per_node, prog="megatronapp trace run"
    )
    if code:
        return code
    print(report_traced_run(run.config.trace_dir, run.as_json, run.detect), end="")
    return 0


def report_traced_run(trace_dir: str, as_json: bool = False, config: DetectConfig = DetectConfig()) -> str:
    """Merge a traced run's rank files into TRACE_DIR/timeline.json, run detection (with its probe.json,
    under `config`), and say what was written and found (one JSON object with `as_json`); `train
    --trace` and `trace run` end so."""
    import json

    from megatronapp.scan.analyze.detect_config import DetectInputError
    from megatronapp.scan.analyze.detect_output import render_report, report_to_json
    from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir
    from megatronapp.scan.merge.merge import merge_traces
    from megatronapp.scan.notes import truncated_traces_as_notes

    out = Path(trace_dir) / "timeline.json"
    with truncated_traces_as_notes(sys.stderr if as_json else None):  # --json: stdout is one object
        summary = merge_traces(trace_dir, out)
        try:
            detection = analyze_trace_dir(trace_dir, config).detection
            found = report_to_json(detection) if as_json else render_report(detection)
        except DetectInputError as exc:  # e.g. no iteration the ranks share: the timeline still stands
            found = {"detection_skipped": str(exc)} if as_json else f"Detection skipped: {exc}\n"
    if as_json:
        doc = {"timeline": str(out), "events": summary.events, "flows": summary.flows, **found}
        return json.dumps(doc, indent=2) + "\n"
    return (
        f"MegaScan: merged {len(summary.ranks)} ranks, {summary.events} events, {summary.flows} flow arrows -> {out}\n"
        "  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing\n" + found
    )
