"""Synthetic traces of a TP x DP x PP training job, with an injected fault, for testing MegaScan.

A small discrete-event simulation replays Megatron's 1F1B schedule (from
`megatronapp.pipeline.schedules`) on every rank of a layout and records the spans the real
tracer writes (see `megatronapp.scan.record.format`): iteration, forward/backward (with TP
all-reduces nested inside), the last stage's loss, PP send/recv, the DP grad_reduce, the
model-parallel grad-norm all-reduce and the optimizer. Victims wait exactly as they would on
a real job, because every dependency is simulated:

  * a recv completes at max(posted, matching send posted) + transfer (+ the injected link
    delay, or not before posted + delay in the engine's "before_wait" injection mode);
  * a collective completes for all members at the last member's arrival + transfer;
  * sends are buffered: they never wait for the receiver.

Every duration gets log-normal noise plus rare scheduler "hiccups", and optionally a fixed
per-rank speed factor (`rank_bias`, the unfair sharing of an oversubscribed CPU), so
detectors are tested against the jitter of small CPU runs, not clean numbers. Timestamps are
already on one aligned timeline. Pure: the same `SimulatedJob` always gives the same traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.actions import ActionKind
from megatronapp.pipeline.schedules import build_1f1b_schedule
from megatronapp.scan.record.format import EVENT_COLUMNS, RankTrace, build_event_batch_from_columns, build_rank_meta

_SEND_NS = 20_000  # posting a buffered isend and waiting on it


@dataclass(frozen=True)
class SimulatedJob:
    """Shape, timing and fault of one simulated job; durations in nanoseconds."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    num_microbatches: int = 4
    iterations: int = 6
    forward_ns: int = 2_000_000  # one microbatch forward of a middle stage, TP comm excluded
    backward_ratio: float = 2.0
    tp_collectives_per_pass: int = 2  # TP all-reduces inside each forward / backward
    tp_allreduce_ns: int = 80_000
    p2p_ns: int = 150_000
    grad_reduce_ns: int = 400_000
    grad_norm_ns: int = 50_000
    optimizer_ns: int = 300_000
    loss_ns: int = 300_000  # "loss" span nested at the end of the last stage's forward
    first_stage_extra: float = 0.03  # embedding work on pipeline stage 0
    last_stage_extra: float = 0.15  # output head outside the loss span
    activation_bytes: int = 8192
    noise: float = 0.08  # sigma of the log-normal factor on every duration
    hiccup_prob: float = 0.02  # chance that a duration is stretched 1.5-3x (preemption)
    rank_bias: float = 0.0  # sigma of a per-rank log-normal factor on all its compute (unfair CPU sharing)
    seed: int = 0
    slow_rank: int | None = None
    slow_factor: float = 1.0  # forward/backward compute of slow_rank takes this many times longer
    slow_every: int = 1  # ... in iterations i with i % slow_every < slow_burst (intermittent when > 1)
    slow_burst: int = 1  # consecutive slow iterations per period (contention lasting a while)
    stall_ns: int = 0  # in its slow iterations, slow_rank also stalls this long outside every span, before
    # its DP gradient reduce (a process frozen by a CPU quota between spans: no span shows it)
    slow_link: tuple[int, int] | None = None  # (src, dst) global ranks
    link_delay_ns: int = 0  # added to every transfer on slow_link
    # "transfer": each message arrives link_delay_ns later (a slow wire); "before_wait": the
    # receiver sleeps link_delay_ns before waiting (the engine's CPU injection before late-arrival
    # Works, kept to compare), which a
    # sender later than the delay hides completely.
    link_delay_mode: str = "transfer"
    # Work right after a long wait runs slower (cold caches, idle clocks; detect_rules' cold span):
    # a work op starting within cold_recovery_ns of the end of a comm op that waited >=
    # cold_after_ns takes cold_factor x as long.
    cold_factor: float = 1.0
    cold_after_ns: int = 3_000_000
    cold_recovery_ns: int = 3_000_000

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "num_microbatches", "iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.slow_every < 1 or not 1 <= self.slow_burst <= self.slow_every or self.stall_ns < 0:
            raise ValueError(
                f"need slow_every >= 1, 1 <= slow_burst <= slow_every, stall_ns >= 0; got "
                f"{self.slow_every}, {self.slow_burst}, {self.stall_ns}"
            )
        if self.slow_factor < 1.0:
            raise ValueError(f"slow_factor must be >= 1.0, got {self.slow_factor}")
        if self.slow_rank is not None and not 0 <= self.slow_rank < self.world_size:
            raise ValueError(f"slow_rank {self.slow_rank} outside world of size {self.world_size}")
        if self.slow_link is not None:
            src, dst = self.slow_link
            if not (0 <= src < self.world_size and 0 <= dst < self.world_size) or src == dst:
                raise ValueError(
                    f"slow_link {self.slow_link} must name two distinct ranks of a world of size {self.world_size}"
                )
        if self.link_delay_mode not in ("transfer", "before_wait"):
            raise ValueError(f"link_delay_mode must be 'transfer' or 'before_wait', got {self.link_delay_mode!r}")
        if self.link_delay_ns < 0 or not all(0 <= v < 1 for v in (self.noise, self.hiccup_prob, self.rank_bias)):
            raise ValueError("link_delay_ns must be >= 0; noise, hiccup_prob and rank_bias in [0, 1)")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.world_size, self.tp_size, self.pp_size)


@dataclass
class _Event:
    name: str
    cat: str
    start_ns: int
    end_ns: int = -1
    iteration: int = -1
    chunk: int = -1
    microbatch: int = -1
    op: str = ""
    group: str = ""
    seq: int = -1
    peer: int = -1
    bytes: int = -1


@dataclass
class _RankState:
    rank: int
    program: list[tuple]
    t: int = 0
    pc: int = 0
    posted_at: int | None = None  # batch post time while the current batch waits
    arrived: bool = False  # collective arrival registered for the current op
    cold_factor: float = 1.0  # SimulatedJob's
    cold_after_ns: int = 0
    cold_recovery_ns: int = 0
    woke_at: int | None = None  # end of the last long wait
    open_spans: list[_Event] = field(default_factory=list)
    events: list[_Event] = field(default_factory=list)


def _group_key(gid: int, members: list[int]) -> str:
    return f"{gid}:[{','.join(map(str, members))}]"


def _groups_of(layout: ParallelLayout) -> dict[str, dict[int, tuple[str, int]]]:
    """Per kind ("tp", "dp", "mp"): rank -> (group key, group size), for groups larger than one."""
    gid, out = 0, {}
    for kind, groups in (
        ("tp", layout.tp_group_ranks()),
        ("dp", layout.dp_group_ranks()),
        ("mp", layout.model_parallel_group_ranks()),
    ):
        out[kind] = {}
        for members in groups:
            if len(members) > 1:
                for r in members:
                    out[kind][r] = (_group_key(gid, members), len(members))
            gid += 1
    return out


class _ProgramBuilder:
    """Turns the schedule into each rank's list of primitive ops, drawing the noisy durations."""

    def __init__(self, job: SimulatedJob):
        self.job, self.layout = job, job.layout
        self.rng = np.random.default_rng(job.seed)
        bias_rng = np.random.default_rng([job.seed, 1])  # own stream: the same noise draws with or without bias
        self.bias = bias_rng.lognormal(0.0, job.rank_bias, job.world_size) if job.rank_bias else np.ones(job.world_size)
        self.groups = _groups_of(self.layout)
        self.schedule = build_1f1b_schedule(job.pp_size, job.num_microbatches)
        self.coll_seq: dict[str, int] = {}
        self.p2p_seq: dict[tuple[int, int], int] = {}

    def noisy(self, ns: float) -> int:
        factor = self.rng.lognormal(0.0, self.job.noise) if self.job.noise else 1.0
        if self.rng.random() < self.job.hiccup_prob:
            factor *= self.rng.uniform(1.5, 3.0)
        return max(1, int(ns * factor))

    def collective(
        self, kind: str, rank: int, name: str, cost: int, it: int, chunk: int = -1, mb: int = -1
    ) -> list[tuple]:
        if rank not in self.groups[kind]:
            return []
        key, size = self.groups[kind][rank]
        seq = self.coll_seq.get(f"{key}@{rank}", 0)
        self.coll_seq[f"{key}@{rank}"] = seq + 1
        ev = _Event(
            name, "comm", 0, iteration=it, chunk=chunk, microbatch=mb, op="all_reduce", group=key, seq=seq, bytes=4096
        )
        return [("coll", ev, size, self.noisy(cost))]

    def slowed(self, rank: int, it: int) -> bool:
        return rank == self.job.slow_rank and it % self.job.slow_every < self.job.slow_burst

    def compute_pass(self, rank: int, kind: ActionKind, chunk: int, mb: int, it: int) -> list[tuple]:
        job, pp = self.job, self.layout.coords(rank).pp
        forward = kind is ActionKind.FORWARD
        work = job.forward_ns * (1.0 if forward else job.backward_ratio)
        work *= 1 + (job.first_stage_extra if pp == 0 else 0) + (job.last_stage_extra if pp == job.pp_size - 1 else 0)
        work *= self.bias[rank] * (job.slow_factor if self.slowed(rank, it) else 1.0)
        segments = job.tp_collectives_per_pass if job.tp_size > 1 else 1
        span = _Event("forward" if forward else "backward", "compute", 0, iteration=it, chunk=chunk, microbatch=mb)
        ops: list[tuple] = [("begin", span)]
        for _ in range(segments):
            ops.append(("work", self.noisy(work / segments)))
            ops += self.collective("tp", rank, "all_reduce", job.tp_allreduce_ns, it, chunk, mb)
        if forward and pp == job.pp_size - 1:
            ops += [
                ("begin", _Event("loss", "compute", 0, iteration=it, chunk=chunk, microbatch=mb)),
                ("work", self.noisy(job.loss_ns)),
                ("end",),
            ]
        return ops + [("end",)]

    def comm_batch(self, rank: int, actions, it: int) -> tuple:
        coords, sends, recvs = self.layout.coords(rank), [], []
        for a in actions:
            peer = self.layout.rank_of(coords.tp, coords.dp, a.peer)
            is_send = a.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
            pair = (rank, peer) if is_send else (peer, rank)
            k = self.p2p_seq.get((pair, is_send), 0)
            self.p2p_seq[(pair, is_send)] = k + 1
            ev = _Event(
                "send" if is_send else "recv",
                "comm",
                0,
                iteration=it,
                chunk=a.chunk,
                microbatch=a.microbatch,
                op="send" if is_send else "recv",
                seq=k,
                peer=peer,
                bytes=self.job.activation_bytes,
            )
            (sends if is_send else recvs).append(ev)
        costs = []  # (transfer after the send is posted, minimum wait after the recv is posted)
        for ev in recvs:
            delay = self.job.link_delay_ns if (ev.peer, rank) == self.job.slow_link else 0
            before_wait = self.job.link_delay_mode == "before_wait"
            costs.append((self.noisy(self.job.p2p_ns) + (0 if before_wait else delay), delay if before_wait else 0))
        return ("batch", sends, recvs, costs)

    def iteration(self, rank: int, it: int) -> list[tuple]:
        job, pp = self.job, self.layout.coords(rank).pp
        ops: list[tuple] = [("begin", _Event("iteration", "step", 0, iteration=it))]
        actions = self.schedule.for_rank(pp)
        i = 0
        while i < len(actions):
            if actions[i].kind.is_comm:
                j = i
                while j < len(actions) and actions[j].kind.is_comm:
                    j += 1
                ops.append(self.comm_batch(rank, actions[i:j], it))
                i = j
            else:
                a = actions[i]
                ops += self.compute_pass(rank, a.kind, a.chunk, a.microbatch, it)
                i += 1
        if job.stall_ns and self.slowed(rank, it):
            ops.append(("work", self.noisy(job.stall_ns)))
        ops += self.collective("dp", rank, "grad_reduce", job.grad_reduce_ns, it)
        ops += [("begin", _Event("optimizer", "compute", 0, iteration=it))]
        ops += self.collective("mp", rank, "grad_norm", job.grad_norm_ns, it)
        ops += [("work", self.noisy(job.optimizer_ns)), ("end",), ("end",)]
        return ops


def _step(st: _RankState, colls: dict, sends: dict) -> bool:
    """Run the op at st.pc if its inputs are known; False when it must wait for another rank."""
    op = st.program[st.pc]
    if op[0] == "begin":
        ev = _Event(**{**op[1].__dict__, "start_ns": st.t})
        st.open_spans.append(ev)
        st.events.append(ev)
    elif op[0] == "end":
        st.open_spans.pop().end_ns = st.t
    elif op[0] == "work":
        cold = st.woke_at is not None and st.t - st.woke_at < st.cold_recovery_ns
        st.t += int(op[1] * (st.cold_factor if cold else 1.0))
    elif op[0] == "coll":
        ev, size, cost = op[1], op[2], op[3]
        arrivals = colls.setdefault((ev.group, ev.seq), {})
        if not st.arrived:
            arrivals[st.rank], st.arrived = st.t, True
        if len(arrivals) < size:
            return False
        end = max(arrivals.values()) + cost
        st.events.append(_Event(**{**ev.__dict__, "start_ns": st.t, "end_ns": end}))
        st.woke_at = end if end - st.t >= st.cold_after_ns else st.woke_at
        st.t, st.arrived = end, False
    else:  # batch: post every op at once, then wait for the recvs' senders
        _, batch_sends, batch_recvs, costs = op
        if st.posted_at is None:
            st.posted_at = st.t
            for ev in batch_sends:
                sends[(st.rank, ev.peer, ev.seq)] = st.t
                st.events.append(_Event(**{**ev.__dict__, "start_ns": st.t, "end_ns": st.t + _SEND_NS}))
        keys = [(ev.peer, st.rank, ev.seq) for ev in batch_recvs]
        if any(k not in sends for k in keys):
            return False
        end = st.posted_at + (_SEND_NS if batch_sends else 0)
        for ev, k, (cost, floor) in zip(batch_recvs, keys, costs):
            ev_end = max(max(st.posted_at, sends[k]) + cost, st.posted_at + floor)
            st.events.append(_Event(**{**ev.__dict__, "start_ns": st.posted_at, "end_ns": ev_end}))
            end = max(end, ev_end)
        st.woke_at = end if end - st.posted_at >= st.cold_after_ns else st.woke_at
        st.t, st.posted_at = end, None
    st.pc += 1
    return True


def _run(states: list[_RankState]) -> None:
    colls: dict = {}
    sends: dict = {}
    while any(st.pc < len(st.program) for st in states):
        progressed = False
        for st in states:
            while st.pc < len(st.program) and _step(st, colls, sends):
                progressed = True
        if not progressed:
            raise RuntimeError("simulated schedule deadlocked (bug in the simulator)")


def build_events_table(events: list[_Event], calib_offset_ns: int = 0) -> pa.Table:
    """Events as an EVENT_SCHEMA table sorted by start, framed by two calibration rows."""
    events = sorted(events, key=lambda e: (e.start_ns, e.end_ns))
    if events:  # calib rows: device time -> wall time, one before and one after the run
        first, last = events[0].start_ns, max(e.end_ns for e in events)
        events = [_Event("clock", "calib", t, t + calib_offset_ns) for t in (first - 1000, last + 1000)] + events
    cols = {c: [getattr(e, c, -1) if c != "layer" else -1 for e in events] for c in EVENT_COLUMNS}
    return pa.Table.from_batches([build_event_batch_from_columns(cols)])


def simulate_job_traces(job: SimulatedJob, start_ns: int = 1_000_000_000) -> list:
    """Simulate `job` and return one RankTrace per rank (rank order), on an aligned timeline."""
    builder = _ProgramBuilder(job)
    programs = {r: [] for r in range(job.world_size)}
    for it in range(job.iterations):
        for r in range(job.world_size):
            programs[r] += builder.iteration(r, it)
    states = [
        _RankState(
            rank=r,
            program=programs[r],
            t=start_ns,
            cold_factor=job.cold_factor,
            cold_after_ns=job.cold_after_ns,
            cold_recovery_ns=job.cold_recovery_ns,
        )
        for r in range(job.world_size)
    ]
    _run(states)
    lay = job.layout
    layout = {"tp_size": lay.tp_size, "pp_size": lay.pp_size, "dp_size": lay.dp_size, "virtual_pp_size": 1}
    traces = []
    for st in states:
        meta = build_rank_meta(
            rank=st.rank,
            world_size=job.world_size,
            coords=lay.coords(st.rank).as_dict(),
            layout=layout,
            host="simulated",
            device="cpu",
            run_id=f"sim-{job.seed}",
            clock="monotonic",
            run={"simulated": True},
        )
        traces.append(
            RankTrace(
                meta=meta,
                events=build_events_table(st.events, start_ns),
                path=f"<simulated rank {st.rank}>",
                partial=False,
            )
        )
    return traces


def _seq_steps(events: pa.Table) -> np.ndarray:
    """Per row: how much its seq grows per repeated iteration (the rows of its comm stream,
    a group or a directed p2p pair, in one iteration); 0 for unkeyed rows."""
    op = events.column("op").cast(pa.string()).to_pylist()
    group = events.column("group").cast(pa.string()).to_pylist()
    peer, seq = events.column("peer").to_pylist(), events.column("seq").to_pylist()
    streams = [(o, p) if o in ("send", "recv") else g for o, g, p in zip(op, group, peer)]
    counts: dict = {}
    for stream, s in zip(streams, seq):
        if s >= 0:
            counts[stream] = counts.get(stream, 0) + 1
    return np.array([counts[st] if s >= 0 else 0 for st, s in zip(streams, seq)], dtype=np.int64)


def write_repeated_job(
    job: SimulatedJob, trace_dir, iterations: int, iterations_per_batch: int = 10, gap_ns: int = 1_000_000
) -> int:
    """Write a long trace fast: `job`'s first simulated iteration repeated `iterations` times
    (times shifted by one iteration period + gap_ns, seq numbers continued, so messages and
    collectives still match), one record batch plus one calibration row per
    `iterations_per_batch` iterations per rank, through format.TraceWriter. Returns the span count."""
    from pathlib import Path

    from megatronapp.scan.record.format import TraceWriter, build_event_batch, trace_file_name

    traces = simulate_job_traces(SimulatedJob(**{**job.__dict__, "iterations": 1}))
    spans = [
        t.events.filter(pa.compute.not_equal(t.events.column("cat").cast(pa.string()), "calib")).combine_chunks()
        for t in traces
    ]
    first = min(s.column("start_ns").to_numpy().min() for s in spans)
    period = max(s.column("end_ns").to_numpy().max() for s in spans) - first + gap_ns
    total = 0
    for trace, table in zip(traces, spans):
        template = table.to_batches()[0]
        n, steps = template.num_rows, _seq_steps(table)
        start, end, seq = (table.column(c).to_numpy() for c in ("start_ns", "end_ns", "seq"))
        with TraceWriter(Path(trace_dir) / trace_file_name(trace.rank), trace.meta) as writer:
            for lo in range(0, iterations, iterations_per_batch):
                its = np.repeat(np.arange(lo, min(lo + iterations_per_batch, iterations)), n)
                batch = template.take(pa.array(np.tile(np.arange(n), len(its) // n)))
                shift = its * period
                columns = dict(zip(batch.schema.names, batch.columns))
                columns.update(
                    start_ns=pa.array(np.tile(start, len(its) // n) + shift),
                    end_ns=pa.array(np.tile(end, len(its) // n) + shift),
                    iteration=pa.array(its.astype(np.int32)),
                    seq=pa.array(
                        np.where(
                            np.tile(seq, len(its) // n) >= 0,
                            np.tile(seq, len(its) // n) + its * np.tile(steps, len(its) // n),
                            -1,
                        )
                    ),
                )
                writer.append(pa.RecordBatch.from_arrays([columns[c] for c in batch.schema.names], schema=batch.schema))
                device = int(start.min() + lo * period)
                writer.append(
                    build_event_batch([{"name": "clock", "cat": "calib", "start_ns": device, "end_ns": device}])
                )
                total += len(its)
    return total
