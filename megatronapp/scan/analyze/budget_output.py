"""A BudgetSummary (budget_summary.py) as JSON, as terminal tables (`trace detect --budget`) and as
the report page's "Time budget" tables (`trace report`)."""

from __future__ import annotations

import html
import io
import shutil
from dataclasses import asdict

from rich import box
from rich.console import Console
from rich.table import Table

from megatronapp.scan.analyze.budget_summary import BudgetSummary, LinkBudget, RankBudget
from megatronapp.scan.analyze.detect_rules import to_ms

_RANK_COLUMNS = ("rank", "iteration", "own", "desched", "throttled", "waiting", "transfer", "rest")
_LINK_COLUMNS = ("link", "msgs (clean)", "KiB", "ms", "ns/byte", "MB/s", "x peers")
_TITLE = "Time budget per rank: median ms per iteration (each part's own median)"


def budget_to_json(summary: BudgetSummary) -> dict:
    """JSON-ready dict: iterations, basis, ranks (parts in ms), links."""
    ranks = [
        {
            **{k: v for k, v in asdict(r).items() if k not in ("median_ns", "excess_ns", "per_iteration_ns")},
            "median_ms": {p: to_ms(v) for p, v in r.median_ns.items()},
            "excess_ms": {p: to_ms(v) for p, v in r.excess_ns.items()},
        }
        for r in summary.ranks
    ]
    return {
        "iterations": list(summary.iterations),
        "basis": summary.basis,
        "ranks": ranks,
        "links": [asdict(link) for link in summary.links],
    }


def describe_rank(r: RankBudget) -> str:
    """The rank's verdict in words: slow and why, or as fast as its peers."""
    if r.self_ratio is None:
        return "no peers to compare with"
    if not r.slow:
        return f"{r.self_ratio:.2f}x its peers' time outside communication"
    return f"slow, {r.self_ratio:.2f}x its peers' time outside communication: {r.cause}"


def describe_link(link: LinkBudget) -> str | None:
    """A line for a slow link or one that could not be judged; None for the others."""
    name = f"link {link.src}->{link.dst}"
    if link.clean_messages == 0:
        return f"{name}: an end was descheduled at every message; its time per byte is not its own"
    if link.slow:
        return (
            f"{name}: slow, {link.ratio:.2f}x the time per byte of {link.comparable_links} comparable links "
            f"({link.clean_messages} messages with neither end descheduled)"
        )
    return None


def _rank_cells(r: RankBudget) -> list[str]:
    m = {part: f"{ns / 1e6:.2f}" for part, ns in r.median_ns.items()}
    if not r.measured:  # trace without CPU time or scheduler counters (budget.py: fallbacks)
        m["descheduled"] = m["throttled"] = "n/a"
    return [str(r.rank), *(m[p] for p in ("wall", "own", "descheduled", "throttled", "waiting", "transfer", "rest"))]


def _link_cells(link: LinkBudget) -> list[str]:
    return [
        f"{link.src}->{link.dst}",
        f"{link.messages} ({link.clean_messages})",
        f"{link.median_bytes / 1024:.1f}",
        f"{to_ms(link.transfer_ns)}",
        f"{link.ns_per_byte:.3g}",
        f"{1e3 / max(link.ns_per_byte, 1e-9):.1f}",
        "-" if link.ratio is None else f"{link.ratio:.2f}",
    ]


def render_budget_text(summary: BudgetSummary, width: int | None = None) -> str:
    """The budget as terminal text: one table per rank, one per link, a verdict line per rank."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=False)
    table = Table(title=_TITLE, box=box.SIMPLE_HEAD)
    for col in _RANK_COLUMNS:
        table.add_column(col, no_wrap=True)
    for r in summary.ranks:
        table.add_row(*_rank_cells(r))
    console.print(table)
    console.print(
        "own: CPU time of the compute spans (device time on GPU); desched: runnable, not running (throttled: "
        "by the cgroup's quota); waiting/transfer: blocked in communication before/after the data was there; "
        "rest: outside the spans",
        markup=False,
    )
    for r in summary.ranks:
        console.print(f"rank {r.rank}: {describe_rank(r)}", markup=False)
    if summary.links:
        links = Table(title="Transfer per link (clean: neither end descheduled at the time)", box=box.SIMPLE_HEAD)
        for col in _LINK_COLUMNS:
            links.add_column(col, no_wrap=True)
        for link in summary.links:
            links.add_row(*_link_cells(link))
        console.print(links)
        for line in filter(None, map(describe_link, summary.links)):
            console.print(line, markup=False)
    return console.export_text()


def _html_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_budget_html(summary: BudgetSummary) -> str:
    """The report page's "Time budget" tables (no charts: the stacked columns above show the wall)."""
    rows = [[*_rank_cells(r), describe_rank(r)] for r in summary.ranks]
    page = (
        "<p>Each iteration split into own work (CPU time of the compute spans; device time on GPU), "
        "descheduled (runnable but not running, of which the cgroup's CPU quota throttled), waiting on "
        "peers and transfer (blocked in communication before and after the data was there), and the "
        f"rest (work outside the spans). Peers: {html.escape(summary.basis.replace('_', ' '))}.</p>"
        + _html_table((*_RANK_COLUMNS, "verdict"), rows)
    )
    if summary.links:
        rows = [[*_link_cells(x), describe_link(x) or ""] for x in summary.links]
        page += "<h3>Transfer per link</h3>" + _html_table((*_LINK_COLUMNS, "verdict"), rows)
    return page
