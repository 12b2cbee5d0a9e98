"""Chrome Trace Event Format lines from numpy columns, without a per-event Python loop.

The merge (merge.py) hands over one window of rows of many ranks at a time; this module
decides each span's thread (`compute_lanes`: spans sharing a thread must nest, as Chrome "X"
events require) and formats "X", flow and metadata lines as fixed-width byte blocks
(fixed_lines.py), each line preceded by ",\\n", so a window is written with a few `write` calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from megatronapp.scan.merge.fixed_lines import LineBlock, OutputArena, TextTable
from megatronapp.scan.record.format import SIGNAL_COLUMNS

TRACKS = ("step", "compute", "comm", "user")  # cat -> track, in display order
LANES_PER_TRACK = 1000  # tid = track index * this + lane + 1
ARG_COLUMNS = ("iteration", "chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes", *SIGNAL_COLUMNS)
# Per-rank counter tracks, one value per traced iteration (its "iteration" span's signal), in ms.
COUNTER_TRACKS = {"run delay ms": "run_delay_ns", "throttled ms": "throttled_ns"}


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


def _order_by(key: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Stable order by (key, tie): np.lexsort((tie, key)), but one stable argsort of `key` (fast
    on the nearly sorted rows a trace gives), then a lexsort of the tied runs only."""
    order = np.argsort(key, kind="stable")
    k = key[order]
    tied = np.flatnonzero(k[1:] == k[:-1])
    if len(tied):
        in_run = np.zeros(len(k), bool)
        in_run[tied] = in_run[tied + 1] = True
        at = np.flatnonzero(in_run)  # positions in runs of equal keys
        rows = order[at]
        order[at] = rows[np.lexsort((rows, tie[rows], k[at]))]
    return order


def _dense_ids(values: np.ndarray) -> np.ndarray:
    """Small non-negative ints -> 0, 1, ... in the same order (ids of the distinct values)."""
    if int(values.min()) < 0 or int(values.max()) > 4 * len(values) + 1024:
        return np.unique(values, return_inverse=True)[1].astype(np.int64).reshape(-1)
    present = np.zeros(int(values.max()) + 1, np.int64)
    present[values] = 1
    return (np.cumsum(present) - 1)[values]


def _small_clusters_not_nesting(
    first: np.ndarray, cluster: np.ndarray, size: np.ndarray, s: np.ndarray, e: np.ndarray
) -> np.ndarray:
    """Per cluster, whether the greedy rule puts one of its spans off lane 0; answered for the
    clusters of two and three spans, False for the others. `first`: mask of each cluster's
    first span; spans sorted by (start, -end). In a cluster every span starts before the earlier
    ones have all ended, so the first one, a, stays open: b fits lane 0 iff it ends inside a;
    then c iff it ends inside b when it starts before b's end, else inside a."""
    bad = np.zeros(len(size), bool)
    a = np.flatnonzero(first & (size[cluster] == 2))
    bad[cluster[a]] = e[a + 1] > e[a]
    a = np.flatnonzero(first & (size[cluster] == 3))
    b, c = a + 1, a + 2
    c_fits = np.where(s[c] < e[b], e[c] <= e[b], e[c] <= e[a])
    bad[cluster[a]] = (e[b] > e[a]) | ~c_fits
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
    base = int(starts.min())
    width = int(max(ends.max(), starts.max())) - base + 1
    g = _dense_ids(group)
    if int(g.max()) >= (1 << 62) // width:  # groups cannot share one int64 axis: sort the slow way
        order = np.lexsort((-ends, starts, group))
        g = np.unique(group[order], return_inverse=True)[1].astype(np.int64)
        s, e = g * width + (starts[order] - base), g * width + (ends[order] - base)
    else:
        s, e = g * width + (starts - base), g * width + (ends - base)  # groups on disjoint ranges
        order = _order_by(s, -e)
        s, e = s[order], e[order]
    new = np.ones(n, bool)
    new[1:] = s[1:] >= np.maximum.accumulate(e)[:-1]
    cluster = np.cumsum(new) - 1
    size = np.bincount(cluster)
    bad_cluster = _small_clusters_not_nesting(new, cluster, size, s, e)
    big = np.flatnonzero((size[cluster] > 3) & (e > s))  # zero-length spans always fit lane 0
    if len(big):
        bad_cluster[cluster[big[_non_nesting(s[big], e[big])]]] = True
    for c in np.flatnonzero(bad_cluster).tolist():
        rows = np.arange(np.searchsorted(cluster, c, "left"), np.searchsorted(cluster, c, "right"))
        lanes[order[rows]] = assign_lanes(s[rows].tolist(), e[rows].tolist())
    return lanes


def _arg_present(cols: dict[str, np.ndarray], key: str, empty_id: int) -> np.ndarray:
    return cols[key] != empty_id if key in _STRING_ARGS else cols[key] >= 0


_STRING_ARGS = ("op", "group")
_TRACK_JSON = TextTable([json.dumps(t) for t in TRACKS])


def span_lines(
    cols: dict[str, np.ndarray],
    track: np.ndarray,
    tids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    vocab_json: TextTable,
    empty_id: int,
    arena: OutputArena | None = None,
) -> list[memoryview]:
    """ ",\n" + one Chrome "X" line per row (times in ns since the timeline origin; starts >= 0).

    Rows are laid out in groups of the same args keys (ARG_COLUMNS that are not -1 / ""), so
    a line holds only its own args."""
    present = np.stack([_arg_present(cols, k, empty_id) for k in ARG_COLUMNS], axis=1)
    # bit k = ARG_COLUMNS[k] present; 16 bits, so a stable argsort is a radix sort
    pattern = np.packbits(present, axis=1, bitorder="little").view("<u2").ravel()
    order = np.argsort(pattern, kind="stable")
    bounds = np.flatnonzero(np.diff(pattern[order])) + 1
    out = []
    for rows in np.split(order, bounds):
        if len(rows) == 0:
            continue
        block = (
            LineBlock(len(rows), arena)
            .text(',\n{"ph":"X","name":')
            .field(vocab_json.take(cols["name"][rows]))
            .text(',"cat":')
            .field(_TRACK_JSON.take(track[rows]))
            .text(',"pid":')
            .uint(cols["rank"][rows])
            .text(',"tid":')
            .uint(tids[rows])
            .text(',"ts":')
            .micros(starts[rows])
            .text(',"dur":')
            .micros(ends[rows] - starts[rows])
            .text(',"args":{')
        )
        sep = ""
        for k, key in enumerate(ARG_COLUMNS):
            if present[rows[0], k]:
                block.text(f'{sep}"{key}":')
                values = cols[key][rows]
                block.field(vocab_json.take(values)) if key in _STRING_ARGS else block.uint(values)
                sep = ","
        out.append(block.text("}}").to_bytes())
    return out


def counter_lines(cols: dict[str, np.ndarray], starts: np.ndarray, ends: np.ndarray) -> list[str]:
    """ ",\n" + Chrome "C" events: per rank, each COUNTER_TRACKS signal set at a span's start to its
    value and back to 0 at its end (only the iteration spans carry them: a few per iteration)."""
    lines = []
    for track, column in COUNTER_TRACKS.items():
        for row in np.flatnonzero(cols[column] >= 0):
            rank, value = int(cols["rank"][row]), round(int(cols[column][row]) / 1e6, 3)
            for ts, v in ((starts[row], value), (ends[row], 0)):
                event = {"ph": "C", "name": track, "pid": rank, "ts": round(int(ts) / 1e3, 3), "args": {"ms": v}}
                lines.append(",\n" + json.dumps(event, separators=(",", ":")))
    return lines


_PHASE_NAMES = ('"s"', '"t"', '"f"')
_PHASES = TextTable(_PHASE_NAMES)


def flow_lines(
    ph: np.ndarray,
    ids: np.ndarray,
    name: str,
    ranks: np.ndarray,
    tids: np.ndarray,
    starts: np.ndarray,
    arena: OutputArena | None = None,
) -> list[memoryview]:
    """ ",\n" + one v1 flow event per row; ph 0 "s", 1 "t", 2 "f" ("t"/"f" bind to the enclosing slice)."""
    out = []
    binding = ph > 0
    for binds in (False, True):
        rows = np.flatnonzero(binding == binds)
        if len(rows) == 0:
            continue
        pick = (lambda a: a[rows]) if len(rows) < len(ph) else (lambda a: a)  # all rows: no copies
        phases = pick(ph)
        block = LineBlock(len(rows), arena).text(',\n{"ph":')
        if (phases == phases[0]).all():  # one phase: constant text, the same bytes as the field
            block.text(_PHASE_NAMES[int(phases[0])])
        else:
            block.field(_PHASES.take(phases))
        block = (
            block.text(',"id":')
            .uint(pick(ids))
            .text(f',"name":"{name}","cat":"flow","pid":')
            .uint(pick(ranks))
            .text(',"tid":')
            .uint(pick(tids))
            .text(',"ts":')
            .micros(np.maximum(pick(starts), 0))
            .text(',"bp":"e"}' if binds else "}")
        )
        out.append(block.to_bytes())
    return out


def json_vocab(strings: Sequence[str]) -> TextTable:
    """Each string as a JSON literal, escaped once; taken by vocabulary id."""
    return TextTable([json.dumps(v) for v in strings])


def process_lines(meta: dict, sort_index: int) -> list[str]:
    pid = meta["rank"]
    return [
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


def thread_lines(rank: int, tid: int) -> list[str]:
    """Name and sort index of thread `tid` of `rank` ("comm", "comm 2", ...)."""
    track, lane = divmod(tid - 1, LANES_PER_TRACK)
    name = TRACKS[track] if lane == 0 else f"{TRACKS[track]} {lane + 1}"
    return [
        json.dumps({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}),
        json.dumps({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}),
    ]
