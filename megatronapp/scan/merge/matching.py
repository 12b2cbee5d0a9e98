"""Which communication events belong together across ranks: the one place that matches them.

Ranks never exchange anything to make this possible; the instrumentation's sequence numbers
do it (see format.py):

  * a p2p *message* is the send on src and the recv on dst with the same (src, dst, seq);
  * a collective *instance* is every member's span with the same (group key, seq).

`index_comm_events` reads the comm rows of a list of RankTraces (optionally through a per-rank
time mapping, as clock alignment needs) and returns a `CommIndex`. Alignment, merge and
detection all build on it, so they agree on what a message and an instance are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.spans import P2P_OPS, SYNC_COLLECTIVES

MessageKey = tuple[int, int, int]  # (src, dst, seq)
InstanceKey = tuple[str, int]  # (group, seq)


class CommEnd(NamedTuple):
    """One rank's span of a message or collective instance. `row` indexes the table it came from.
    (A named tuple, not a frozen dataclass: alignment builds one per keyed comm span, and a
    frozen dataclass costs several times more to construct.)"""

    rank: int
    start: int
    end: int
    iteration: int
    bytes: int
    op: str
    row: int


@dataclass
class CommIndex:
    """Every keyed comm span of a set of ranks, by message and by collective instance."""

    sends: dict[MessageKey, CommEnd] = field(default_factory=dict)
    recvs: dict[MessageKey, CommEnd] = field(default_factory=dict)
    collectives: dict[InstanceKey, list[CommEnd]] = field(default_factory=lambda: defaultdict(list))

    def messages(self) -> Iterator[tuple[MessageKey, CommEnd, CommEnd]]:
        """(key, send, recv) of every message both of whose ends were recorded, in key order."""
        for key in sorted(self.sends.keys() & self.recvs.keys()):
            yield key, self.sends[key], self.recvs[key]

    def message_count(self) -> int:
        return len(self.sends.keys() & self.recvs.keys())

    def sync_instances(self) -> dict[InstanceKey, list[CommEnd]]:
        """Instances of collectives whose members all leave together (SYNC_COLLECTIVES)."""
        return {k: m for k, m in self.collectives.items() if m and m[0].op in SYNC_COLLECTIVES}


def _string_values(column: pa.ChunkedArray) -> np.ndarray:
    """A string or dictionary column as an object array of str (dictionaries decoded once)."""
    parts = []
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            words = np.array(chunk.dictionary.to_pylist(), dtype=object)
            parts.append(words[chunk.indices.to_numpy(zero_copy_only=False)])
        else:
            parts.append(np.array(chunk.to_pylist(), dtype=object))
    return np.concatenate(parts) if parts else np.zeros(0, object)


def comm_rows(events: pa.Table) -> dict[str, np.ndarray]:
    """Numpy columns (op, group, seq, peer, start_ns, end_ns, iteration, bytes, row) of the
    keyed comm rows of one rank's table (seq >= 0); strings as object arrays."""
    is_comm = pc.equal(events.column("cat").cast(pa.string()), "comm")
    keyed = pc.and_(is_comm, pc.greater_equal(events.column("seq"), 0))
    rows = np.flatnonzero(np.asarray(keyed.to_numpy(zero_copy_only=False), dtype=bool))
    sub = events.take(pa.array(rows, pa.int64()))
    out = {"row": rows}
    for name in ("op", "group"):
        out[name] = _string_values(sub.column(name))
    for name in ("seq", "peer", "start_ns", "end_ns", "iteration", "bytes"):
        out[name] = sub.column(name).to_numpy().astype(np.int64)
    return out


def add_rank_comm(
    index: CommIndex,
    rank: int,
    cols: dict[str, np.ndarray],
    to_timeline: Callable[[np.ndarray], np.ndarray] | None = None,
) -> None:
    """Add one rank's comm_rows to `index`, times mapped through `to_timeline` if given."""
    starts, ends = cols["start_ns"], cols["end_ns"]
    if to_timeline is not None:
        starts, ends = to_timeline(starts), to_timeline(ends)
    fields = zip(
        cols["op"].tolist(),
        cols["group"].tolist(),
        cols["seq"].tolist(),
        cols["peer"].tolist(),
        starts.tolist(),
        ends.tolist(),
        cols["iteration"].tolist(),
        cols["bytes"].tolist(),
        cols["row"].tolist(),
    )
    for op, group, seq, peer, start, end, iteration, nbytes, row in fields:
        end_ = CommEnd(rank, start, end, iteration, nbytes, op, row)
        if op == "send" and peer >= 0:
            index.sends[rank, peer, seq] = end_
        elif op == "recv" and peer >= 0:
            index.recvs[peer, rank, seq] = end_
        elif op and op not in P2P_OPS and group:
            index.collectives[group, seq].append(end_)


def index_comm_events(traces: list, to_timeline: dict[int, Callable] | None = None) -> CommIndex:
    """Index the keyed comm spans of `traces` (RankTraces); `to_timeline[rank]` maps its times."""
    index = CommIndex()
    for trace in traces:
        mapping = None if to_timeline is None else to_timeline[trace.rank]
        add_rank_comm(index, trace.rank, comm_rows(trace.events), mapping)
    return index


# ---------------------------------------------------------------- vectorised, for streaming
# The same keys as CommIndex, on numpy columns: a message key packs (src, dst, seq) into one
# int64, so matching a window of messages is one sorted intersection.
_RANK_BITS, _SEQ_BITS = 16, 31


def pack_message_keys(src: np.ndarray, dst: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """(src, dst, seq) -> one int64 per message; ValueError if a rank or seq does not fit."""
    if len(src) and (max(src.max(), dst.max()) >= 1 << _RANK_BITS or seq.max() >= 1 << _SEQ_BITS):
        raise ValueError(f"p2p keys need ranks < {1 << _RANK_BITS} and seq < {1 << _SEQ_BITS}")
    return (src.astype(np.int64) << (_RANK_BITS + _SEQ_BITS)) | (dst.astype(np.int64) << _SEQ_BITS) | seq


def unpack_message_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_message_keys: (src, dst, seq)."""
    mask = (1 << _RANK_BITS) - 1
    return keys >> (_RANK_BITS + _SEQ_BITS), (keys >> _SEQ_BITS) & mask, keys & ((1 << _SEQ_BITS) - 1)


def match_message_keys(send_keys: np.ndarray, recv_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into send_keys, into recv_keys) of the messages both of whose ends are given."""
    _, send_at, recv_at = np.intersect1d(send_keys, recv_keys, assume_unique=False, return_indices=True)
    return send_at, recv_at


def _instance_order(group: np.ndarray, seq: np.ndarray, start: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """np.lexsort((rank, start, seq, group)), as a sort of two packed keys where they fit in int64
    (group ids and seqs below 2**31, ranks spread over the start range): ~1.5x faster."""
    if len(group) == 0:
        return np.zeros(0, np.int64)
    low = int(start.min())
    ranks = int(rank.max()) + 1
    if (
        min(int(group.min()), int(seq.min()), int(rank.min())) < 0
        or max(int(group.max()), int(seq.max())) >= 1 << 31
        or (int(start.max()) - low + 1) * ranks >= 1 << 62
    ):
        return np.lexsort((rank, start, seq, group))
    instance = (group.astype(np.int64) << 31) | seq
    arrival = (start - low) * ranks + rank
    return np.lexsort((arrival, instance))


def order_collective_members(
    group: np.ndarray, seq: np.ndarray, start: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Collective member rows ordered by instance (group id, seq), then arrival (start, rank);
    and the position of each row within its instance (0 = first to arrive)."""
    order = _instance_order(group, seq, start, rank)
    g, s = group[order], seq[order]
    first = np.ones(len(order), bool)
    first[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    begin = np.flatnonzero(first)
    position = np.arange(len(order)) - np.repeat(begin, np.diff(np.append(begin, len(order))))
    return order, position
