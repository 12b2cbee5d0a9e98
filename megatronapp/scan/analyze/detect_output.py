"""A DetectionReport as JSON (`trace detect --json`, the report page) and as terminal text."""

from __future__ import annotations

import io
import shutil

from rich.console import Console
from rich.table import Table

from megatronapp.scan.analyze.detect_config import DetectionReport
from megatronapp.scan.analyze.detect_rules import to_ms
from megatronapp.scan.analyze.impact_gate import describe_suspect, gated_share, impact_share


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
        "min_impact": report.min_impact,
        "below_impact": [
            {"candidate": describe_suspect(s), "rank": s.rank, "share": round(impact_share(s), 4)}
            for s in report.below_impact
        ],
        "ambiguous": list(report.ambiguous),
        "links_measured": [dict(row) for row in report.links_measured],
    }


def below_impact_text(report: DetectionReport) -> str:
    """What the impact gate held back: the largest candidate and its share ("" when none)."""
    if not report.below_impact:
        return ""
    top = report.below_impact[0]
    more = f" ({len(report.below_impact) - 1} smaller)" if len(report.below_impact) > 1 else ""
    hit = gated_share(top)
    where = f"; {hit:.1%} in the iterations it slows" if hit != impact_share(top) else ""
    return (
        f"largest candidate below {report.min_impact:.0%}: {describe_suspect(top)}, fixing it would save "
        f"{to_ms(top.saving_ns)} of {to_ms(top.iteration_ns)} ms per iteration ({impact_share(top):.1%}{where}){more}"
    )


def nothing_found_text(report: DetectionReport) -> str:
    """The verdict without suspects; it says which ranks could not be compared at all, and what
    the impact gate held back."""
    if report.below_impact:
        return f"Nothing costing more than {report.min_impact:.0%} of the iteration found; {below_impact_text(report)}."
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
                f"{c.get('tp')},{c.get('dp')},{c.get('pp')}" if c else "-",  # a link only the probe saw
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
        if report.below_impact:
            console.print(f"Not named: {below_impact_text(report)}", markup=False)
    for line in report.ambiguous:
        console.print(f"ambiguous: {line}", markup=False)
    if report.links_measured:
        console.print(links_measured_table(report.links_measured))
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    return console.export_text()


def links_measured_table(rows) -> Table:
    """The link probe's measurements: MB/s per directed link beside its comparable links' median."""
    table = Table(title="Links measured (link probe)", show_lines=False)
    for col in ("link", "kind", "MB/s", "comparable links MB/s", "ratio"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        peer = "-" if r["peer_mbytes_per_s"] is None else str(r["peer_mbytes_per_s"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        table.add_row(f"{r['src']}->{r['dst']}", r["kind"], str(r["mbytes_per_s"]), peer, ratio)
    return table
