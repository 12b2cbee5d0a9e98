"""A DetectionReport as JSON (`trace detect --json`, the report page) and as terminal text."""

from __future__ import annotations

import io
import shutil

from rich.console import Console
from rich.table import Table

from megatronapp.scan.analyze.detect_config import DetectionReport
from megatronapp.scan.analyze.detect_rules import to_ms


def report_to_json(report: DetectionReport) -> dict:
    """JSON-ready dict: suspects (most likely first), iterations_analyzed, what_if, victims, notes."""
    suspects = [
        {
            "rank": s.rank,
            "coords": dict(s.coords),
            "cause": s.cause,
            "link": list(s.link) if s.link else None,
            "confidence": s.confidence,
            "evidence": dict(s.evidence),
            "what_if": {
                "iteration_ms": to_ms(s.iteration_ns),
                "iteration_if_fixed_ms": to_ms(s.what_if_iteration_ns),
                "saving_ms": to_ms(s.saving_ns),
                "over_iterations": "mean" if s.evidence.get("intermittent") else "median",
            },
        }
        for s in report.suspects
    ]
    return {
        "suspects": suspects,
        "iterations_analyzed": list(report.iterations_analyzed),
        "what_if": {
            "iteration_ms": to_ms(report.iteration_ns),
            "iteration_mean_ms": to_ms(report.iteration_mean_ns),
            "iteration_if_all_fixed_ms": to_ms(report.what_if_all_fixed_ns),
        },
        "victims": [{"rank": r, "wait_ms_per_iteration": to_ms(w)} for r, w in report.victims],
        "world_size": report.world_size,
        "layout": dict(report.layout),
        "notes": list(report.notes),
        "unjoined_ranks": list(report.unjoined_ranks),
    }


def nothing_found_text(report: DetectionReport) -> str:
    """The verdict without suspects; it says which ranks could not be compared at all."""
    if not report.unjoined_ranks:
        return "No slow rank or slow link found."
    if len(report.unjoined_ranks) == report.world_size:
        return "No verdict: the ranks' iterations could not be joined (they share no collective or message)."
    return (
        f"No slow rank or slow link found among the ranks that could be joined; ranks "
        f"{list(report.unjoined_ranks)} could not be (they share no collective or message with the others)."
    )


def render_report(report: DetectionReport, width: int | None = None) -> str:
    """The report as terminal text (a rich table of suspects, then victims and notes).

    `width` defaults to the terminal's (80 when not a terminal), so printing the text
    through another rich console does not re-wrap it."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=False)
    lay = report.layout
    its = report.iterations_analyzed
    console.print(
        f"MegaScan detect: {report.world_size} ranks (TP={lay.get('tp_size')} PP={lay.get('pp_size')} "
        f"DP={lay.get('dp_size')}), iterations {its[0]}..{its[-1]} ({len(its)}), "
        f"iteration time {to_ms(report.iteration_ns)} ms",
        markup=False,
    )
    if not report.suspects:
        console.print(nothing_found_text(report), markup=False)
    else:
        table = Table(show_lines=False)
        for col in ("#", "rank", "tp,dp,pp", "cause", "confidence", "iteration if fixed"):
            table.add_column(col, no_wrap=True)
        for i, s in enumerate(report.suspects, 1):
            c = s.coords
            cause = f"slow_link {s.link[0]}->{s.link[1]}" if s.link else s.cause
            table.add_row(
                str(i),
                str(s.rank),
                f"{c.get('tp')},{c.get('dp')},{c.get('pp')}",
                cause,
                f"{s.confidence:.2f}",
                f"{to_ms(s.what_if_iteration_ns)} ms (-{to_ms(s.saving_ns)})",
            )
        console.print(table)
        for i, s in enumerate(report.suspects, 1):  # evidence below the table: it is a sentence
            console.print(f"#{i}: {s.evidence['summary']}", markup=False)
        if report.victims:
            console.print(
                "Waiting on them (victims, ms/iteration): "
                + ", ".join(f"rank {r} {to_ms(w)}" for r, w in report.victims),
                markup=False,
            )
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    return console.export_text()
