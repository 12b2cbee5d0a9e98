"""Launching local ranks through torch's own launcher, and the end-of-run report.

`--nproc-per-node N` hands the same command line (minus that flag) to
torch.distributed.run in standalone mode, so every rank runs exactly what `torchrun`
would run. If any rank raises, the elastic agent stops the others and we print that
rank's error and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatronapp.config import TrainConfig
from megatronapp.engine.launch_failures import pick_root_failure
from megatronapp.engine.throughput import compute_run_throughput


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    return out


def prepare_trace_dir(args: argparse.Namespace) -> None:
    """Remove rank files of an earlier run, so a smaller world does not merge stale ranks."""
    if not args.trace:
        return
    d = Path(args.trace_dir)
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("rank*.mscan"):
        f.unlink()


def launch_local(args: argparse.Namespace, argv: list[str], world: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    prepare_trace_dir(args)
    summary = Path(tempfile.mkdtemp(prefix="megatronapp-")) / "summary.json"
    worker_argv = _strip_nproc(argv) + ["--summary-file", str(summary)]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    os.environ.setdefault("LOGLEVEL", "ERROR")
    os.environ.setdefault("MEGATRONAPP_RUN_ID", uuid.uuid4().hex[:12])  # one id for all ranks' traces
    run_args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(world), "--monitor-interval", "0.1",
         "--module", "megatronapp.cli.main", *worker_argv])
    try:
        run(run_args)
    except ChildFailedError as exc:
        rank, failure, message = pick_root_failure(exc.failures)
        print(f"megatronapp: rank {rank} failed (exit code {failure.exitcode}): {message}", file=sys.stderr)
        return 1
    saved = json.loads(summary.read_text()) if summary.is_file() else {}
    return report_run(args, saved.get("history", []), world, saved.get("rows", []))


def report_run(args: argparse.Namespace, history: list[dict], world: int, rows: list | None = None) -> int:
    """Print the run summary; with --trace also merge the timeline and run detection."""
    console = Console()
    if history:
        step_s, tokens_per_s = compute_run_throughput(history, args.log_interval or TrainConfig.log_interval)
        table = Table(title="megatronapp train: summary", show_header=False)
        table.add_row("ranks", str(world))
        table.add_row("iterations", str(history[-1]["iteration"]))
        table.add_row("loss first -> last", f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
        table.add_row("mean step time", f"{step_s * 1e3:.1f} ms")
        table.add_row("mean tokens/s", f"{tokens_per_s:,.0f}")
        if args.save:
            table.add_row("checkpoint", args.save)
        if args.metrics_file:
            table.add_row("metrics", args.metrics_file)
        for label, value in rows or []:  # module-specific lines (e.g. MegaFBD's role waits)
            table.add_row(label, value)
        console.print(table)
    if args.trace:
        return _report_trace(args, console)
    return 0


def _report_trace(args: argparse.Namespace, console: Console) -> int:
    from megatronapp.scan.analyze.analysis import analyze_trace_dir
    from megatronapp.scan.analyze.detect import render_report
    from megatronapp.scan.merge.merge import merge_traces

    out = Path(args.trace_dir) / "timeline.json"
    summary = merge_traces(args.trace_dir, out)
    console.print(f"[bold]MegaScan[/bold]: merged {len(summary.ranks)} ranks, {summary.events} events -> {out}")
    console.print("  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    console.print(render_report(analyze_trace_dir(args.trace_dir).detection))
    return 0
