"""Checks of merged MegaScan timelines, shared by the scan tests.

`bind_flows` re-implements the part of Perfetto's JSON importer that decides where a flow
arrow starts and ends (Perfetto v52.0's JSON importer, importers/json/json_trace_parser.cc and
importers/common/flow_tracker.cc: a flow event binds to the innermost slice of its own thread enclosing its timestamp, and the slice that
*starts earlier* becomes the arrow's source), so the direction invariants are tested
everywhere. `run_perfetto_check` asks Perfetto's own trace processor (`megatronapp trace check`).
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def _innermost(slices: list[tuple], ts: float) -> tuple | None:
    """The slice enclosing ts that started last (ties: the shorter one); slices sorted by start."""
    hi = bisect.bisect_right(slices, (ts + 5e-4, float("inf")))
    best = None
    for start, neg_dur, name in slices[:hi]:
        if start - 5e-4 <= ts <= start - neg_dur + 5e-4:
            best = (start, -neg_dur, name)
    return best


def bind_flows(doc: dict) -> list[tuple[tuple, tuple]]:
    """(source slice, destination slice) of every arrow, each slice as (start us, dur us, name).

    Asserts that every flow event has an enclosing slice on its own thread."""
    slices = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            slices[e["pid"], e["tid"]].append((e["ts"], -e["dur"], e["name"]))
    for v in slices.values():
        v.sort()
    chains = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            bound = _innermost(slices[e["pid"], e["tid"]], e["ts"])
            assert bound is not None, f"flow event without an enclosing slice: {e}"
            chains[e["id"], e["name"]].append((e["ph"], e["ts"], bound))
    arrows = []
    for chain in chains.values():
        chain.sort(key=lambda x: ({"s": 0, "t": 1, "f": 2}[x[0]], x[1]))
        assert [p for p, _, _ in chain].count("s") == 1 and chain[-1][0] == "f", chain
        arrows += [(a[2], b[2]) for a, b in zip(chain, chain[1:])]
    return arrows


def assert_flows_forward(doc: dict) -> list[tuple[tuple, tuple]]:
    """Every arrow's source slice starts no later than its destination (so Perfetto keeps the
    direction we wrote) and no arrow leaves a recv or enters a send. Returns the arrows."""
    arrows = bind_flows(doc)
    for src, dst in arrows:
        assert src[0] <= dst[0] + 5e-4, f"arrow {src} -> {dst}: the destination starts first"
        assert "recv" not in src[2].lower() and "send" not in dst[2].lower(), f"backward arrow {src} -> {dst}"
    return arrows


def run_perfetto_check(path: Path) -> dict:
    """Perfetto's report on `path` (`megatronapp trace check --json`)."""
    command = [sys.executable, "-m", "megatronapp.cli.main", "trace", "check", str(path), "--json"]
    res = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return json.loads(res.stdout)


def assert_perfetto_reads_flows(path: Path, expected_flows: int) -> dict:
    """0 import errors, 0 backward flows, no dropped flow events, exactly `expected_flows` arrows."""
    report = run_perfetto_check(path)
    assert report["import_errors"] == [], report["import_errors"]
    assert report["backward_flows"] == 0, report["flow_kinds"]
    assert report["flow_notes"] == [], report["flow_notes"]  # e.g. flow_end_without_start
    assert report["flows"] == expected_flows, (report["flows"], expected_flows)
    return report
