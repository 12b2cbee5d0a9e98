"""Task times and timelines read from a MegaScan trace directory (the `--from-trace` input).

One pipeline is read: the ranks with tp = 0 and dp = 0. Their "forward"/"backward" compute
spans carry (chunk, microbatch) attributes; the cost model takes, per (pp rank, chunk,
kind), the median duration over the traced iterations.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from megatronapp.dpp.simulator import CostModel, Span
from megatronapp.dpp.tasks import backward_task, forward_task


@dataclass(frozen=True)
class TracedRun:
    pp_size: int
    num_chunks: int
    num_microbatches: int
    schedule: str
    spans: dict  # iteration -> list[Span] (seconds from that iteration's first task)


def load_traced_run(trace_dir: str) -> TracedRun:
    """The compute spans of one pipeline of a traced run; ValueError when there are none."""
    from megatronapp.scan.format import load_trace_dir

    traces = [t for t in load_trace_dir(trace_dir) if t.meta["coords"]["tp"] == 0 and t.meta["coords"]["dp"] == 0]
    layout = traces[0].meta["layout"]
    by_iter: dict[int, list] = {}
    num_mb = 0
    for trace in traces:
        pp = trace.meta["coords"]["pp"]
        cols = trace.events.select(["name", "cat", "start_ns", "end_ns", "iteration", "chunk", "microbatch"]).to_pydict()
        for name, cat, start, end, it, chunk, mb in zip(*cols.values()):
            if cat != "compute" or name not in ("forward", "backward") or chunk < 0 or mb < 0:
                continue
            task = (forward_task if name == "forward" else backward_task)(chunk, mb)
            by_iter.setdefault(it, []).append((pp, task, start, end))
            num_mb = max(num_mb, mb + 1)
    if not by_iter:
        raise ValueError(f"{trace_dir}: no forward/backward spans with chunk and microbatch attributes")
    spans = {}
    for it, rows in by_iter.items():
        t0 = min(r[2] for r in rows)
        spans[it] = sorted((Span(pp, task, (s - t0) / 1e9, (e - t0) / 1e9) for pp, task, s, e in rows),
                           key=lambda s: s.start_s)
    return TracedRun(layout["pp_size"], layout["virtual_pp_size"], num_mb,
                     traces[0].meta.get("run", {}).get("schedule", "custom"), spans)


def compute_trace_costs(run: TracedRun, **link) -> CostModel:
    """Median forward/backward seconds per (pp rank, chunk) over every traced iteration."""
    samples: dict = {}
    for spans in run.spans.values():
        for s in spans:
            samples.setdefault((s.pp_rank, s.task.kind, s.task.chunk), []).append(s.end_s - s.start_s)

    def table(kind) -> tuple:
        return tuple(tuple(statistics.median(samples.get((p, kind, c), [0.0])) for c in range(run.num_chunks))
                     for p in range(run.pp_size))

    return CostModel(table(forward_task(0, 0).kind), table(backward_task(0, 0).kind), **link)


def compute_iteration_times(run: TracedRun) -> dict[int, float]:
    """Seconds from the first task start to the last task end, per traced iteration."""
    return {it: max(s.end_s for s in spans) for it, spans in run.spans.items()}
