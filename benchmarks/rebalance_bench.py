"""Rebalancing under a real fault: iteration time with and without `--dpp-rebalance layers` (or `--mode`).

Each cell is one `megatronapp train` job (CPU, gloo, one rank per core) run by the fault lab, so the
fault is the machine's (a cgroup CPU quota on one rank), felt by every schedule alike.
Scenarios: balanced, and one rank at 1/`--factor` of a core from the start. Variants: the schedule
alone and the schedule with rebalancing. Repeats are interleaved (every cell once per round). A
cell's figure is the median iteration time over the iterations after `--skip` (rebalancing
variants: after their last move, so the figure is the partition they settled in), beside the
iteration of the first move.

    python benchmarks/rebalance_bench.py --out runs/rebalance --repeats 3
    python benchmarks/rebalance_bench.py --pp 2 --dp 2 --mode microbatches --out runs/rebalance-dp
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from megatronapp.faultlab import EngineJob, LabPlan, SlowRank, run_lab
from megatronapp.files import write_text_atomic


def _job(a, schedule: str, rebalance: bool, metrics: Path) -> EngineJob:
    extra = ["--model", "demo", "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)]
    extra += ["--seq-length", str(a.seq_length), "--micro-batch-size", "1", "--global-batch-size", str(a.microbatches)]
    extra += ["--log-interval", "1", "--pipeline-schedule", schedule, "--metrics-file", str(metrics)]
    if schedule in ("interleaved", "dynamic"):
        extra += ["--num-layers-per-virtual-pipeline-stage", str(a.num_layers // (a.pp * a.vpp))]
    if rebalance:
        extra += ["--dpp-rebalance", a.mode, "--dpp-rebalance-window", str(a.window)]
    return EngineJob(1, a.pp, a.dp, iters=a.iters, extra=tuple(extra))


def measure_cell(a, scenario: str, schedule: str, rebalance: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        faults = (SlowRank(a.slow_rank, "quota", factor=a.factor),) if scenario == "quota" else ()
        plan = LabPlan(_job(a, schedule, rebalance, metrics), faults, tag="rebal")
        result = run_lab(plan, Path(tmp) / "trace", timeout_s=a.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{scenario}/{schedule}: exit {result.returncode}: {result.log.read_text()[-2000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    moves = [r["iteration"] for r in rows if r.get("rebalance")]
    start = max([a.skip, *(m + 2 for m in moves)])
    steps = [r["step_time_s"] for r in rows if r["iteration"] > start]
    return {
        "median_s": statistics.median(steps),
        "first_move": moves[0] if moves else None,
        "moves": [r["rebalance"] for r in rows if r.get("rebalance")],
        "steps_s": [r["step_time_s"] for r in rows],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--mode", choices=("layers", "microbatches", "all"), default="layers", help="--dpp-rebalance")
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=8, help="the global batch (micro-batch size 1)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", type=int, default=4, help="warm-up iterations left out")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0, help="the quota: 1/factor of the rank's fair share")
    p.add_argument("--schedules", nargs="+", default=["1f1b"])
    p.add_argument("--scenarios", nargs="+", default=["balanced", "quota"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="runs/rebalance")
    a = p.parse_args(argv)
    cells = [(s, sch, rb) for s in a.scenarios for sch in a.schedules for rb in (False, True)]
    results: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for scenario, schedule, rebalance in cells:
            key = f"{scenario}/{schedule}{'+rebalance' if rebalance else ''}"
            cell = measure_cell(a, scenario, schedule, rebalance)
            results.setdefault(key, []).append(cell)
            print(f"round {rep}: {key}: {cell['median_s'] * 1e3:.1f} ms, first move {cell['first_move']}", flush=True)
    summary = {k: [c["median_s"] for c in v] for k, v in results.items()}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(a.out) / "rebalance.json", json.dumps({"args": vars(a), "cells": results}, indent=1))
    for key, values in summary.items():
        print(
            f"{key:40s} median {statistics.median(values) * 1e3:8.1f} ms  range {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
