"""`megatronapp trace check TIMELINE`: what Perfetto's own trace processor makes of a timeline.

Reports slices, tracks, import errors (rows of Perfetto's `stats` table with severity error or
data_loss) and flow arrows, with those bound backwards: an arrow leaving a slice named *recv* or
entering one named *send*. Perfetto makes the slice that starts earlier an arrow's source, so a
receive that starts before its send turns the arrow round; the merge ends arrows on an "arrival"
slice to prevent that, and this check is how it is verified.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatronapp.scan.perfetto.engine import EngineError, engine_name, open_trace

_COUNTS = """select (select count(*) from slice) as slices, (select count(*) from track) as tracks,
  (select count(distinct utid) from thread_track) as threads,
  (select count(*) from process where upid != 0) as processes, (select count(*) from flow) as flows"""
_ERRORS = """select name, idx, severity, source, value, description from stats
  where severity in ('error', 'data_loss') and value != 0 order by name, idx"""
_FLOW_NOTES = "select name, value from stats where name glob 'flow_*' and severity = 'info' and value != 0"
_FLOW_KINDS = """select coalesce(so.name, '') as out_name, coalesce(si.name, '') as in_name, count(*) as n,
  sum(so.track_id = si.track_id) as same_track
  from flow f join slice so on so.id = f.slice_out join slice si on si.id = f.slice_in
  group by 1, 2 order by n desc, 1, 2"""


def _rows(tp: Any, sql: str) -> list[dict]:
    return [vars(r) for r in tp.query(sql)]


def is_backward(out_name: str, in_name: str) -> bool:
    """An arrow that leaves a receive or enters a send runs against its message."""
    return "recv" in out_name.lower() or "send" in in_name.lower()


def check_timeline(path: str | os.PathLike) -> dict:
    """The report as a dict: counts, import_errors, flow_notes, backward_flows, same_track_flows,
    flow_kinds (the 50 most frequent (out name, in name) pairs) and ok."""
    tp = open_trace(path)
    try:
        report = {"trace": str(path), "engine": engine_name(), **_rows(tp, _COUNTS)[0]}
        report["import_errors"] = _rows(tp, _ERRORS)
        report["flow_notes"] = _rows(tp, _FLOW_NOTES)
        kinds = _rows(tp, _FLOW_KINDS)
    finally:
        tp.close()
    for kind in kinds:
        kind["backward"] = is_backward(kind["out_name"], kind["in_name"])
    report["backward_flows"] = sum(k["n"] for k in kinds if k["backward"])
    report["same_track_flows"] = sum(k["same_track"] for k in kinds)
    report["flow_kinds"] = kinds[:50]
    report["ok"] = not report["import_errors"] and not report["backward_flows"]
    return report


def render_check(report: dict) -> str:
    """The report as text, ending in "ok" or "FAIL: ..."."""
    lines = [
        f"{report['trace']}: Perfetto trace_processor {report['engine']} (WebAssembly)",
        f"slices         {report['slices']}",
        f"tracks         {report['tracks']}  (threads {report['threads']}, processes {report['processes']})",
        f"import errors  {len(report['import_errors'])}",
    ]
    for e in report["import_errors"]:
        idx = "" if e["idx"] is None else f"[{e['idx']}]"
        lines.append(f"  {e['name']}{idx} = {e['value']}  ({e['severity']}) {e['description'] or ''}".rstrip())
    lines += [
        f"flows          {report['flows']}",
        f"  backward     {report['backward_flows']}  (out slice named *recv* or in slice named *send*)",
        f"  same track   {report['same_track_flows']}",
    ]
    lines += [f"  {n['name']} = {n['value']}  (info: flow events Perfetto dropped)" for n in report["flow_notes"]]
    if report["flow_kinds"]:
        lines.append("flows by slice names (out -> in):")
    for k in report["flow_kinds"][:10]:
        lines.append(f"  {k['n']:>8}  {k['out_name']} -> {k['in_name']}{'  BACKWARD' if k['backward'] else ''}")
    lines.append("ok" if report["ok"] else "FAIL: import errors or backward flows")
    return "\n".join(lines)


def query_timeline(path: str | os.PathLike, sql: str) -> tuple[list[str], list[list]]:
    """Column names and rows of one Perfetto SQL query over `path`; EngineError if it fails."""
    tp = open_trace(path)
    try:
        result = tp.query(sql)
        names = list(result.column_names)
        return names, [[getattr(r, c) for c in names] for r in result]
    except EngineError:
        raise
    except Exception as exc:  # the engine's SQL error
        raise EngineError(f"query failed: {exc}") from None
    finally:
        tp.close()


def format_rows(names: list[str], table: list[list], as_json: bool) -> str:
    """Query rows as TSV (header first) or a JSON list of objects."""
    if as_json:
        return json.dumps([dict(zip(names, row)) for row in table], indent=1, default=repr)
    cell = lambda v: "" if v is None else str(v).replace("\t", " ").replace("\n", " ")
    return "\n".join("\t".join(cell(v) for v in row) for row in [names, *table])
