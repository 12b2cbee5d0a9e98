"""Where a measured pipeline-schedule speed-up departs from the simulator's, from traced cells.

A benchmark cell (one scenario, one schedule variant: benchmarks/dpp_bench.py --trace-cells)
traced into OUT/traces/SCENARIO__VARIANT is read for one pipeline (tp 0, dp 0); over the
iterations after the warm-up the trace alone gives the measured iteration, each pp rank's busy
share, its mean task times, its host gap between tasks whose input had arrived, and the p2p
delay (`cell_stats`). `predict_ms` simulates the same iteration from those numbers: task times
of a jittered rank divided by its mean factor (the simulator draws the jitter again, as the
injector does), the cell's host gap and link delays, the p2p delay of the variant's balanced
cell (this cell's would hold a delayed link's delay, which the simulator adds itself). Static
variants are simulated with eager communication, as `schedule simulate --from-trace` does.
`analyse` sets each variant's measured speed over interleaved beside the predicted one.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from megatronapp.dpp.config import JitterSpec, parse_jitter
from megatronapp.dpp.sim.simulator import CostModel, simulate
from megatronapp.dpp.sim.study import variants as sim_variants
from megatronapp.dpp.sim.trace_costs import (
    TracedRun,
    compute_iteration_times,
    compute_trace_costs,
    estimate_p2p_latency_s,
    estimate_task_overheads_s,
    load_traced_run,
)
from megatronapp.injection.inject import parse_fault_plan
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.actions import ActionKind

# dpp_bench variant -> the simulator's (megatronapp.dpp.sim.study.variants) name for it
SIM_NAME = {
    "interleaved": "interleaved/eager",
    "breadth-first": "looped-bfs/eager",
    "dynamic-df": "dynamic-depth-first",
    "dynamic-adaptive": "dynamic-adaptive",
    "dynamic-inorder": "dynamic-in-order",
}
TRAVERSALS = ("depth-first", "adaptive", "in-order")


def load_cells(out: Path | str, warmup: int) -> dict[tuple[str, str], TracedRun]:
    """(scenario, variant) -> its traced run, iterations before `warmup` left out."""
    out, cells = Path(out), {}
    for d in sorted((out / "traces").glob("*__*")):
        scenario, variant = d.name.split("__", 1)
        run = load_traced_run(str(d))
        kept = {it: spans for it, spans in run.spans.items() if it >= warmup}
        if not kept:
            raise ValueError(f"{d} has no traced iteration at or after --warmup {warmup}")
        cells[(scenario, variant)] = replace(run, spans=kept)
    if not cells:
        raise ValueError(f"no traced cells under {out / 'traces'} (run dpp_bench.py --trace-cells)")
    return cells


def _pp_rank_of_global(run: TracedRun) -> dict[int, int]:
    """Global rank -> pp rank for the traced pipeline (tp 0, dp 0) of a TP1 x PP x DP job."""
    layout = ParallelLayout(run.pp_size * run.dp_size, 1, run.pp_size)
    return {layout.rank_of(tp=0, dp=0, pp=p): p for p in range(run.pp_size)}


def injections(run: TracedRun, seed: int) -> dict:
    """CostModel keyword arguments for the cell's own --inject-jitter / --inject-link-delay,
    on the traced pipeline's pp ranks; `seed` shifts the jitter draws (other iterations)."""
    to_pp = _pp_rank_of_global(run)
    specs = [parse_jitter(s) for s in run.run_meta.get("inject_jitter", [])]
    width = max(1, len(specs))
    jitter = tuple(JitterSpec(to_pp[j.rank], j.max_factor, width * seed + j.seed) for j in specs if j.rank in to_pp)
    plan = parse_fault_plan([], run.run_meta.get("inject_link_delay", []))
    links = tuple(
        (to_pp[s], to_pp[d], delay.ms / 1e3) for (s, d), delay in plan.link_delays.items() if s in to_pp and d in to_pp
    )
    return {"jitter": jitter, "link_delay_s": links}


def cell_stats(run: TracedRun) -> dict:
    """What the trace of one cell says by itself (module docstring)."""
    iterations = compute_iteration_times(run)
    measured = statistics.fmean(iterations.values())
    busy = [0.0] * run.pp_size
    task_ms: dict = {}
    for spans in run.spans.values():
        for s in spans:
            busy[s.pp_rank] += s.end_s - s.start_s
            task_ms.setdefault((s.pp_rank, s.task.kind), []).append((s.end_s - s.start_s) * 1e3)
    latency = estimate_p2p_latency_s(run)
    return {
        "iterations": len(iterations),
        "measured_ms": measured * 1e3,
        "busy": [b / (measured * len(iterations)) for b in busy],
        "fwd_ms": [statistics.fmean(task_ms.get((p, ActionKind.FORWARD), [0.0])) for p in range(run.pp_size)],
        "bwd_ms": [statistics.fmean(task_ms.get((p, ActionKind.BACKWARD), [0.0])) for p in range(run.pp_size)],
        "host_gap_ms": [g * 1e3 for g in estimate_task_overheads_s(run, latency)],
        "p2p_ms": latency * 1e3,
    }


def dejittered_costs(run: TracedRun, **link) -> CostModel:
    """The cell's own mean task times, each jittered rank's divided by its mean factor
    (1 + MAXFACTOR) / 2: the injector stretches a task by its factor, drawn independently of
    the task, so the simulator can draw the jitter again on top of these."""
    cost = compute_trace_costs(run, **link)
    mean_factor = {j.rank: (1.0 + j.max_factor) / 2 for j in injections(run, 0)["jitter"]}

    def undo(table):
        return tuple(tuple(t / mean_factor.get(p, 1.0) for t in row) for p, row in enumerate(table))

    return replace(cost, forward_s=undo(cost.forward_s), backward_s=undo(cost.backward_s))


def predict_ms(run: TracedRun, balanced: TracedRun, variant: str, seeds: int) -> float | None:
    """Simulated mean iteration of `variant`: this cell's de-jittered task times and host gap,
    the p2p delay of the variant's balanced cell (a delayed link would count twice in this
    cell's), the cell's injections drawn again; None for a variant the simulator does not name."""
    if variant not in SIM_NAME:
        return None
    latency = estimate_p2p_latency_s(balanced)
    base = dejittered_costs(run, p2p_latency_s=latency, task_overhead_s=estimate_task_overheads_s(run, latency))
    kw = sim_variants(run.pp_size, run.num_chunks, run.num_microbatches, TRAVERSALS)[SIM_NAME[variant]]
    return (
        statistics.fmean(
            simulate(
                run.pp_size, run.num_chunks, run.num_microbatches, replace(base, **injections(run, seed)), **kw
            ).makespan_s
            for seed in range(seeds)
        )
        * 1e3
    )


def analyse(cells: dict[tuple[str, str], TracedRun], seeds: int) -> dict:
    """scenario -> variant -> stats + predicted_ms; plus speeds over interleaved, measured and predicted."""
    out: dict = {}
    for (scenario, variant), run in sorted(cells.items()):
        balanced = cells.get(("balanced", variant), run)
        row = cell_stats(run)
        row["predicted_ms"] = predict_ms(run, balanced, variant, seeds)
        row["p2p_from"] = "balanced" if ("balanced", variant) in cells else "this cell (no balanced cell)"
        out.setdefault(scenario, {})[variant] = row
    for rows in out.values():
        base = rows.get("interleaved")
        for variant, row in rows.items():
            if base is None or variant == "interleaved":
                continue
            row["measured_speed"] = base["measured_ms"] / row["measured_ms"]
            if base["predicted_ms"] and row["predicted_ms"]:
                row["predicted_speed"] = base["predicted_ms"] / row["predicted_ms"]
    return out
