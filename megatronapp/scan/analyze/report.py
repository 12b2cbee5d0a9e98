"""`megatronapp trace report DIR --out report.html`: one self-contained page about a traced run.

The page says what was found and why: the verdict with its evidence (who arrived last at which
collectives and by how much; each link's effective bandwidth against its peers), or plainly that
nothing was found and how large a fault the check would have named; step time per rank; own work
against waiting per rank and iteration (stacked); each rank's time budget and each link's per-byte time
(budget_output.py); the clock alignment in ms/us. Every chart has
axes with units and a legend. Inline SVG only: no script, no CDN, no network. The numbers come
from report_data.compute_report_data (pure); this module only draws them.
"""

from __future__ import annotations

import html
import os

from megatronapp.files import write_text_atomic
from megatronapp.scan.analyze import detect_arrival as arrivals
from megatronapp.scan.analyze.budget_output import render_budget_html
from megatronapp.scan.analyze.load_align_detect import TraceAnalysis
from megatronapp.scan.analyze.report_data import ReportData, compute_report_data, describe_layout, format_duration_ns

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
_SUSPECT, _OWN, _WAIT = "#d62728", "#1f77b4", "#ffbb78"
_MAX_LINES = 16  # ranks drawn as separate lines / small charts; the page says when more were left out
_PAD_L, _PAD_B, _PAD_T = 56, 40, 14


def _ticks(top: float, n: int = 4) -> list[float]:
    return [top * k / n for k in range(n + 1)]


def _axes(width: int, height: int, top: float, its: tuple[int, ...], x, y_label: str) -> list[str]:
    """Y axis with ms ticks, x axis with iteration ticks, both labelled."""
    base = height - _PAD_B
    parts = [
        f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{base}" stroke="#444"/>',
        f'<line x1="{_PAD_L}" y1="{base}" x2="{width - 10}" y2="{base}" stroke="#444"/>',
    ]
    for v in _ticks(top):
        yv = base - v / top * (base - _PAD_T)
        parts.append(
            f'<text x="{_PAD_L - 4}" y="{yv + 3:.1f}" font-size="10" text-anchor="end">{v:.3g}</text>'
            f'<line x1="{_PAD_L - 3}" y1="{yv:.1f}" x2="{_PAD_L}" y2="{yv:.1f}" stroke="#444"/>'
        )
    step = max(1, len(its) // 8)
    for i in its[::step]:
        parts.append(f'<text x="{x(i):.1f}" y="{base + 13}" font-size="10" text-anchor="middle">{i}</text>')
    parts.append(
        f'<text x="{(width + _PAD_L) / 2}" y="{height - 6}" font-size="11" text-anchor="middle">iteration</text>'
    )
    parts.append(
        f'<text x="12" y="{(base + _PAD_T) / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {(base + _PAD_T) / 2})">{y_label}</text>'
    )
    return parts


def _legend(entries: list[tuple[str, str]], width: int) -> str:
    items = "".join(
        f'<span style="display:inline-block;margin-right:1em"><span style="display:inline-block;'
        f'width:12px;height:12px;background:{c};vertical-align:middle"></span> {html.escape(t)}</span>'
        for t, c in entries
    )
    return f'<div style="max-width:{width}px;font-size:12px">{items}</div>'


def svg_step_time(data: ReportData, width: int = 760, height: int = 260) -> str:
    its, values = data.iterations, [v for per in data.step_ms.values() for v in per.values()]
    if not its or not values:
        return "<p>No complete iterations.</p>"
    top = max(values) * 1.1 or 1.0
    x = {i: _PAD_L + 8 + k * (width - _PAD_L - 26) / max(len(its) - 1, 1) for k, i in enumerate(its)}.get
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        *_axes(width, height, top, its, x, "step time (ms)"),
    ]
    suspects, legend = {s["rank"] for s in data.verdict["suspects"] if s["cause"] == "slow_compute"}, []
    for k, r in enumerate(data.ranks[:_MAX_LINES]):
        colour = _SUSPECT if r in suspects else _COLOURS[k % len(_COLOURS)]
        pts = " ".join(
            f"{x(i):.1f},{height - _PAD_B - v / top * (height - _PAD_B - _PAD_T):.1f}"
            for i, v in sorted(data.step_ms[r].items())
        )
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="{2.5 if r in suspects else 1.2}" '
            f'points="{pts}"><title>rank {r}</title></polyline>'
        )
        legend.append((f"rank {r}" + (" (suspect)" if r in suspects else ""), colour))
    return "".join(parts) + "</svg>" + _legend(legend, width)


def svg_work_vs_wait(data: ReportData, width: int = 370, height: int = 170) -> str:
    """One small stacked-column chart per rank: own work below, waiting on others above."""
    its = data.iterations
    if not its:
        return ""
    top = max((data.step_ms[r].get(i, 0.0) for r in data.ranks for i in its), default=0.0) * 1.05 or 1.0
    slot = (width - _PAD_L - 14) / len(its)
    x = {i: _PAD_L + 4 + (k + 0.5) * slot for k, i in enumerate(its)}.get
    scale = (height - _PAD_B - _PAD_T) / top
    charts = []
    for r in data.ranks[:_MAX_LINES]:
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
            f'<text x="{_PAD_L + 4}" y="11" font-size="11" font-weight="bold">rank {r}</text>',
            *_axes(width, height, top, its, x, "ms"),
        ]
        for i in its:
            total, wait = data.step_ms[r].get(i, 0.0), data.wait_ms[r].get(i, 0.0)
            own, base = total - wait, height - _PAD_B
            for lo, hi, colour, what in ((0.0, own, _OWN, "own work"), (own, total, _WAIT, "waiting")):
                parts.append(
                    f'<rect x="{x(i) - slot * 0.4:.1f}" y="{base - hi * scale:.1f}" width="{slot * 0.8:.1f}" '
                    f'height="{max(0.0, (hi - lo) * scale):.1f}" fill="{colour}"><title>rank {r}, iteration {i}: '
                    f"{what} {hi - lo:.2f} ms</title></rect>"
                )
        charts.append("".join(parts) + "</svg>")
    legend = _legend(
        [
            ("own work (step time minus waiting)", _OWN),
            ("waiting on others (collectives before the last arrival, receives before the data)", _WAIT),
        ],
        2 * width,
    )
    return legend + '<div style="display:flex;flex-wrap:wrap">' + "".join(charts) + "</div>"


def _arrival_table(st) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(g)}</td><td>{q}</td><td>{i}</td><td>{x / 1e6:.2f}</td></tr>" for g, q, i, x in st.worst
    )
    return (
        f"<p>Rank {st.rank} was last into {st.last_share:.0%} of {st.samples} {st.family.upper()} collectives "
        f"and caused {st.wait_share:.0%} of the waiting there (a fair share is {st.expected_share:.0%}), a median {format_duration_ns(st.median_lateness_ns)} after its "
        f"peers; its own work since the group last synchronised was {st.ratio:.2f}\u00d7 theirs.</p>"
        f"<table><tr><th>group</th><th>seq</th><th>iteration</th><th>late by (ms)</th></tr>{rows}</table>"
    )


def _links_table(data: ReportData, slow: set[tuple]) -> str:
    if not data.links:
        return ""
    bold = ' style="color:#d62728;font-weight:bold"'
    rows = "".join(
        f"<tr{bold if (b.src, b.dst) in slow else ''}>"
        f"<td>{b.src}\u2192{b.dst}</td><td>{b.messages}</td><td>{b.median_bytes / 1024:.1f}</td>"
        f"<td>{b.transfer_ms:.2f}</td><td>{b.mbit_s:.1f}</td></tr>"
        for b in data.links
    )
    return (
        "<table><tr><th>link</th><th>messages</th><th>median size (KiB)</th><th>median transfer (ms)</th>"
        f"<th>effective bandwidth (Mbit/s)</th></tr>{rows}</table>"
    )


def _verdict_html(data: ReportData) -> str:
    verdict = data.verdict
    if not verdict["suspects"]:
        return _clean_html(data)
    items = []
    for s in verdict["suspects"]:
        what = f"slow link {s['link'][0]}\u2192{s['link'][1]}" if s["link"] else f"rank {s['rank']}: {s['cause']}"
        w, evidence = s["what_if"], ""
        if s["cause"] == "slow_compute" and s["rank"] in data.arrivals:
            evidence = _arrival_table(data.arrivals[s["rank"]])
        items.append(
            f"<li><b>{what}</b> (confidence {s['confidence']:.2f}): {html.escape(s['evidence']['summary'])}. "
            f"If fixed: {w['iteration_if_fixed_ms']} ms per iteration instead of {w['iteration_ms']} ms."
            f"{evidence}</li>"
        )
    victims = ", ".join(f"rank {v['rank']} ({v['wait_ms_per_iteration']} ms/iteration)" for v in verdict["victims"])
    slow = {tuple(s["link"]) for s in verdict["suspects"] if s["link"]}
    links = f"<h3>Effective bandwidth per link</h3>{_links_table(data, slow)}" if slow else ""
    return f"<ol>{''.join(items)}</ol>" + (f"<p>Waiting on them: {victims}</p>" if victims else "") + links


def _measured_links_html(verdict: dict) -> str:
    """The link probe's table: MB/s per directed link, its comparable links' median and the ratio."""
    rows = "".join(
        f"<tr><td>{r['src']}\u2192{r['dst']}</td><td>{r['kind']}</td><td>{r['mbytes_per_s']}</td>"
        f"<td>{'-' if r['peer_mbytes_per_s'] is None else r['peer_mbytes_per_s']}</td>"
        f"<td>{'-' if r['ratio'] is None else format(r['ratio'], '.2f')}</td></tr>"
        for r in verdict.get("links_measured", [])
    )
    if not rows:
        return ""
    return (
        "<h3>Links measured (link probe)</h3><table><tr><th>link</th><th>kind</th><th>MB/s</th>"
        f"<th>comparable links (MB/s)</th><th>ratio</th></tr>{rows}</table>"
    )


def _gate_html(verdict: dict) -> str:
    """What the impact gate held back and which suspects are ambiguous."""
    below = verdict.get("below_impact", [])
    lines = [f"<p>Ambiguous: {html.escape(a)}.</p>" for a in verdict.get("ambiguous", [])]
    if below and verdict["suspects"]:
        top = below[0]
        lines.append(
            f"<p>Not named (below {verdict['min_impact']:.0%} of the iteration): {html.escape(top['candidate'])}, "
            f"{top['share']:.1%}.</p>"
        )
    return "".join(lines)


def _nothing_found(data: ReportData) -> str:
    below = data.verdict.get("below_impact", [])
    if below:
        top = below[0]
        return (
            f"Nothing costing more than {data.verdict['min_impact']:.0%} of the iteration was found; the largest "
            f"candidate: {top['candidate']}, {top['share']:.1%} of the iteration."
        )
    unjoined = data.verdict.get("unjoined_ranks", [])
    if not unjoined:
        return "Nothing was found: no slow rank and no slow link."
    return f"Nothing was found among the ranks that could be joined; ranks {unjoined} could not be (see the notes)."


def _clean_html(data: ReportData) -> str:
    t = data.thresholds
    closest = max(data.arrivals.values(), key=lambda st: st.ratio, default=None)
    seen = (
        f" The closest any rank came: rank {closest.rank}, own work {closest.ratio:.2f}\u00d7 its peers' "
        f"before its arrivals, causing {closest.wait_share:.0%} of the waiting at them."
        if closest
        else ""
    )
    return (
        f"<p><b>{html.escape(_nothing_found(data))}</b></p><p>How sensitive the check was: it "
        f"names a rank whose own work is at least {t['compute_min_ratio']}\u00d7 its peers' in at least "
        f"{t['compute_min_consistency']:.0%} of the iterations (or, intermittently, in a few iterations a clean run "
        f"would show with probability under {t['intermittent_alpha']}), or that causes at least "
        f"{arrivals.min_wait_share(0.5, t['arrival_min_excess_share']):.0%} (2 members) / "
        f"{arrivals.min_wait_share(0.25, t['arrival_min_excess_share']):.0%} (4 members) of the waiting at its "
        f"collectives by its own work; and a link whose transfers take at least "
        f"{t['link_min_ratio']}\u00d7 and {t['link_min_excess_ns'] / 1e6:.1f} ms more than comparable links'.{seen}</p>"
        + (f"<h3>Effective bandwidth per link</h3>{_links_table(data, set())}" if data.links else "")
    )


def render_report_html(data: ReportData, title: str, timeline: str | None) -> str:
    """The whole page as one string (no external resources)."""
    v, a = data.verdict, data.alignment
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in v["notes"])
    more = f"<p>{len(data.ranks) - _MAX_LINES} more ranks are not drawn.</p>" if len(data.ranks) > _MAX_LINES else ""
    open_how = (
        (
            f'<p>Timeline: <a href="{html.escape(timeline)}">{html.escape(timeline)}</a>. Open '
            f'<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> and drop the file on it ("Open trace '
            "file\"); arrows run from each send to the message's arrival and through each collective in "
            "arrival order.</p>"
        )
        if timeline
        else "<p>No merged timeline: run <code>megatronapp trace merge</code>.</p>"
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}}h2{{margin-top:1.5em}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>Layout {describe_layout(v["layout"], len(data.ranks))}; {len(data.iterations)} iterations
analysed; median iteration {v["what_if"]["iteration_ms"]} ms
(all suspects fixed: {v["what_if"]["iteration_if_all_fixed_ms"]} ms).</p>
<h2>Verdict</h2>{_verdict_html(data)}{_gate_html(v)}{_measured_links_html(v)}<ul>{notes}</ul>
<h2>Step time per rank</h2>{svg_step_time(data)}
<h2>Own work and waiting, per rank and iteration</h2>{svg_work_vs_wait(data)}{more}
<h2>Time budget</h2>{render_budget_html(data.budget) if data.budget else ""}
<h2>Timeline</h2>{open_how}
<p>Clock alignment: median residual {format_duration_ns(a.get("median_residual_ns"))},
{a.get("violations")} causality violations left.</p></body></html>
"""


def write_report(analysis: TraceAnalysis, out: str | os.PathLike, title: str, timeline: str | None) -> None:
    """Render and write atomically (temp file + os.replace)."""
    write_text_atomic(out, render_report_html(compute_report_data(analysis), title, timeline))
