"""Chrome Trace Event Format lines from numpy columns, without a per-event Python loop.

The merge (merge.py) hands over one window of rows of many ranks at a time; this module
decides each span's thread (`compute_lanes`: spans sharing a thread must nest, as Chrome "X"
events require) and formats "X", flow and metadata lines with Arrow compute kernels. Lines
come out as one Arrow string array, each line preceded by ",\\n", so a window is written with
one `write` of the array's data buffer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TRACKS = ("step", "compute", "comm", "user")  # cat -> track, in display order
LANES_PER_TRACK = 1000  # tid = track index * this + lane + 1
ARG_COLUMNS = ("iteration", "chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes")


def format_rank_label(meta: dict) -> str:
    """Process name of a rank, e.g. "rank 5 (pp1 dp0 tp1)" or "rank 5 forward (pp1 dp0 tp0)"."""
    c = meta.get("coords", {})
    role = meta.get("run", {}).get("role")  # MegaFBD: "forward" / "backward" workers
    prefix = f"rank {meta['rank']} {role}" if role else f"rank {meta['rank']}"
    return f"{prefix} (pp{c.get('pp', 0)} dp{c.get('dp', 0)} tp{c.get('tp', 0)})"


def assign_lanes(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Lane per span so that spans sharing a lane nest properly (Chrome "X" events on
    one thread must). Greedy over spans sorted by (start, -end); lane 0 first.

    The reference rule: `compute_lanes` gives the same lanes, vectorised."""
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


def _non_nesting(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Mask of the spans (positive length, sorted by (start, -end), on disjoint time ranges per
    group already) that partially overlap another. Brackets: opens and closes in time order
    (closes first on ties, inner closes first), depth by cumsum; spans nest iff every open is
    closed by the next event back at its depth (last opened, first closed)."""
    m = len(starts)
    times = np.concatenate([starts, ends])
    is_open = np.concatenate([np.ones(m, bool), np.zeros(m, bool)])
    ids = np.concatenate([np.arange(m), np.arange(m)])
    events = np.lexsort((np.where(is_open, ids, -ids), is_open, times))
    opening = is_open[events]
    depth = np.cumsum(np.where(opening, 1, -1))
    level = depth + ~opening  # a close sits at the depth before it
    paired = events[np.argsort(level, kind="stable")]
    first, second = ids[paired[0::2]], ids[paired[1::2]]
    bad = np.zeros(m, bool)
    mismatch = first != second
    bad[first[mismatch]] = bad[second[mismatch]] = True
    return bad


def compute_lanes(group: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """assign_lanes applied within each group (e.g. one rank's track), vectorised.

    Spans split into clusters (a new one starts where a span begins after every earlier span
    of its group ended); clusters are independent under the greedy rule. A cluster whose spans
    all nest is lane 0 throughout; only the others run the greedy loop."""
    n = len(starts)
    lanes = np.zeros(n, np.int64)
    if n == 0:
        return lanes
    order = np.lexsort((-ends, starts, group))
    g = np.unique(group[order], return_inverse=True)[1].astype(np.int64)
    base = int(starts.min())
    width = int(max(ends.max(), starts.max())) - base + 1
    s, e = g * width + (starts[order] - base), g * width + (ends[order] - base)  # groups on disjoint ranges
    new = np.ones(n, bool)
    new[1:] = s[1:] >= np.maximum.accumulate(e)[:-1]
    cluster = np.cumsum(new) - 1
    size = np.bincount(cluster)
    bad_cluster = np.zeros(len(size), bool)
    pairs = np.flatnonzero(new & (size[cluster] == 2))  # first of a two-span cluster
    bad_cluster[cluster[pairs]] = e[pairs + 1] > e[pairs]
    big = np.flatnonzero((size[cluster] > 2) & (e > s))  # zero-length spans always fit lane 0
    if len(big):
        bad_cluster[cluster[big[_non_nesting(s[big], e[big])]]] = True
    for c in np.flatnonzero(bad_cluster).tolist():
        rows = np.arange(np.searchsorted(cluster, c, "left"), np.searchsorted(cluster, c, "right"))
        lanes[order[rows]] = assign_lanes(s[rows].tolist(), e[rows].tolist())
    return lanes


def join(*parts) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def us_strings(ns: np.ndarray) -> pa.Array:
    """Non-negative ns -> microseconds with 3 decimals, exactly (no float rounding)."""
    whole, frac = pa.array(ns // 1000), pa.array(ns % 1000)
    return join(pc.cast(whole, pa.string()), ".", pc.utf8_lpad(pc.cast(frac, pa.string()), width=3, padding="0"))


def ints(values: np.ndarray) -> pa.Array:
    return pc.cast(pa.array(values), pa.string())


def json_vocab(strings: Sequence[str]) -> pa.Array:
    """Each string as a JSON literal, escaped once; take() by vocabulary id."""
    return pa.array([json.dumps(v) for v in strings], pa.string())


def args_strings(cols: dict[str, np.ndarray], vocab_json: pa.Array, empty_id: int) -> pa.Array:
    """The "args" object body of each row: every ARG_COLUMNS value that is not -1 / ""."""
    fragments = []
    for key in ARG_COLUMNS:
        col = cols[key]
        if key in ("op", "group"):
            absent, text = col == empty_id, vocab_json.take(pa.array(col))
        else:
            absent, text = col == -1, ints(col)
        if absent.all():
            continue
        fragments.append(pc.if_else(pa.array(absent), "", join(f'"{key}":', text, ",")))
    if not fragments:
        return pa.array([""] * len(cols["iteration"]), pa.string())
    return pc.utf8_rtrim(join(*fragments) if len(fragments) > 1 else fragments[0], characters=",")


def span_lines(cols: dict[str, np.ndarray], track: np.ndarray, tids: np.ndarray, starts: np.ndarray,
               ends: np.ndarray, vocab_json: pa.Array, empty_id: int) -> pa.Array:
    """",\\n" + one Chrome "X" line per row (times in ns since the timeline origin)."""
    names = pa.array(TRACKS, pa.string()).take(pa.array(track))
    return join(
        ',\n{"ph":"X","name":', vocab_json.take(pa.array(cols["name"])), ',"cat":"', names,
        '","pid":', ints(cols["rank"]), ',"tid":', ints(tids), ',"ts":', us_strings(starts),
        ',"dur":', us_strings(ends - starts), ',"args":{', args_strings(cols, vocab_json, empty_id), "}}",
    )


def flow_lines(ph: np.ndarray, ids: np.ndarray, name: str, ranks: np.ndarray, tids: np.ndarray,
               starts: np.ndarray) -> pa.Array:
    """",\\n" + one v1 flow event per row; ph is "s", "t" or "f" ("t"/"f" bind to the enclosing slice)."""
    ph = pa.array(ph, pa.string())
    bind = pc.if_else(pc.equal(ph, "s"), "", ',"bp":"e"')
    return join(',\n{"ph":"', ph, '","id":', ints(ids), f',"name":"{name}","cat":"flow","pid":', ints(ranks),
                ',"tid":', ints(tids), ',"ts":', us_strings(starts), bind, "}")


def process_lines(meta: dict, sort_index: int) -> list[str]:
    pid = meta["rank"]
    return [
        json.dumps({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": format_rank_label(meta)}}),
        json.dumps({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort_index}}),
        json.dumps({"ph": "M", "name": "process_labels", "pid": pid,
                    "args": {"labels": f"{meta.get('host', '')} {meta.get('device', '')}".strip()}}),
    ]


def thread_lines(rank: int, tid: int) -> list[str]:
    """Name and sort index of thread `tid` of `rank` ("comm", "comm 2", ...)."""
    track, lane = divmod(tid - 1, LANES_PER_TRACK)
    name = TRACKS[track] if lane == 0 else f"{TRACKS[track]} {lane + 1}"
    return [json.dumps({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}),
            json.dumps({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})]


def line_bytes(lines: pa.Array) -> memoryview:
    """The concatenated text of a string array, without copying."""
    if len(lines) == 0:
        return memoryview(b"")
    lines = lines.cast(pa.string()) if lines.type != pa.string() else lines
    offsets = np.frombuffer(lines.buffers()[1], np.int32, len(lines) + 1, lines.offset * 4)
    return memoryview(lines.buffers()[2])[offsets[0]:offsets[-1]]
