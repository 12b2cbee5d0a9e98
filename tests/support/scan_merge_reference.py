"""REFERENCE for tests: the in-memory merge MegaScan used before the streaming one (merge.py).

Kept as the simple, per-event implementation that the streaming merge must reproduce
(tests/scan/test_scan_merge_stream.py); not used by the package. Its original docstring:

Merge a MegaScan trace directory into one Chrome Trace Event Format JSON.

The output opens in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per
rank, named by its coordinates and ordered by (pp, dp, tp); inside it the tracks
"step", "compute", "comm" (and "user"). Spans are complete events ("X", µs). Flow
arrows (v1 "s"/"t"/"f" events, binding to the enclosing slice) link every send to its
message's *arrival*: a short slice the merge adds inside the recv, at its end. (Perfetto
makes the slice that starts first an arrow's source, and a recv is usually posted before
its send, so an arrow ending on the recv itself would point backwards.) Each collective
instance is one chain through its members in arrival order.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.scan.merge.align import AlignmentReport, align_traces
from megatronapp.scan.merge.matching import CommEnd, CommIndex, MessageKey, add_rank_comm, comm_rows
from megatronapp.scan.record.format import RankTrace, build_event_batch, filter_iterations, load_trace_dir
from megatronapp.spans import ARRIVAL

TRACKS = ("step", "compute", "comm", "user")  # cat -> track, in display order
_ARG_COLUMNS = ("iteration", "chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes")
_LANES_PER_TRACK = 1000  # tid = track index * this + lane + 1
ARRIVAL_NS = 1_000  # length of a message's arrival slice (see place_arrival)


@dataclass(frozen=True)
class MergeSummary:
    """What merge_traces wrote."""

    out: str
    ranks: list[int]
    events: int  # recorded spans
    arrivals: int  # arrival slices added, one per matched p2p message
    flows: int  # flow arrows: one per message, members - 1 per collective instance
    seconds: float
    report: AlignmentReport

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


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
        json.dumps(
            {
                "ph": "M",
                "name": "process_labels",
                "pid": pid,
                "args": {"labels": f"{meta.get('host', '')} {meta.get('device', '')}".strip()},
            }
        ),
    ]
    for tid, name in sorted(threads.items()):
        out.append(json.dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}))
        out.append(
            json.dumps({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        )
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
    """The rank's events without calib rows, one chunk, one dictionary per column."""
    events = trace.events
    events = events.filter(pc.not_equal(events.column("cat").cast(pa.string()), "calib"))
    return events.unify_dictionaries().combine_chunks()


def _track_lanes(events: pa.Table, origin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """Per event: start and end in ns since origin and its tid; plus tid -> thread name."""
    cat = events.column("cat").chunk(0)
    track_of_value = np.array(
        [TRACKS.index(v) if v in TRACKS else TRACKS.index("user") for v in cat.dictionary.to_pylist()] or [0],
        dtype=np.int64,
    )
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


def _rank_span_events(rank: int, events: pa.Table, origin: int) -> tuple[list[str], dict[int, str], dict]:
    """Chrome "X" lines of one rank, the threads (tid -> name) they use, and where each
    row landed: row -> (tid, start ns since origin)."""
    if events.num_rows == 0:
        return [], {}, {}
    starts, ends, tids, threads = _track_lanes(events, origin)
    track_names = pa.array(TRACKS, pa.string()).take(pa.array(tids // _LANES_PER_TRACK))
    lines = _join(
        '{"ph":"X","name":',
        _json_strings(events.column("name").chunk(0)),
        ',"cat":"',
        track_names,
        f'","pid":{rank},"tid":',
        pc.cast(pa.array(tids), pa.string()),
        ',"ts":',
        _us_strings(starts),
        ',"dur":',
        _us_strings(ends - starts),
        ',"args":{',
        _args_strings(events),
        "}}",
    )
    comm = np.flatnonzero(tids // _LANES_PER_TRACK == TRACKS.index("comm"))
    placed = dict(zip(comm.tolist(), zip(tids[comm].tolist(), starts[comm].tolist())))
    return lines.to_pylist(), threads, placed


def place_arrival(send: CommEnd, recv: CommEnd) -> tuple[int, int]:
    """(start, end) of a message's arrival slice on the receiver.

    It ends when the recv completed (the data was there) and starts ARRIVAL_NS earlier, but
    never before the recv began (so it nests inside the recv) nor before the send began
    (Perfetto makes the slice that starts first an arrow's source, so the arrow then runs
    send -> arrival). Only a message that breaks causality (recv done before the send began)
    gets a slice outside its recv, at the send's start."""
    start = max(send.start, recv.start, recv.end - ARRIVAL_NS)
    return start, max(recv.end, start + 1)


def build_arrival_rows(index: CommIndex) -> dict[int, list[tuple[MessageKey, dict]]]:
    """Receiver rank -> (message key, arrival row) for every matched message."""
    out: dict[int, list] = defaultdict(list)
    for key, send, recv in index.messages():
        start, end = place_arrival(send, recv)
        row = {
            "name": ARRIVAL,
            "cat": "comm",
            "start_ns": start,
            "end_ns": end,
            "iteration": recv.iteration,
            "peer": key[0],
            "seq": key[2],
            "bytes": recv.bytes,
        }
        out[recv.rank].append((key, row))
    return out


def _flow(ph: str, fid: int, name: str, rank: int, place: tuple[int, int]) -> str:
    tid, ts = place
    bind = ',"bp":"e"' if ph != "s" else ""
    return f'{{"ph":"{ph}","id":{fid},"name":"{name}","cat":"flow","pid":{rank},"tid":{tid},"ts":{_us(ts)}{bind}}}'


def build_flow_events(index: CommIndex, placed: dict, arrival_rows: dict) -> tuple[list[str], int]:
    """Flow lines and the number of arrows they make.

    A message: "s" at its send's start, "f" at its arrival slice's start, one arrow send ->
    arrival. A collective instance: a chain through its members in arrival order (ties by
    rank), one id per instance, so the arrows lead to the member everybody waited for.
    `placed[(rank, row)]` is where a row landed; `arrival_rows[key]` the arrival's (rank, row)."""
    lines, fid, arrows = [], 0, 0
    for key, send, _ in index.messages():
        fid += 1
        arrive_rank, arrive_row = arrival_rows[key]
        lines += [
            _flow("s", fid, "p2p", send.rank, placed[send.rank, send.row]),
            _flow("f", fid, "p2p", arrive_rank, placed[arrive_rank, arrive_row]),
        ]
        arrows += 1
    for _, members in sorted(index.collectives.items()):
        if len(members) < 2:
            continue
        fid += 1
        members = sorted(members, key=lambda m: (m.start, m.rank))
        for i, m in enumerate(members):
            ph = "s" if i == 0 else "f" if i == len(members) - 1 else "t"
            lines.append(_flow(ph, fid, "collective", m.rank, placed[m.rank, m.row]))
        arrows += len(members) - 1
    return lines, arrows


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


@dataclass(frozen=True)
class _Written:
    spans: int  # recorded spans written
    arrivals: int  # arrival slices added (one per matched message)
    flows: int  # arrows: messages + (members - 1) per collective instance


def _with_rows(events: pa.Table, rows: list[dict]) -> pa.Table:
    if not rows:
        return events
    extra = pa.Table.from_batches([build_event_batch(rows)])
    return pa.concat_tables([events, extra]).unify_dictionaries().combine_chunks()


def _write_events(out: IO[str], traces: list[RankTrace], origin: int) -> _Written:
    """Write every trace event line: each rank's spans and arrival slices, then the flows."""
    tables = {t.rank: _span_table(t) for t in traces}
    index = CommIndex()
    for rank, table in tables.items():
        add_rank_comm(index, rank, comm_rows(table))
    arrivals = build_arrival_rows(index)
    placed, arrival_at, spans, first = {}, {}, 0, True
    sort_index = _sort_indices(traces)
    for trace in traces:
        table = tables.pop(trace.rank)
        spans += table.num_rows
        mine = arrivals.get(trace.rank, [])
        for k, (key, _) in enumerate(mine):
            arrival_at[key] = (trace.rank, table.num_rows + k)
        table = _with_rows(table, [row for _, row in mine])
        lines, threads, rows_placed = _rank_span_events(trace.rank, table, origin)
        placed.update({(trace.rank, row): where for row, where in rows_placed.items()})
        lines = _metadata_events(trace.meta, sort_index[trace.rank], threads) + lines
        out.write(("" if first else ",\n") + ",\n".join(lines))
        first = False
    flow_lines, arrows = build_flow_events(index, placed, arrival_at)
    if flow_lines:
        out.write(",\n" + ",\n".join(flow_lines))
    return _Written(spans, len(arrival_at), arrows)


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
    return write_merged(traces, report, out, began)


def write_merged(
    traces: list[RankTrace], report: AlignmentReport, out: str | os.PathLike, began: float | None = None
) -> MergeSummary:
    """Write aligned `traces` as one Chrome trace JSON at `out`, atomically (gzip if .gz)."""
    began = time.perf_counter() if began is None else began
    origin = compute_time_origin(traces)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream, tmp = _open_output(path)
    try:
        with stream:
            stream.write('{"traceEvents": [\n')
            written = _write_events(stream, traces, origin)
            seconds = time.perf_counter() - began
            spans = written.spans
            stats = {
                "events": spans,
                "arrivals": written.arrivals,
                "flows": written.flows,
                "seconds": round(seconds, 6),
                "events_per_s": round(spans / seconds, 1) if seconds > 0 else None,
            }
            other = json.dumps(_other_data(traces, report, origin, stats))
            stream.write(f'\n], "displayTimeUnit": "ms", "otherData": {other}}}\n')
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return MergeSummary(
        out=str(path),
        ranks=[t.rank for t in traces],
        events=spans,
        arrivals=written.arrivals,
        flows=written.flows,
        seconds=seconds,
        report=report,
    )


def split_output_name(out: str | os.PathLike, first: int, last: int) -> Path:
    """timeline.json.gz -> timeline.iter00010-00019.json.gz (iterations first..last)."""
    path = Path(out)
    name, dot, rest = path.name.partition(".")
    return path.with_name(f"{name}.iter{first:05d}-{last:05d}{dot}{rest}")


def merge_traces_split(
    trace_dir: str | os.PathLike, out: str | os.PathLike, per_file: int, ranks: Sequence[int] | None = None
) -> list[MergeSummary]:
    """Like merge_traces, but one file per `per_file` consecutive traced iterations (named by
    split_output_name), so each stays small enough for the Perfetto UI. Clocks are aligned
    once, on the whole trace. Messages and collectives crossing a file boundary get no arrow."""
    if per_file < 1:
        raise ValueError(f"iterations per file must be >= 1, got {per_file}")
    traces, report = align_traces(load_trace_dir(trace_dir, ranks=ranks))
    present = sorted(set().union(*(set(pc.unique(t.events.column("iteration")).to_pylist()) for t in traces)) - {-1})
    summaries = []
    for k in range(0, len(present), per_file):
        chunk = present[k : k + per_file]
        part = [replace(t, events=filter_iterations(t.events, set(chunk))) for t in traces]
        summaries.append(write_merged(part, report, split_output_name(out, chunk[0], chunk[-1])))
    return summaries
