"""`megatronapp trace report DIR --out report.html`: one self-contained page about a traced run.

The page has per-rank step-time lines, a rank x iteration heatmap of collective wait (time a
rank spent in collectives before their last member arrived), the detection verdict with its
evidence and what-if estimate, and how to open the timeline in Perfetto. Plots are inline SVG:
no script, no CDN, no network. `compute_report_data` is pure (analysis in, numbers out);
`render_report_html` only draws them.
"""

from __future__ import annotations

import html
import os
from collections import defaultdict
from dataclasses import dataclass

from megatronapp.files import write_text_atomic
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.analyze.analysis import TraceAnalysis
from megatronapp.scan.analyze.detect import report_to_json
from megatronapp.scan.merge.matching import index_comm_events

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_MAX_LINES = 16  # ranks drawn as separate step-time lines; the rest as a min-max band


@dataclass(frozen=True)
class ReportData:
    iterations: tuple[int, ...]
    ranks: tuple[int, ...]
    step_ms: dict[int, dict[int, float]]  # rank -> iteration -> step time
    wait_ms: dict[int, dict[int, float]]  # rank -> iteration -> collective wait
    verdict: dict  # detect.report_to_json
    alignment: dict


def compute_report_data(analysis: TraceAnalysis) -> ReportData:
    """Step time and collective wait per rank and analysed iteration, plus the verdict."""
    events = {t.rank: rules.build_rank_events(t) for t in analysis.traces}
    its = analysis.detection.iterations_analyzed
    step = {r: {i: (e - s) / 1e6 for i, (s, e) in rules.compute_iteration_spans(ev).items() if i in its}
            for r, ev in events.items()}
    wait: dict[int, dict[int, float]] = {r: defaultdict(float) for r in events}
    for inst in rules.collect_collectives(index_comm_events(analysis.traces), events, set(its)):
        for r, (start, _) in inst.spans.items():
            wait[r][inst.iteration] += (inst.last_start - start) / 1e6
    return ReportData(tuple(its), tuple(sorted(events)), step, {r: dict(w) for r, w in wait.items()},
                      report_to_json(analysis.detection), analysis.alignment.to_dict())


def _svg_lines(data: ReportData, width: int = 760, height: int = 260) -> str:
    its, pad = data.iterations, 40
    values = [v for per in data.step_ms.values() for v in per.values()]
    if not its or not values:
        return "<p>No complete iterations.</p>"
    top = max(values) * 1.1 or 1.0
    x = {i: pad + k * (width - 2 * pad) / max(len(its) - 1, 1) for k, i in enumerate(its)}

    def y(v: float) -> float:
        return height - pad - v / top * (height - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>',
             f'<text x="4" y="{pad - 8}" font-size="11">{top:.1f} ms</text>',
             f'<text x="{width / 2}" y="{height - 8}" font-size="11">iteration {its[0]}..{its[-1]}</text>']
    suspects = {s["rank"] for s in data.verdict["suspects"]}
    for k, r in enumerate(data.ranks[:_MAX_LINES]):
        pts = " ".join(f"{x[i]:.1f},{y(v):.1f}" for i, v in sorted(data.step_ms[r].items()))
        colour = "#d62728" if r in suspects else _COLOURS[k % len(_COLOURS)]
        width_ = 2.5 if r in suspects else 1.2
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="{width_}" points="{pts}">'
                     f"<title>rank {r}</title></polyline>")
    parts.append("</svg>")
    return "".join(parts)


def _svg_heatmap(data: ReportData, cell: int = 14) -> str:
    its, ranks = data.iterations, data.ranks
    if not its:
        return ""
    top = max((v for per in data.wait_ms.values() for v in per.values()), default=0.0) or 1.0
    left, head = 70, 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + cell * len(its) + 10}" '
             f'height="{head + cell * len(ranks) + 10}" role="img">']
    for row, r in enumerate(ranks):
        parts.append(f'<text x="2" y="{head + row * cell + cell - 3}" font-size="10">rank {r}</text>')
        for col, i in enumerate(its):
            v = data.wait_ms[r].get(i, 0.0)
            shade = int(255 - 200 * v / top)
            parts.append(f'<rect x="{left + col * cell}" y="{head + row * cell}" width="{cell - 1}" '
                         f'height="{cell - 1}" fill="rgb(255,{shade},{shade})"><title>rank {r}, iteration {i}: '
                         f"{v:.2f} ms waiting in collectives</title></rect>")
    parts.append(f'<text x="{left}" y="12" font-size="10">iterations {its[0]}..{its[-1]} '
                 f"(darker: more wait, max {top:.2f} ms)</text></svg>")
    return "".join(parts)


def _verdict_html(verdict: dict) -> str:
    if not verdict["suspects"]:
        return "<p><b>No slow rank or slow link found.</b></p>"
    items = []
    for s in verdict["suspects"]:
        what = f"slow link {s['link'][0]}&rarr;{s['link'][1]}" if s["link"] else f"rank {s['rank']}: {s['cause']}"
        w = s["what_if"]
        items.append(f"<li><b>{what}</b> (confidence {s['confidence']:.2f}): "
                     f"{html.escape(s['evidence']['summary'])}. If fixed: {w['iteration_if_fixed_ms']} ms per "
                     f"iteration instead of {w['iteration_ms']} ms.</li>")
    victims = ", ".join(f"rank {v['rank']} ({v['wait_ms_per_iteration']} ms/iteration)" for v in verdict["victims"])
    return f"<ol>{''.join(items)}</ol>" + (f"<p>Waiting on them: {victims}</p>" if victims else "")


def render_report_html(data: ReportData, title: str, timeline: str | None) -> str:
    """The whole page as one string (no external resources)."""
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data.verdict["notes"])
    open_how = (f'<p>Timeline: <a href="{html.escape(timeline)}">{html.escape(timeline)}</a>. Open '
                f'<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> and drop the file on it ("Open trace '
                "file\"); arrows run from each send to the message's arrival and through each collective in "
                "arrival order.</p>") if timeline else "<p>No merged timeline: run <code>megatronapp trace merge</code>.</p>"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}h2{{margin-top:1.5em}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>{len(data.ranks)} ranks, layout {html.escape(str(data.verdict['layout']))}, {len(data.iterations)} iterations
analysed; median iteration {data.verdict['what_if']['iteration_ms']} ms
(all suspects fixed: {data.verdict['what_if']['iteration_if_all_fixed_ms']} ms).</p>
<h2>Verdict</h2>{_verdict_html(data.verdict)}<ul>{notes}</ul>
<h2>Step time per rank (ms)</h2>{_svg_lines(data)}
<h2>Collective wait, rank &times; iteration</h2>{_svg_heatmap(data)}
<h2>Timeline</h2>{open_how}
<p>Clock alignment: median residual {data.alignment.get('median_residual_ns')} ns,
{data.alignment.get('violations')} causality violations left.</p></body></html>
"""


def write_report(analysis: TraceAnalysis, out: str | os.PathLike, title: str, timeline: str | None) -> None:
    """Render and write atomically (temp file + os.replace)."""
    write_text_atomic(out, render_report_html(compute_report_data(analysis), title, timeline))
