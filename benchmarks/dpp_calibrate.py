"""Does the MegaDPP simulator predict real runs? And what does a dynamic decision cost?

1. Calibration: for each schedule, a real traced CPU job (`megatronapp train --trace`);
   the simulator then gets the task times, P2P delay and per-task host overhead measured in
   that trace (`megatronapp schedule simulate --from-trace`) and predicts the iteration's
   forward/backward window, compared with the mean recorded one (first iteration left out). "cross" rows predict
   every schedule from the *interleaved* run's costs, i.e. a schedule the simulator has
   not seen run.
2. Decision cost: the scheduler's decide() (ready set + policy) replayed through a
   simulation of a P x V x M pipeline, timed per call (median and p99, microseconds).

    python benchmarks/dpp_calibrate.py --out runs/dpp_cal                 # PP4, 4 ranks
    python benchmarks/dpp_calibrate.py --nproc 2 --pp 2 --out /tmp/cal    # small host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatronapp.dpp import trace_costs
from megatronapp.dpp.policies import build_policy
from megatronapp.dpp.scheduler import RankScheduler, compute_default_caps
from megatronapp.dpp.simulator import CostModel, simulate, simulate_agents
from megatronapp.pipeline.schedules import build_schedule

SCHEDULES = {"1f1b": False, "interleaved": True, "looped-bfs": True, "dynamic": True}  # virtual stages?


def traced_job(a, schedule: str, trace_dir: str) -> None:
    cmd = [sys.executable, "-m", "megatronapp.cli.main", "train", "--device", "cpu", "--model", "demo",
           "--nproc-per-node", str(a.nproc), "--pipeline-model-parallel-size", str(a.pp),
           "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--seq-length", str(a.seq_length),
           "--micro-batch-size", "1", "--global-batch-size", str(a.microbatches * (a.nproc // a.pp)),
           "--train-iters", str(a.iters), "--log-interval", str(a.iters), "--pipeline-schedule", schedule,
           "--trace", "--trace-dir", trace_dir, "--trace-interval", "1"]
    if SCHEDULES[schedule]:
        cmd += ["--num-layers-per-virtual-pipeline-stage", str(a.num_layers // (a.pp * a.vpp))]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode:
        raise RuntimeError(f"{schedule} failed: {res.stderr[-2000:]}")


def predict(run, cost_run, schedule: str, static_comm: str = "eager") -> float:
    """Iteration time of `schedule` from `cost_run`'s traced costs. The fitted per-task overhead
    (trace_costs.estimate_task_overhead_s) already holds the static runtime's rendezvous waits,
    so "eager" is the consistent model here; "rendezvous" would count them twice."""
    lat = trace_costs.estimate_p2p_latency_s(cost_run)
    cost = trace_costs.compute_trace_costs(cost_run, p2p_latency_s=lat,
                                           task_overhead_s=trace_costs.estimate_task_overhead_s(cost_run, lat))
    p, v, m = run.pp_size, run.num_chunks, run.num_microbatches
    if v == 1 and cost_run.num_chunks > 1:  # a 1F1B chunk holds as many layers as all V chunks of a rank
        cost = CostModel(tuple((sum(r),) for r in cost.forward_s), tuple((sum(r),) for r in cost.backward_s),
                         p2p_latency_s=cost.p2p_latency_s, task_overhead_s=cost.task_overhead_s)
    if schedule == "dynamic":
        return simulate(p, v, m, cost, traversal="depth-first", caps=compute_default_caps(p, v, m)).makespan_s
    return simulate(p, v, m, cost, schedule=build_schedule(schedule, p, v, m), static_comm=static_comm).makespan_s


def calibrate(a) -> dict:
    runs, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            d = os.path.join(tmp, schedule)
            traced_job(a, schedule, d)
            runs[schedule] = trace_costs.load_traced_run(d)
    for schedule, run in runs.items():
        measured = statistics.fmean(trace_costs.compute_iteration_times(run).values())
        own, cross = predict(run, run, schedule), predict(run, runs["interleaved"], schedule)
        rdv = own if schedule == "dynamic" else predict(run, run, schedule, "rendezvous")
        rows[schedule] = {"measured_s": measured, "predicted_s": own, "error": own / measured - 1,
                          "rendezvous_predicted_s": rdv, "rendezvous_error": rdv / measured - 1,
                          "cross_predicted_s": cross, "cross_error": cross / measured - 1}
        print(f"  {schedule:<14} measured {measured * 1e3:8.2f} ms  predicted {own * 1e3:8.2f} ms "
              f"({own / measured - 1:+.1%}; rendezvous comm model {rdv / measured - 1:+.1%})  from interleaved's "
              f"costs {cross * 1e3:8.2f} ms ({cross / measured - 1:+.1%})")
    return rows


def decision_cost(pp: int, vpp: int, m: int, traversal: str) -> dict:
    """Per-call time of RankScheduler.decide() over one simulated step (all ranks)."""
    times: list[int] = []

    class Timed(RankScheduler):
        def decide(self):
            t0 = time.perf_counter_ns()
            out = super().decide()
            times.append(time.perf_counter_ns() - t0)
            return out

    caps = compute_default_caps(pp, vpp, m)
    for _ in range(20):
        agents = [Timed(p, pp, vpp, m, caps[p], build_policy(traversal, p, pp, vpp, m)) for p in range(pp)]
        simulate_agents(agents, CostModel.uniform(pp, vpp, p2p_latency_s=0.3))
    times.sort()
    return {"median_us": times[len(times) // 2] / 1e3, "p99_us": times[int(len(times) * 0.99)] / 1e3,
            "calls": len(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-calibration", action="store_true")
    p.add_argument("--out", default="runs/dpp_calibrate")
    a = p.parse_args(argv)
    result = {"args": vars(a)}
    if not a.skip_calibration:
        print(f"calibration: PP{a.pp} x V{a.vpp}, M={a.microbatches}, {a.nproc} CPU ranks")
        result["calibration"] = calibrate(a)
    print("decision cost (RankScheduler.decide, microseconds):")
    result["decision_cost"] = {}
    for pp, vpp, m in [(4, 2, 8), (8, 2, 16), (8, 4, 32)]:
        for traversal in ("depth-first", "adaptive"):
            c = decision_cost(pp, vpp, m, traversal)
            result["decision_cost"][f"P{pp}V{vpp}M{m}/{traversal}"] = c
            print(f"  P{pp} V{vpp} M{m} {traversal:<12} median {c['median_us']:.1f} us, p99 {c['p99_us']:.1f} us")
    os.makedirs(a.out, exist_ok=True)
    path = Path(a.out) / "dpp_calibrate.json"
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
