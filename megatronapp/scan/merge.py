"""Merge a MegaScan trace directory into one Chrome Trace Event Format JSON.

The output opens in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per
rank, named by its coordinates and ordered by (pp, dp, tp); inside it the tracks
"step", "compute", "comm" (and "user"). Spans are complete events ("X", µs). Flow
arrows (v1 "s"/"t"/"f" events, binding to the enclosing slice) link every send to its
recv and chain the members of each collective instance, one flow id per instance.

Times are aligned first (align.py) and shifted so the earliest event is at 0; the
alignment report, the time origin (wall-clock ns) and merge statistics go to
"otherData". The JSON is written rank by rank, never held whole in memory, to a
temporary file that replaces `out` only when complete; `.gz` outputs are gzipped.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.scan.align import AlignmentReport, align_traces
from megatronapp.scan.format import RankTrace, load_trace_dir

TRACKS = ("step", "compute", "comm", "user")  # cat -> track, in display order
_ARG_COLUMNS = ("iteration", "chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes")
_LANES_PER_TRACK = 1000  # tid = track index * this + lane + 1


@dataclass(frozen=True)
class MergeSummary:
    """What merge_traces wrote."""

    out: str
    ranks: list[int]
    events: int
    flows: int
    seconds: float
    report: AlignmentReport

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Placed:
    """Where comm spans landed (pid, tid, start, end in ns since origin), for flows."""

    sends: dict = field(default_factory=dict)  # (src, dst, seq) -> place
    recvs: dict = field(default_factory=dict)  # (src, dst, seq) -> place
    collectives: dict = field(default_factory=lambda: defaultdict(list))  # (group, seq) -> [place]


def format_rank_label(meta: dict) -> str:
    """Process name of a rank, e.g. "rank 5 (pp1 dp0 tp1)" or "rank 5 forward (pp1 dp0 tp0)"."""
    c = meta.get("coords", {})
    role = meta.get("run", {}).get("role")  # MegaFBD: "forward" / "backward" workers
    prefix = f"rank {meta['rank']} {role}" if role else f"rank {meta['rank']}"
    return f"{prefix} (pp{c.get('pp', 0)} dp{c.get('dp', 0)} tp{c.get('tp', 0)})"


def assign_lanes(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Lane per span so that spans sharing a lane nest properly (Chrome "X" events on
    one thread must). Greedy over spans sorted by (start, -end); lane 0 first."""
    order = np.lexsort((-np.asarray(ends, dtype=np.int64), np.asarray(starts, dtype=np.int64))).tolist()
    starts, ends = list(starts), list(ends)
    stacks: list[list[int]] = []  # per lane: ends of currently open spans
    lanes = [0] * len(starts)
    for k in order:
        s, e = starts[k], ends[k]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or e <= stack[-1]:
                break
        else:
            lane, stack = len(stacks), []
            stacks.append(stack)
        stack.append(e)
        lanes[k] = lane
    return lanes


def _us(ns: int) -> str:
    return f"{ns / 1000:.3f}"


def _metadata_events(meta: dict, sort_index: int, threads: dict[int, str]) -> list[str]:
    pid = meta["rank"]
    out = [
        json.dumps({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": format_rank_label(meta)}}),
        json.dumps({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort_index}}),
        json.dumps({"ph": "M", "name": "process_labels", "pid": pid,
                    "args": {"labels": f"{meta.get('host', '')} {meta.get('device', '')}".strip()}}),
    ]
    for tid, name in sorted(threads.items()):
        out.append(json.dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}))
        out.append(json.dumps({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}))
    return out


# Event lines are formatted column-wise with Arrow compute: a per-event Python loop
# is what limits merge speed on large traces.
def _join(*parts) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def _json_strings(col: pa.DictionaryArray) -> pa.Array:
    """Dictionary column -> JSON string literals, escaping each distinct value once."""
    quoted = pa.array([json.dumps(v) for v in col.dictionary.to_pylist()], pa.string())
    return pa.DictionaryArray.from_arrays(col.indices, quoted).cast(pa.string())


def _us_strings(ns: np.ndarray) -> pa.Array:
    """Non-negative ns -> microseconds with 3 decimals, exactly (no float rounding)."""
    whole, frac = pa.array(ns // 1000), pa.array(ns % 1000)
    return _join(pc.cast(whole, pa.string()), ".", pc.utf8_lpad(pc.cast(frac, pa.string()), width=3, padding="0"))


def _args_strings(events: pa.Table) -> pa.Array:
    """The "args" object body of each event: every column that is not -1 / ""."""
    fragments = []
    for key in _ARG_COLUMNS:
        col = events.column(key).chunk(0)
        if pa.types.is_dictionary(col.type):
            absent, text = pc.equal(col.cast(pa.string()), ""), _json_strings(col)
        else:
            absent, text = pc.equal(col, -1), pc.cast(col, pa.string())
        fragments.append(pc.if_else(absent, "", _join(f'"{key}":', text, ",")))
    return pc.utf8_rtrim(_join(*fragments), characters=",")


def _span_table(trace: RankTrace) -> pa.Table:
    events = trace.events
    events = events.filter(pc.not_equal(events.column("cat").cast(pa.string()), "calib"))
    return events.unify_dictionaries().combine_chunks()


def _track_lanes(events: pa.Table, origin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """Per event: start and end in ns since origin and its tid; plus tid -> thread name."""
    cat = events.column("cat").chunk(0)
    track_of_value = np.array([TRACKS.index(v) if v in TRACKS else TRACKS.index("user")
                               for v in cat.dictionary.to_pylist()] or [0], dtype=np.int64)
    track = track_of_value[cat.indices.to_numpy(zero_copy_only=False)]
    starts = events.column("start_ns").to_numpy() - origin
    ends = np.maximum(events.column("end_ns").to_numpy() - origin, starts)
    tids, threads = np.zeros(len(starts), dtype=np.int64), {}
    for index, name in enumerate(TRACKS):
        rows = np.nonzero(track == index)[0]
        lanes = np.asarray(assign_lanes(starts[rows], ends[rows]), dtype=np.int64)
        tids[rows] = index * _LANES_PER_TRACK + lanes + 1
        for lane in np.unique(lanes).tolist():
            threads[index * _LANES_PER_TRACK + lane + 1] = name if lane == 0 else f"{name} {lane + 1}"
    return starts, ends, tids, threads


def _remember_comm(placed: _Placed, rank: int, events: pa.Table, starts, ends, tids) -> None:
    """Note where each comm span landed, keyed for matching across ranks."""
    rows = np.nonzero(tids // _LANES_PER_TRACK == TRACKS.index("comm"))[0]
    comm = events.take(pa.array(rows, pa.int64()))
    columns = [comm.column(c).cast(pa.string()) if c in ("op", "group") else comm.column(c)
               for c in ("op", "group", "seq", "peer")]
    for (op, group, seq, peer), k in zip(zip(*(c.to_pylist() for c in columns)), rows.tolist()):
        where = (rank, int(tids[k]), int(starts[k]), int(ends[k]))
        if seq < 0:
            continue
        if op == "send" and peer >= 0:
            placed.sends[rank, peer, seq] = where
        elif op == "recv" and peer >= 0:
            placed.recvs[peer, rank, seq] = where
        elif op and group:
            placed.collectives[group, seq].append(where)


def _rank_span_events(trace: RankTrace, origin: int, placed: _Placed) -> tuple[list[str], dict[int, str]]:
    """Chrome "X" lines of one rank and the threads (tid -> name) they use."""
    events = _span_table(trace)
    if events.num_rows == 0:
        return [], {}
    starts, ends, tids, threads = _track_lanes(events, origin)
    track_names = pa.array(TRACKS, pa.string()).take(pa.array(tids // _LANES_PER_TRACK))
    lines = _join(
        '{"ph":"X","name":', _json_strings(events.column("name").chunk(0)),
        ',"cat":"', track_names, f'","pid":{trace.rank},"tid":', pc.cast(pa.array(tids), pa.string()),
        ',"ts":', _us_strings(starts), ',"dur":', _us_strings(ends - starts),
        ',"args":{', _args_strings(events), "}}",
    )
    _remember_comm(placed, trace.rank, events, starts, ends, tids)
    return lines.to_pylist(), threads


def _flow(ph: str, fid: int, name: str, where: tuple, ts: int) -> str:
    pid, tid = where[0], where[1]
    bind = ',"bp":"e"' if ph != "s" else ""
    return f'{{"ph":"{ph}","id":{fid},"name":"{name}","cat":"flow","pid":{pid},"tid":{tid},"ts":{_us(ts)}{bind}}}'


def build_flow_events(placed: _Placed) -> list[str]:
    """Flow lines: send -> matching recv, and a chain through each collective's members
    (ordered by start) with one id per collective instance."""
    lines, fid = [], 0
    for key, send in sorted(placed.sends.items()):
        recv = placed.recvs.get(key)
        if recv is None:
            continue
        fid += 1
        # A point inside the recv, after the send started when causality allows.
        inside = (max(recv[2], min(send[2], recv[3])) + recv[3]) // 2
        lines += [_flow("s", fid, "p2p", send, send[2]), _flow("f", fid, "p2p", recv, inside)]
    for (_, _), members in sorted(placed.collectives.items()):
        if len(members) < 2:
            continue
        fid += 1
        members = sorted(members, key=lambda m: m[2])
        for i, member in enumerate(members):
            ph = "s" if i == 0 else "f" if i == len(members) - 1 else "t"
            lines.append(_flow(ph, fid, "collective", member, member[2]))
    return lines


def _open_output(path: Path) -> tuple[IO[str], str]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    if path.name.endswith(".gz"):
        return gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6), tmp
    return open(tmp, "w", encoding="utf-8"), tmp


def compute_time_origin(traces: list[RankTrace]) -> int:
    """Earliest aligned start of any non-calib event (0 if there is none)."""
    starts = []
    for t in traces:
        ev = t.events.filter(pc.not_equal(t.events.column("cat").cast(pa.string()), "calib"))
        if ev.num_rows:
            starts.append(pc.min(ev.column("start_ns")).as_py())
    return min(starts) if starts else 0


def _sort_indices(traces: list[RankTrace]) -> dict[int, int]:
    def key(t: RankTrace) -> tuple:
        c = t.meta.get("coords", {})
        return (c.get("pp", 0), c.get("dp", 0), c.get("tp", 0), t.rank)

    return {t.rank: i for i, t in enumerate(sorted(traces, key=key))}


def _other_data(traces: list[RankTrace], report: AlignmentReport, origin: int, stats: dict) -> dict:
    first = traces[0].meta
    return {
        "megascan": {
            "run_id": first.get("run_id", ""),
            "run": first.get("run", {}),
            "layout": first.get("layout", {}),
            "ranks": [t.rank for t in traces],
            "partial_ranks": [t.rank for t in traces if t.partial],
            "origin_wall_ns": origin,
            "alignment": report.to_dict(),
            "merge": stats,
        }
    }


def _write_events(out: IO[str], traces: list[RankTrace], origin: int) -> tuple[int, int]:
    """Write every trace event line; returns (span events, flow events)."""
    placed, spans, first = _Placed(), 0, True
    sort_index = _sort_indices(traces)
    for trace in traces:
        lines, threads = _rank_span_events(trace, origin, placed)
        spans += len(lines)
        lines = _metadata_events(trace.meta, sort_index[trace.rank], threads) + lines
        out.write(("" if first else ",\n") + ",\n".join(lines))
        first = False
    flows = build_flow_events(placed)
    if flows:
        out.write(",\n" + ",\n".join(flows))
    return spans, len(flows)


def merge_traces(
    trace_dir: str | os.PathLike,
    out: str | os.PathLike,
    iterations: Container[int] | None = None,
    ranks: Sequence[int] | None = None,
) -> MergeSummary:
    """Load, align and merge `trace_dir` into Chrome trace JSON at `out` (gzip if .gz).

    `iterations`/`ranks` restrict what is merged. Atomic: `out` is replaced only by a
    complete file. Raises what load_trace_dir raises for missing or malformed files."""
    began = time.perf_counter()
    traces, report = align_traces(load_trace_dir(trace_dir, ranks=ranks, iterations=iterations))
    origin = compute_time_origin(traces)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream, tmp = _open_output(path)
    try:
        with stream:
            stream.write('{"traceEvents": [\n')
            spans, flows = _write_events(stream, traces, origin)
            seconds = time.perf_counter() - began
            stats = {"events": spans, "flows": flows, "seconds": round(seconds, 6),
                     "events_per_s": round(spans / seconds, 1) if seconds > 0 else None}
            other = json.dumps(_other_data(traces, report, origin, stats))
            stream.write(f'\n], "displayTimeUnit": "ms", "otherData": {other}}}\n')
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return MergeSummary(out=str(path), ranks=[t.rank for t in traces], events=spans,
                        flows=flows, seconds=seconds, report=report)
