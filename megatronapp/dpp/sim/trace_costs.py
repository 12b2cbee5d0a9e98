"""Task times and timelines read from a MegaScan trace directory (the `--from-trace` input).

One pipeline is read: the ranks with tp = 0 and dp = 0. Their "forward"/"backward" compute
spans carry (chunk, microbatch) attributes. The cost model takes means, not medians: an
iteration's time is a sum of task times and waits, so the expected value is what predicts it,
and on a busy host the tails (preemption, late wake-ups) are a real part of it. The first
traced iteration is left out when there are three or more (warm-up).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from megatronapp import spans as spans_vocab
from megatronapp.dpp.sim.simulator import CostModel, Span
from megatronapp.dpp.tasks import backward_task, forward_task


@dataclass(frozen=True)
class TracedRun:
    pp_size: int
    num_chunks: int
    num_microbatches: int
    schedule: str
    spans: dict  # iteration -> list[Span] (seconds from that iteration's first task)
    run_meta: dict = field(default_factory=dict)  # the trace's "run" metadata (schedule, injections)
    dp_size: int = 1
    tp_size: int = 1


def load_traced_run(trace_dir: str) -> TracedRun:
    """The compute spans of one pipeline of a traced run; ValueError when there are none."""
    from megatronapp.scan.record.format import load_trace_dir

    traces = [t for t in load_trace_dir(trace_dir) if t.meta["coords"]["tp"] == 0 and t.meta["coords"]["dp"] == 0]
    if not traces:
        raise ValueError(f"{trace_dir}: no trace of a tp 0, dp 0 rank (one whole pipeline is needed)")
    layout = traces[0].meta["layout"]
    by_iter: dict[int, list] = {}
    num_mb = 0
    for trace in traces:
        pp = trace.meta["coords"]["pp"]
        columns = ["name", "cat", "start_ns", "end_ns", "iteration", "chunk", "microbatch"]
        cols = trace.events.select(columns).to_pydict()
        for name, cat, start, end, it, chunk, mb in zip(*cols.values()):
            if cat != spans_vocab.CAT_COMPUTE or name not in spans_vocab.COMPUTE_KINDS or min(chunk, mb) < 0:
                continue
            task = (forward_task if name == spans_vocab.FORWARD else backward_task)(chunk, mb)
            by_iter.setdefault(it, []).append((pp, task, start, end))
            num_mb = max(num_mb, mb + 1)
    if not by_iter:
        raise ValueError(f"{trace_dir}: no forward/backward spans with chunk and microbatch attributes")
    spans = {}
    for it, rows in by_iter.items():
        t0 = min(r[2] for r in rows)
        spans[it] = sorted(
            (Span(pp, task, (s - t0) / 1e9, (e - t0) / 1e9) for pp, task, s, e in rows), key=lambda s: s.start_s
        )
    if len(spans) >= 3:
        del spans[min(spans)]
    run_meta = traces[0].meta.get("run", {})
    return TracedRun(
        layout["pp_size"],
        layout["virtual_pp_size"],
        num_mb,
        run_meta.get("schedule", "custom"),
        spans,
        run_meta,
        layout.get("dp_size", 1),
        layout.get("tp_size", 1),
    )


def compute_trace_costs(run: TracedRun, **link) -> CostModel:
    """Mean forward/backward seconds per (pp rank, chunk) over the traced iterations."""
    samples: dict = {}
    for spans in run.spans.values():
        for s in spans:
            samples.setdefault((s.pp_rank, s.task.kind, s.task.chunk), []).append(s.end_s - s.start_s)

    def table(kind) -> tuple:
        return tuple(
            tuple(statistics.fmean(samples.get((p, kind, c), [0.0])) for c in range(run.num_chunks))
            for p in range(run.pp_size)
        )

    return CostModel(table(forward_task(0, 0).kind), table(backward_task(0, 0).kind), **link)


def compute_iteration_times(run: TracedRun) -> dict[int, float]:
    """Seconds from the first task start to the last task end, per traced iteration."""
    return {it: max(s.end_s for s in spans) for it, spans in run.spans.items()}


def _previous_end(run: TracedRun, spans: list) -> dict:
    """(pp rank, task) -> end of the task the same rank ran just before it."""
    previous = {}
    for rank in range(run.pp_size):
        mine = sorted((s for s in spans if s.pp_rank == rank), key=lambda s: s.start_s)
        previous.update({(rank, b.task): a.end_s for a, b in zip(mine, mine[1:])})
    return previous


def _input_ready(run: TracedRun, spans: list) -> dict:
    """(pp rank, task) -> (end of its producer, whether the producer ran on another rank)."""
    from megatronapp.dpp.tasks import compute_consumer

    ready = {}
    for s in spans:
        consumer = compute_consumer(s.task, s.pp_rank, run.pp_size, run.num_chunks)
        if consumer is not None:
            ready[consumer] = (s.end_s, consumer[0] != s.pp_rank)
    return ready


def _gaps_with_input_ready(run: TracedRun, latency_s: float) -> dict[int, list[float]]:
    """pp rank -> gaps between its consecutive tasks when the second one's input was already there."""
    gaps: dict[int, list[float]] = {r: [] for r in range(run.pp_size)}
    for spans in run.spans.values():
        previous, ready = _previous_end(run, spans), _input_ready(run, spans)
        for s in spans:
            key = (s.pp_rank, s.task)
            if key not in previous:
                continue
            produced, remote = ready.get(key, (0.0, False))
            if produced + (latency_s if remote else 0.0) <= previous[key]:
                gaps[s.pp_rank].append(s.start_s - previous[key])
    return gaps


def estimate_task_overhead_s(run: TracedRun, latency_s: float) -> float:
    """Mean gap between consecutive tasks of a rank when the second one's input was already
    there (host work outside the spans: posting communication, bookkeeping, the decision),
    pooled over the ranks."""
    gaps = [g for per_rank in _gaps_with_input_ready(run, latency_s).values() for g in per_rank]
    return max(0.0, statistics.fmean(gaps)) if gaps else 0.0


def estimate_task_overheads_s(run: TracedRun, latency_s: float) -> tuple[float, ...]:
    """The same per pp rank (the pooled mean for a rank with no such gap). Per rank, because a
    static rank whose sends wait for a slow peer counts those waits here, and a pooled mean
    charges them to the slow peer too: on PP2 with one rank jittered (2-core VM), rank 0's
    mean gap was 2.7-3.2 ms and the jittered rank's 0.7-0.9 ms, and the pooled 1.6 ms put the
    static runtime's prediction 6-7 % too slow (BENCHMARKS.md)."""
    gaps = _gaps_with_input_ready(run, latency_s)
    pooled = estimate_task_overhead_s(run, latency_s)
    return tuple(max(0.0, statistics.fmean(g)) if g else pooled for _, g in sorted(gaps.items()))


def estimate_p2p_latency_s(run: TracedRun) -> float:
    """Mean delay from a producer's end to its remote consumer's start, over consumers whose
    rank sat idle waiting for it (its previous task ended before the producer did): the
    effective transfer + wake-up time of one message. 0 when no such wait was traced."""
    delays = []
    for spans in run.spans.values():
        previous, ready = _previous_end(run, spans), _input_ready(run, spans)
        for s in spans:
            produced, remote = ready.get((s.pp_rank, s.task), (0.0, False))
            if remote and previous.get((s.pp_rank, s.task), 0.0) <= produced:  # its rank sat waiting for it
                delays.append(s.start_s - produced)
    return max(0.0, statistics.fmean(delays)) if delays else 0.0
