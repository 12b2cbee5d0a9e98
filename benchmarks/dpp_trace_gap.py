"""Where a measured pipeline-schedule speed-up departs from the simulator's: traced dpp_bench cells.

`dpp_bench.py --trace-cells` traces one extra pass of every (scenario, variant) cell into
OUT/traces/SCENARIO__VARIANT. For each traced cell this reads one pipeline (tp 0, dp 0) and
gives, from the trace alone, over the iterations after --warmup:
  measured   mean iteration: first task start to last task end
  busy       per pp rank, the share of the iteration inside its compute spans
  fwd / bwd  mean task ms per pp rank (a jittered rank's draws included)
  host gap   per pp rank, mean gap between its consecutive tasks when the second one's input
             had already arrived (posting communication, bookkeeping, the decision; for the
             static runtime also its sends' waits for a slow receiver)
  p2p        mean delay from a producer's end to a waiting consumer's start
and, from the simulator, `predicted`: the mean over --seeds jitter draws of the simulated
iteration, with this cell's task times (a jittered rank's divided by its mean factor, as
the simulator draws the jitter again, in run order, as the injector does), this cell's
host gap and link delays, and the p2p delay of the variant's balanced cell (this cell's
would hold a delayed link's delay, which the simulator adds itself). Everything but p2p
comes from the cell itself, so a host that drifts between cells does not show as error. Static variants are simulated with eager communication, as
`megatronapp schedule simulate --from-trace` does (the fitted host gap holds their waits).
Per scenario it then sets each variant's measured speed over interleaved beside the
predicted one: if the two variants' task times are alike and their predictions are right,
the simulator's ratio stands; a variant measured well above its own prediction loses time
the model does not have, and which of busy, host gap or p2p moved says where.

    python benchmarks/dpp_bench.py --pp 8 --microbatches 16 --num-layers 16 --iters 7 --warmup 2 \\
        --repeats 8 --scenarios balanced jitter2 --variants interleaved dynamic-inorder --trace-cells --out OUT
    python benchmarks/dpp_trace_gap.py OUT --warmup 2 --json OUT/trace_gap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from megatronapp.dpp.config import JitterSpec, parse_jitter
from megatronapp.dpp.sim.simulator import CostModel, simulate
from megatronapp.dpp.study import variants as sim_variants
from megatronapp.dpp.sim.trace_costs import (
    TracedRun,
    compute_iteration_times,
    compute_trace_costs,
    estimate_p2p_latency_s,
    estimate_task_overheads_s,
    load_traced_run,
)
from megatronapp.faults.inject import parse_fault_plan
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.actions import ActionKind

# dpp_bench variant -> the simulator's (megatronapp.dpp.study.variants) name for it
SIM_NAME = {"interleaved": "interleaved/eager", "breadth-first": "looped-bfs/eager",
            "dynamic-df": "dynamic-depth-first", "dynamic-adaptive": "dynamic-adaptive",
            "dynamic-inorder": "dynamic-in-order"}
TRAVERSALS = ("depth-first", "adaptive", "in-order")


def load_cells(out: Path, warmup: int) -> dict[tuple[str, str], TracedRun]:
    """(scenario, variant) -> its traced run, iterations before `warmup` left out."""
    cells = {}
    for d in sorted((out / "traces").glob("*__*")):
        scenario, variant = d.name.split("__", 1)
        run = load_traced_run(str(d))
        kept = {it: spans for it, spans in run.spans.items() if it >= warmup}
        if not kept:
            raise SystemExit(f"dpp_trace_gap: {d} has no traced iteration at or after --warmup {warmup}")
        cells[(scenario, variant)] = replace(run, spans=kept)
    if not cells:
        raise SystemExit(f"dpp_trace_gap: no traced cells under {out / 'traces'} (run dpp_bench.py --trace-cells)")
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
    links = tuple((to_pp[s], to_pp[d], delay.ms / 1e3) for (s, d), delay in plan.link_delays.items()
                  if s in to_pp and d in to_pp)
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
    return {"iterations": len(iterations), "measured_ms": measured * 1e3,
            "busy": [b / (measured * len(iterations)) for b in busy],
            "fwd_ms": [statistics.fmean(task_ms.get((p, ActionKind.FORWARD), [0.0])) for p in range(run.pp_size)],
            "bwd_ms": [statistics.fmean(task_ms.get((p, ActionKind.BACKWARD), [0.0])) for p in range(run.pp_size)],
            "host_gap_ms": [g * 1e3 for g in estimate_task_overheads_s(run, latency)], "p2p_ms": latency * 1e3}


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
    return statistics.fmean(
        simulate(run.pp_size, run.num_chunks, run.num_microbatches, replace(base, **injections(run, seed)), **kw
                 ).makespan_s for seed in range(seeds)) * 1e3


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


def _fmt(values: list[float], spec: str) -> str:
    return " ".join(format(v, spec) for v in values)


def print_report(result: dict) -> None:
    for scenario, rows in result.items():
        print(f"\n{scenario}")
        for variant, r in rows.items():
            pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] else "-"
            err = f" ({r['measured_ms'] / r['predicted_ms'] - 1:+.1%} vs predicted)" if r["predicted_ms"] else ""
            print(f"  {variant:<17} measured {r['measured_ms']:.1f} ms, predicted {pred} ms{err}, "
                  f"n={r['iterations']}")
            print(f"  {'':<17} busy {_fmt(r['busy'], '.0%')}; fwd ms {_fmt(r['fwd_ms'], '.2f')}; "
                  f"bwd ms {_fmt(r['bwd_ms'], '.2f')}; host gap ms {_fmt(r['host_gap_ms'], '.3f')}; "
                  f"p2p {r['p2p_ms']:.3f} ms")
            if "measured_speed" in r:
                pred_speed = f"x{r['predicted_speed']:.3f}" if "predicted_speed" in r else "-"
                print(f"  {'':<17} speed over interleaved: measured x{r['measured_speed']:.3f}, predicted {pred_speed}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="a dpp_bench.py --out directory run with --trace-cells")
    p.add_argument("--warmup", type=int, default=2, help="traced iterations to leave out (dpp_bench's --warmup)")
    p.add_argument("--seeds", type=int, default=8, help="jitter draws to average each prediction over")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    result = analyse(load_cells(a.out, a.warmup), a.seeds)
    print_report(result)
    if a.json:
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
