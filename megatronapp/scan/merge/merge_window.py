"""One window of the streaming merge: rows of many ranks in, Chrome trace text out.

`WindowMerger.merge` takes numpy columns per rank (stream.WindowReader), puts their times on
the aligned timeline (`RankClocks`, array ops), matches messages and collective instances
(matching.py), adds each message's arrival slice, assigns thread lanes and formats every line
(chrome.py). Its state between windows is bounded: the message ends still waiting for their
other end (one window at most), the threads already named, counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatronapp.scan.merge.align import ClockMapping
from megatronapp.scan.merge.chrome import (
    LANES_PER_TRACK,
    TRACKS,
    compute_lanes,
    counter_lines,
    flow_lines,
    json_vocab,
    span_lines,
    thread_lines,
)
from megatronapp.scan.merge.fixed_lines import OutputArena
from megatronapp.scan.merge.matching import (
    CommEnd,
    match_message_keys,
    order_collective_members,
    pack_message_keys,
    unpack_message_keys,
)
from megatronapp.scan.merge.stream import Vocabulary
from megatronapp.scan.record.format import RankTrace
from megatronapp.spans import ARRIVAL, CAT_COMM, RECV, SEND

ARRIVAL_NS = 1_000  # length of a message's arrival slice (see place_arrival)
_PENDING_FIELDS = ("key", "rank", "start", "end", "iteration", "bytes", "tid")


def place_arrival(send: CommEnd, recv: CommEnd) -> tuple[int, int]:
    """(start, end) of a message's arrival slice on the receiver.

    It ends when the recv completed (the data was there) and starts ARRIVAL_NS earlier, but
    never before the recv began (so it nests inside the recv) nor before the send began
    (Perfetto makes the slice that starts first an arrow's source, so the arrow then runs
    send -> arrival). Only a message that breaks causality (recv done before the send began)
    gets a slice outside its recv, at the send's start. `place_arrivals` is the array form."""
    start = max(send.start, recv.start, recv.end - ARRIVAL_NS)
    return start, max(recv.end, start + 1)


def place_arrivals(
    send_start: np.ndarray, recv_start: np.ndarray, recv_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    start = np.maximum(np.maximum(send_start, recv_start), recv_end - ARRIVAL_NS)
    return start, np.maximum(recv_end, start + 1)


@dataclass(frozen=True)
class RankClocks:
    """Per-rank aligned-timeline mapping (align.ClockMapping incl. the collective correction),
    as arrays indexed by rank."""

    offset: np.ndarray
    drift: np.ndarray
    ref: np.ndarray

    @classmethod
    def from_aligned(cls, traces: list[RankTrace]) -> RankClocks:
        size = max((t.rank for t in traces), default=0) + 1
        offset, drift, ref = np.zeros(size, np.int64), np.zeros(size), np.zeros(size, np.int64)
        for t in traces:
            a = t.meta["alignment"]
            offset[t.rank], drift[t.rank], ref[t.rank] = a["offset_ns"], a["drift"], a["ref_ns"]
        return cls(offset, drift, ref)

    def apply(self, rank: np.ndarray, t: np.ndarray) -> np.ndarray:
        out = t + self.offset[rank]
        if self.drift.any():
            out = out + np.rint(self.drift[rank] * (t - self.ref[rank]).astype(np.float64)).astype(np.int64)
        return out

    def apply_one(self, rank: int, t: int) -> int:
        return int(
            ClockMapping(int(self.offset[rank]), float(self.drift[rank]), int(self.ref[rank])).apply(np.int64(t))
        )


def _distinct(keys: np.ndarray) -> np.ndarray:
    """np.unique of non-negative ints; by a bitmap where their range is small (no sort)."""
    if len(keys) == 0:
        return keys
    low, high = int(keys.min()), int(keys.max())
    if high - low > 4 * len(keys) + 4096:
        return np.unique(keys)
    seen = np.zeros(high - low + 1, bool)
    seen[keys - low] = True
    return np.flatnonzero(seen) + low


def _empty_pending() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, np.int64) for k in _PENDING_FIELDS}


def _concat(a: dict, b: dict) -> dict:
    return {k: np.concatenate([a[k], b[k]]) for k in a}


def _take(cols: dict, rows: np.ndarray) -> dict:
    return {k: v[rows] for k, v in cols.items()}


class WindowMerger:
    """Merges windows into Chrome trace text for one output file; see the module docstring."""

    def __init__(self, vocab: Vocabulary, clocks: RankClocks, origin: int) -> None:
        self.vocab, self.clocks, self.origin = vocab, clocks, origin
        ids = {name: vocab.id_of(name) for name in ("", CAT_COMM, SEND, RECV, ARRIVAL, *TRACKS)}
        self._empty, self._comm, self._send, self._recv, self._arrival = (
            ids[k] for k in ("", CAT_COMM, SEND, RECV, ARRIVAL)
        )
        self._sends, self._recvs = _empty_pending(), _empty_pending()
        self._threads: set[int] = set()
        self._arena = OutputArena()  # the lines of one window; reused by the next
        self._vocab_json = json_vocab(vocab.strings)  # each string as a JSON literal, by id
        self._next_flow = 0
        self.spans = self.arrivals = self.flows = self.unmatched = self.peak_rows = self.peak_pending = 0

    def stats(self) -> dict:
        return {
            "events": self.spans,
            "arrivals": self.arrivals,
            "flows": self.flows,
            "unmatched": self.unmatched,
            "peak_window_rows": self.peak_rows,
            "peak_pending": self.peak_pending,
        }

    def finish(self) -> bytes:
        """Count the message ends still waiting: their other end never came."""
        self.unmatched += len(self._sends["key"]) + len(self._recvs["key"])
        self._sends, self._recvs = _empty_pending(), _empty_pending()
        return b""

    def _track_of(self, cat: np.ndarray) -> np.ndarray:
        lookup = np.full(len(self.vocab.strings), TRACKS.index("user"), np.int64)
        for k, name in enumerate(TRACKS):
            lookup[self.vocab.id_of(name)] = k
        return lookup[cat]

    def merge(self, per_rank: dict[int, dict[str, np.ndarray]]) -> list:
        """Chrome trace text (",\\n" + line, per line) of one window of rows of every rank, as
        buffers to write in turn; they stay valid until the next call."""
        self._arena.reset()
        if not per_rank:
            return []
        cols = {k: np.concatenate([c[k] for c in per_rank.values()]) for k in next(iter(per_rank.values()))}
        cols["rank"] = np.repeat(
            np.fromiter(per_rank, np.int64, len(per_rank)), [len(c["iteration"]) for c in per_rank.values()]
        )
        self.spans += len(cols["rank"])
        cols["start_ns"] = self.clocks.apply(cols["rank"], cols["start_ns"]) - self.origin
        cols["end_ns"] = self.clocks.apply(cols["rank"], cols["end_ns"]) - self.origin
        sends, recvs = self._message_ends(cols)
        cols, send_rows, arrival_rows = self._add_arrivals(cols, sends, recvs)
        self.peak_rows = max(self.peak_rows, len(cols["rank"]))
        starts, ends = cols["start_ns"], np.maximum(cols["end_ns"], cols["start_ns"])
        track = self._track_of(cols["cat"])
        tids = track * LANES_PER_TRACK + compute_lanes(cols["rank"] * len(TRACKS) + track, starts, ends) + 1
        if len(self._vocab_json.lengths) != len(self.vocab.strings):  # the vocabulary only grows
            self._vocab_json = json_vocab(self.vocab.strings)
        vocab_json = self._vocab_json
        parts = [
            self._new_threads(cols["rank"], tids),
            *span_lines(cols, track, tids, np.maximum(starts, 0), ends, vocab_json, self._empty, self._arena),
            *self._message_flows(cols, tids, send_rows, arrival_rows),
            *self._collective_flows(cols, tids),
            "".join(counter_lines(cols, np.maximum(starts, 0), ends)).encode(),
        ]
        return parts

    def _message_ends(self, cols: dict) -> tuple[dict, dict]:
        """This window's keyed send and recv ends, after the ones carried from the last window.
        Sends carry the window row (-1 if carried) in "tid" until lanes are known."""
        keyed = (cols["cat"] == self._comm) & (cols["seq"] >= 0) & (cols["peer"] >= 0)
        out = []
        for op, pending in ((self._send, self._sends), (self._recv, self._recvs)):
            rows = np.flatnonzero(keyed & (cols["op"] == op))
            rank, peer, seq = cols["rank"][rows], cols["peer"][rows].astype(np.int64), cols["seq"][rows]
            key = pack_message_keys(rank, peer, seq) if op == self._send else pack_message_keys(peer, rank, seq)
            now = {
                "key": key,
                "rank": rank,
                "start": cols["start_ns"][rows],
                "end": cols["end_ns"][rows],
                "iteration": cols["iteration"][rows].astype(np.int64),
                "bytes": cols["bytes"][rows],
                "tid": -1 - rows,
            }  # < 0: a row of this window (-1 - row); >= 0: a carried send's tid
            out.append(_concat(pending, now))
        return out[0], out[1]

    def _add_arrivals(self, cols: dict, sends: dict, recvs: dict) -> tuple[dict, dict, np.ndarray]:
        """Match sends to recvs, keep this window's unmatched ends for the next one (the carried
        ones still unmatched are dropped and counted), and append one arrival row per message
        on its receiver. Returns the columns, the matched sends and the arrival rows."""
        send_at, recv_at = match_message_keys(sends["key"], recvs["key"])
        self._sends = self._still_pending(sends, send_at, len(self._sends["key"]))
        self._recvs = self._still_pending(recvs, recv_at, len(self._recvs["key"]))
        self.peak_pending = max(self.peak_pending, len(self._sends["key"]) + len(self._recvs["key"]))
        send, recv = _take(sends, send_at), _take(recvs, recv_at)
        start, end = place_arrivals(send["start"], recv["start"], recv["end"])
        src, _, seq = unpack_message_keys(recv["key"])
        n, m = len(start), len(cols["rank"])
        extra = {k: np.full(n, -1, v.dtype) for k, v in cols.items()}
        extra.update(
            rank=recv["rank"],
            start_ns=start,
            end_ns=end,
            iteration=recv["iteration"],
            peer=src,
            seq=seq,
            bytes=recv["bytes"],
            name=np.full(n, self._arrival),
            cat=np.full(n, self._comm),
            op=np.full(n, self._empty),
            group=np.full(n, self._empty),
        )
        self.arrivals += n
        return _concat(cols, {k: extra[k].astype(cols[k].dtype) for k in cols}), send, np.arange(m, m + n)

    def _still_pending(self, ends: dict, matched: np.ndarray, carried: int) -> dict:
        """The unmatched ends of this window; the first `carried` (from the last window) that are
        still unmatched are dropped and counted."""
        left = np.ones(len(ends["key"]), bool)
        left[matched] = False
        self.unmatched += int(left[:carried].sum())
        left[:carried] = False
        return _take(ends, np.flatnonzero(left))

    def _new_threads(self, rank: np.ndarray, tids: np.ndarray) -> bytes:
        keys = _distinct(rank * (LANES_PER_TRACK * len(TRACKS) + 1) + tids).tolist()
        lines = []
        for key in keys:
            if key not in self._threads:
                self._threads.add(key)
                r, tid = divmod(key, LANES_PER_TRACK * len(TRACKS) + 1)
                lines += thread_lines(r, tid)
        return "".join(",\n" + line for line in lines).encode()

    def _message_flows(self, cols: dict, tids: np.ndarray, send: dict, arrival_rows: np.ndarray) -> list:
        """One arrow per message: "s" on its send, "f" on its arrival slice."""
        n = len(arrival_rows)
        self._remember_pending_tids(cols, tids)
        if n == 0:
            return []
        here = send["tid"] < 0
        send_rows = np.where(here, -1 - send["tid"], 0)
        send_tid = np.where(here, tids[send_rows], send["tid"])
        send_start = np.where(here, cols["start_ns"][send_rows], send["start"])
        ids = self._next_flow + 1 + np.arange(n)
        self._next_flow += n
        self.flows += n
        return [
            *flow_lines(np.zeros(n, np.int64), ids, "p2p", send["rank"], send_tid, send_start, self._arena),
            *flow_lines(
                np.full(n, 2),
                ids,
                "p2p",
                cols["rank"][arrival_rows],
                tids[arrival_rows],
                cols["start_ns"][arrival_rows],
                self._arena,
            ),
        ]

    def _remember_pending_tids(self, cols: dict, tids: np.ndarray) -> None:
        """Sends waiting for the next window: replace their row by their tid and placed start."""
        rows = self._sends["tid"]
        here = rows < 0
        self._sends["start"] = np.where(here, cols["start_ns"][np.where(here, -1 - rows, 0)], self._sends["start"])
        self._sends["tid"] = np.where(here, tids[np.where(here, -1 - rows, 0)], rows)

    def _collective_flows(self, cols: dict, tids: np.ndarray) -> list:
        """One chain per collective instance of >= 2 members, in arrival order (ties by rank)."""
        rows = np.flatnonzero(
            (cols["cat"] == self._comm)
            & (cols["seq"] >= 0)
            & (cols["group"] != self._empty)
            & (cols["op"] != self._empty)
            & (cols["op"] != self._send)
            & (cols["op"] != self._recv)
        )
        order, position = order_collective_members(
            cols["group"][rows], cols["seq"][rows], cols["start_ns"][rows], cols["rank"][rows]
        )
        rows = rows[order]
        first = np.flatnonzero(position == 0)
        size = np.diff(np.append(first, len(rows)))
        instance = np.repeat(np.arange(len(first)), size)
        keep = size[instance] >= 2
        rows, position, instance = rows[keep], position[keep], instance[keep]
        if len(rows) == 0:
            return []
        dense = np.cumsum(position == 0) - 1  # instance, renumbered 0.. over the kept ones (rows are by instance)
        kept_instances = int(dense[-1]) + 1
        ids = self._next_flow + 1 + dense
        self._next_flow += kept_instances
        self.flows += int(len(rows) - kept_instances)
        last = position == size[instance] - 1
        ph = np.where(position == 0, 0, np.where(last, 2, 1))
        return flow_lines(ph, ids, "collective", cols["rank"][rows], tids[rows], cols["start_ns"][rows], self._arena)
