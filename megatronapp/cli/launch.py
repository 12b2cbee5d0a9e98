"""`megatronapp train` on local ranks (launch.local) and its end-of-run report.

The ranks write their metrics to a summary file that the launching process reads back to print
one table (and, with --trace, the merged timeline and the detection report).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatronapp.config import LoggingConfig
from megatronapp.engine.throughput import compute_run_throughput
from megatronapp.launch.local import rank_argv, remove_stale_rank_traces, run_local_ranks


def prepare_trace_dir(args: argparse.Namespace) -> None:
    """Remove rank files of an earlier run, so a smaller world does not merge stale ranks."""
    if args.trace:
        remove_stale_rank_traces(args.trace_dir)


def launch_train(args: argparse.Namespace, argv: list[str], world: int) -> int:
    """Run this `train` command on `world` local ranks, then report; the exit code."""
    prepare_trace_dir(args)
    summary = new_summary_path()
    code = run_local_ranks("megatronapp.cli.main", rank_argv(argv, ["--summary-file", str(summary)]), world)
    if code:
        return code
    return report_summary(args, summary, world)


def new_summary_path() -> Path:
    """Where rank 0 writes the run's summary for the launching process."""
    return Path(tempfile.mkdtemp(prefix="megatronapp-")) / "summary.json"


def report_summary(args: argparse.Namespace, summary: str | Path, world: int) -> int:
    """report_run from the summary file rank 0 wrote (history, evaluations, module rows)."""
    summary = Path(summary)
    saved = json.loads(summary.read_text()) if summary.is_file() else {}
    rows = eval_summary_rows(saved.get("evaluations", [])) + saved.get("rows", [])
    return report_run(args, saved.get("history", []), world, rows)


def eval_summary_rows(evaluations: list[dict]) -> list[list[str]]:
    """Summary lines of the run's last validation and test results (metrics-file rows)."""
    rows = []
    for split, label in (("valid", "validation loss (ppl)"), ("test", "test loss (ppl)")):
        found = [e for e in evaluations if f"{split}_loss" in e]
        if found:
            e = found[-1]
            text = f"{e[f'{split}_loss']:.4f} ({e[f'{split}_ppl']:.2f}) at iteration {e['iteration']}"
            rows.append([label, text])
    return rows


def report_run(args: argparse.Namespace, history: list[dict], world: int, rows: list | None = None) -> int:
    """Print the run summary; with --trace also merge the timeline and run detection."""
    console = Console()
    if history:
        step_s, tokens_per_s = compute_run_throughput(history, args.log_interval or LoggingConfig.log_interval)
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
    from megatronapp.scan.analyze.detect_output import render_report
    from megatronapp.scan.merge.merge import merge_traces

    out = Path(args.trace_dir) / "timeline.json"
    summary = merge_traces(args.trace_dir, out)
    console.print(f"[bold]MegaScan[/bold]: merged {len(summary.ranks)} ranks, {summary.events} events -> {out}")
    console.print("  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    console.print(render_report(analyze_trace_dir(args.trace_dir).detection))
    return 0
