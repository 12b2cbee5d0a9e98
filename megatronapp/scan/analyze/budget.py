"""A time budget per rank and iteration, from what the tracer measured rather than what waits imply.

Each rank's iteration span (wall time W; device time on a "cuda" clock) is split into five parts
that add up to W:

  own work     CPU time the training thread spent in its outermost compute spans (`cpu_ns`, the
               thread that opened the span; intra-op worker threads are not counted). On a "cuda"
               clock the spans are device time: own work is the union of the compute spans.
  descheduled  time the thread was runnable but not running: the run-queue delay of the iteration
               (`run_delay_ns`), or the cgroup's throttled time where schedstat is absent. The run
               delay already holds the throttled time (a thread spinning 400 ms under a 20% quota on
               the 2-core machine: 85 ms CPU, 315 ms run delay, 215 ms throttled), so the two are not
               added; `throttled` is reported beside it as the part a CPU quota explains.
  waiting      blocked in communication before the peers or the data were there.
  transfer     blocked in communication after every member had arrived (a collective) or the
               message had been sent (a receive), and in sends.
  rest         the remainder: CPU outside the compute spans (Python, an untraced optimizer step,
               data loading) and sleeps outside communication.

Steps on a CPU ("monotonic") clock, per rank and iteration:
  1. Communication pieces on the rank's timeline, from the matched events (matching.py): a
     collective instance splits into [own start, last member's start) waiting and [last start, own
     end) transfer; a received message into [wait start, send start) waiting and the rest of the
     receive up to its end transfer (detect_links.P2PMessage: the receiver's wait starts when its
     compute inside the receive ended); a send is transfer; a comm span matched to nothing (a
     partial instance, the unkeyed waits of MegaFBD) is waiting. Where pieces overlap, waiting
     wins: a transfer does not hold a rank up while a peer has not arrived. Pieces are clipped to
     the iteration span.
  2. descheduled = min(run delay, W - CPU of the iteration): the thread cannot be both.
  3. Blocked in communication = min(W - CPU - descheduled, the pieces' union). A rank that posts a
     collective (DDP's gradient buckets) keeps computing, so only the end of a piece is spent
     blocked: transfer is counted first, then waiting.
  4. rest = W - own - descheduled - waiting - transfer.
On a "cuda" clock the host thread's CPU says nothing about device time: own work is the union of
the compute spans, waiting and transfer are the pieces outside it (communication overlapped with
kernels costs nothing), descheduled is at most what is left, and the rest the remainder.

A trace without the signals (format version 1, or a machine without schedstat) has -1 there: own
work then falls back to the compute spans' wall time and descheduled to 0, and the row says it was
not measured. budget_summary.py turns these rows into a verdict per rank and per link.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_rules as rules
from megatronapp.scan.merge.matching import index_comm_events
from megatronapp.scan.record.format import RankTrace

WAITING, TRANSFER = 0, 1  # piece kinds


@dataclass(frozen=True)
class IterationBudget:
    """One rank's iteration split into parts that add up to wall_ns (module docstring)."""

    rank: int
    iteration: int
    wall_ns: float
    own_ns: float
    descheduled_ns: float
    throttled_ns: float  # the part of descheduled_ns the cgroup's CPU quota explains
    waiting_ns: float
    transfer_ns: float
    rest_ns: float
    measured: bool  # CPU time and the run-queue delay were recorded (else fallbacks: module docstring)

    @property
    def self_ns(self) -> float:
        """Time not spent blocked on communication: what the rank itself took."""
        return self.own_ns + self.descheduled_ns + self.rest_ns


@dataclass(frozen=True)
class Budget:
    """Budget rows of every rank and analysed iteration, and the p2p messages of those iterations."""

    rows: tuple[IterationBudget, ...]
    messages: tuple[p2p.P2PMessage, ...]
    coords: dict[int, dict]
    layout: dict


@dataclass(frozen=True)
class _Pieces:
    """One rank's communication pieces as sorted numpy columns (start, end, kind)."""

    start: np.ndarray
    end: np.ndarray
    kind: np.ndarray

    def clipped(self, lo: int, hi: int, kind: int | None = None) -> list[tuple[int, int]]:
        keep = (self.start < hi) & (self.end > lo)
        if kind is not None:
            keep &= self.kind == kind
        return [(max(int(s), lo), min(int(e), hi)) for s, e in zip(self.start[keep], self.end[keep])]


def _collective_pieces(instances: list[rules.CollectiveInstance], out: dict[int, list]) -> set:
    """Waiting and transfer pieces of each member of each instance; returns the (rank, start) of
    every comm span used, so that the spans matched to nothing can be found."""
    used = set()
    for inst in instances:
        for rank, (start, end) in inst.spans.items():
            split = min(max(start, inst.last_start), end)
            out[rank] += [(start, split, WAITING), (split, end, TRANSFER)]
            used.add((rank, start))
    return used


def _message_pieces(messages: list[p2p.P2PMessage], out: dict[int, list]) -> set:
    """The receiver's waiting and transfer pieces and the sender's transfer piece of each message;
    returns the (rank, start) of every comm span used."""
    used = set()
    for m in messages:
        split = min(max(m.wait_start, m.send_start), m.recv_end)
        out[m.dst] += [(m.wait_start, split, WAITING), (split, m.recv_end, TRANSFER)]
        used.add((m.dst, m.recv_start))
        if m.send_end >= m.send_start:
            out[m.src].append((m.send_start, m.send_end, TRANSFER))
            used.add((m.src, m.send_start))
    return used


def collect_comm_pieces(
    events: dict[int, rules.RankEvents], instances: list, messages: list[p2p.P2PMessage], iterations: set[int]
) -> dict[int, _Pieces]:
    """Per rank, its waiting and transfer pieces in `iterations` (module docstring, step 1)."""
    raw: dict[int, list] = defaultdict(list)
    used = _collective_pieces(instances, raw) | _message_pieces(messages, raw)
    for rank, ev in events.items():
        c = ev.cols
        for i in np.flatnonzero((c["cat"] == "comm") & np.isin(c["iteration"], list(iterations))):
            start, end = int(c["start_ns"][i]), int(c["end_ns"][i])
            if (rank, start) not in used and end > start:
                raw[rank].append((start, end, WAITING))
    out = {}
    for rank in events:
        rows = sorted(p for p in raw.get(rank, []) if p[1] > p[0])
        cols = np.array(rows, dtype=np.int64).reshape(-1, 3)
        out[rank] = _Pieces(cols[:, 0], cols[:, 1], cols[:, 2])
    return out


def outermost_compute(ev: rules.RankEvents) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, cpu_ns) of the compute spans not nested in another compute span, by start."""
    c = ev.cols
    comp = c["cat"] == "compute"
    start, end, cpu = c["start_ns"][comp], c["end_ns"][comp], c["cpu_ns"][comp]
    order = np.lexsort((-end, start))
    start, end, cpu = start[order], end[order], cpu[order]
    reach = np.maximum.accumulate(end) if len(end) else end
    outer = np.ones(len(start), dtype=bool)
    outer[1:] = start[1:] >= reach[:-1]
    return start[outer], end[outer], cpu[outer]


def _iteration_rows(ev: rules.RankEvents) -> dict[int, dict]:
    """iteration -> the signal columns of the rank's iteration span."""
    c, m = ev.cols, ev.mask(cat="step", name="iteration")
    keys = ("cpu_ns", "run_delay_ns", "throttled_ns")
    return {int(it): {k: int(c[k][i]) for k in keys} for it, i in zip(c["iteration"][m], np.flatnonzero(m))}


def _descheduled_signal(signals: dict) -> int:
    """The run-queue delay, or the cgroup's throttled time where it is unknown (0 if both are)."""
    return signals["run_delay_ns"] if signals["run_delay_ns"] >= 0 else max(signals["throttled_ns"], 0)


def _split_cpu_clock(wall: float, own: float, signals: dict, pieces: _Pieces, lo: int, hi: int) -> tuple:
    """(own, descheduled, throttled, waiting, transfer) on a CPU clock (module docstring, steps 2-3)."""
    cpu = signals["cpu_ns"] if signals["cpu_ns"] >= 0 else own
    own = min(own, cpu)
    descheduled = float(min(_descheduled_signal(signals), max(0.0, wall - cpu)))
    throttled = float(min(max(signals["throttled_ns"], 0), descheduled))
    every = rules.union_length(pieces.clipped(lo, hi))
    waiting_wall = rules.union_length(pieces.clipped(lo, hi, WAITING))
    blocked = min(max(0.0, wall - cpu - descheduled), every)
    transfer = min(float(every - waiting_wall), blocked)
    return own, descheduled, throttled, blocked - transfer, transfer


def _split_device_clock(wall: float, signals: dict, compute: list, pieces: _Pieces, lo: int, hi: int) -> tuple:
    """(own, descheduled, throttled, waiting, transfer) on a "cuda" clock (module docstring)."""
    own = rules.union_length(compute)
    exposed = rules.union_length(compute + pieces.clipped(lo, hi)) - own
    waiting = rules.union_length(compute + pieces.clipped(lo, hi, WAITING)) - own
    descheduled = float(min(_descheduled_signal(signals), max(0.0, wall - own - exposed)))
    return float(own), descheduled, float(min(max(signals["throttled_ns"], 0), descheduled)), waiting, exposed - waiting


def budget_rank(
    ev: rules.RankEvents, iterations: tuple[int, ...], pieces: _Pieces, device_clock: bool
) -> list[IterationBudget]:
    """One rank's budget rows for the `iterations` it has an iteration span of."""
    spans = rules.compute_iteration_spans(ev)
    signals = _iteration_rows(ev)
    c_start, c_end, c_cpu = outermost_compute(ev)
    rows = []
    for it in iterations:
        if it not in spans:
            continue
        lo, hi = spans[it]
        wall = float(hi - lo)
        inside = (c_start >= lo) & (c_start < hi)
        compute = [(int(s), min(int(e), hi)) for s, e in zip(c_start[inside], c_end[inside])]
        cpu = c_cpu[inside]
        walls = np.array([e - s for s, e in compute], dtype=float)
        own = float(np.where(cpu >= 0, cpu, walls).sum()) if len(compute) else 0.0
        sig = signals[it]
        measured = sig["cpu_ns"] >= 0 and sig["run_delay_ns"] >= 0 and bool((cpu >= 0).all())
        if device_clock:
            own, descheduled, throttled, waiting, transfer = _split_device_clock(wall, sig, compute, pieces, lo, hi)
        else:
            own, descheduled, throttled, waiting, transfer = _split_cpu_clock(wall, own, sig, pieces, lo, hi)
        rest = wall - own - descheduled - waiting - transfer  # >= 0: each part is capped by what is left
        rows.append(IterationBudget(ev.rank, it, wall, own, descheduled, throttled, waiting, transfer, rest, measured))
    return rows


def compute_budget(traces: list[RankTrace], iterations: tuple[int, ...]) -> Budget:
    """The budget of every rank in `iterations` (module docstring), from traces aligned and keyed
    as load_align_detect.py leaves them (TraceAnalysis.traces, detection.iterations_analyzed)."""
    events = {t.rank: rules.build_rank_events(t) for t in traces}
    its = set(iterations)
    index = index_comm_events(traces)
    instances = rules.collect_collectives(index, events, its)
    messages = p2p.collect_p2p_messages(index, events, its)
    pieces = collect_comm_pieces(events, instances, messages, its)
    rows = []
    for t in traces:
        rows += budget_rank(events[t.rank], tuple(iterations), pieces[t.rank], t.meta.get("clock") == "cuda")
    layout = dict(traces[0].meta["layout"]) if traces else {}
    return Budget(tuple(rows), tuple(messages), {r: ev.coords for r, ev in events.items()}, layout)
