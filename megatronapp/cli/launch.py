"""`megatronapp train` on local ranks (launch.local) and its end-of-run report.

The ranks write their metrics to a result file that the launching process reads back to print
one table (and, with --trace, the merged timeline and the detection report).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatronapp.cli.run import TrainRun
from megatronapp.engine.throughput import compute_run_throughput
from megatronapp.launch.local import remove_stale_rank_traces, run_ranks_for_result
from megatronapp.scan.probe_config import PROBE_FILE


def prepare_trace_dir(run: TrainRun) -> None:
    """Remove rank files and the link probe of an earlier run, so a smaller world does not merge
    stale ranks and detection does not read an old probe."""
    if run.trace.enabled:
        remove_stale_rank_traces(run.trace.trace_dir)
        (Path(run.trace.trace_dir) / PROBE_FILE).unlink(missing_ok=True)


def launch_train(run: TrainRun, argv: list[str]) -> int:
    """Run this `train` command (`argv`, validated as `run`) on its local ranks, then report; the exit code."""
    prepare_trace_dir(run)
    code, saved = run_ranks_for_result(argv, run.world_size)
    if code:
        return code
    return report_saved(run, saved or {})


def new_summary_path() -> Path:
    """Where rank 0 writes the run's summary for the launching process."""
    return Path(tempfile.mkdtemp(prefix="megatronapp-")) / "summary.json"


def report_summary(run: TrainRun, summary: str | Path) -> int:
    """report_run from the summary file rank 0 wrote (history, evaluations, module rows)."""
    summary = Path(summary)
    return report_saved(run, json.loads(summary.read_text()) if summary.is_file() else {})


def report_saved(run: TrainRun, saved: dict) -> int:
    """report_run from what rank 0 saved: history, evaluations, module rows."""
    rows = eval_summary_rows(saved.get("evaluations", [])) + saved.get("rows", [])
    return report_run(run, saved.get("history", []), rows)


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


def report_run(run: TrainRun, history: list[dict], rows: list | None = None) -> int:
    """Print the run summary; with --trace also merge the timeline and run detection."""
    console = Console()
    job = run.job
    if history:
        step_s, tokens_per_s = compute_run_throughput(history, job.logging.log_interval)
        table = Table(title="megatronapp train: summary", show_header=False)
        table.add_row("ranks", str(run.world_size))
        table.add_row("iterations", str(history[-1]["iteration"]))
        table.add_row("loss first -> last", f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
        table.add_row("mean step time", f"{step_s * 1e3:.1f} ms")
        table.add_row("mean tokens/s", f"{tokens_per_s:,.0f}")
        if job.checkpoint.save:
            table.add_row("checkpoint", job.checkpoint.save)
        if job.logging.metrics_file:
            table.add_row("metrics", job.logging.metrics_file)
        for label, value in rows or []:  # module-specific lines (e.g. MegaFBD's role waits)
            table.add_row(label, value)
        console.print(table)
    if run.trace.enabled:
        from megatronapp.scan.trace_run import report_traced_run

        print(report_traced_run(run.trace.trace_dir, config=run.detect), end="", flush=True)
    return 0
