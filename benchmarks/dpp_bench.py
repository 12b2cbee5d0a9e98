"""MegaDPP benchmark: static 1F1B / interleaved / breadth-first vs dynamic, with and without jitter.

Every run is a real `megatronapp train` job (gloo, CPU, one thread per rank). Variants run
interleaved within each repeat (shuffled per repeat with --seed), so slow drifts of the host
hit all variants alike; per run the median step time after --warmup iterations is kept,
and the report gives, per scenario and variant, the median over repeats, the spread
(min..max), iterations/s relative to static interleaved, and the peak in-flight activation
sets per pipeline rank the schedule allows (static: the schedule's own peak from the
simulator; dynamic: its cap, which the runtime never exceeds).

Scenarios (global ranks; the default layout is PP4 x DP2, so rank 4 is pp 2 of replica 0):
  balanced  no injection
  jitter1   --inject-jitter 4:1.5           one rank, each task up to 1.5x
  jitter2   --inject-jitter 2:1.5:1 --inject-jitter 4:1.5:2   two ranks, independently (they alternate)
  link      --inject-link-delay 2:4:5       pp1 -> pp2 of replica 0 delayed 5 ms

    python benchmarks/dpp_bench.py --out runs/dpp_bench                 # 8 ranks, for a 16-core host
    python benchmarks/dpp_bench.py --smoke --out /tmp/dpp_smoke         # tiny, a couple of minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIOS = {
    "balanced": [],
    "jitter1": ["--inject-jitter", "4:1.5"],
    "jitter2": ["--inject-jitter", "2:1.5:1", "--inject-jitter", "4:1.5:2"],
    "link": ["--inject-link-delay", "2:4:5"],
}
VARIANTS = {  # name: (schedule, virtual stages?, extra flags)
    "1f1b": ("1f1b", False, []),
    "interleaved": ("interleaved", True, []),
    "breadth-first": ("breadth-first", True, []),
    "dynamic-df": ("dynamic", True, ["--dpp-traversal", "depth-first"]),
    "dynamic-adaptive": ("dynamic", True, ["--dpp-traversal", "adaptive"]),
}


def _train_cmd(a, variant: str, scenario: str, metrics: str) -> list[str]:
    schedule, virtual, extra = VARIANTS[variant]
    per_vstage = a.num_layers // (a.pp * a.vpp)
    cmd = [sys.executable, "-m", "megatronapp.cli.main", "train", "--device", "cpu", "--model", "demo",
           "--nproc-per-node", str(a.nproc), "--pipeline-model-parallel-size", str(a.pp),
           "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--seq-length", str(a.seq_length),
           "--micro-batch-size", "1", "--global-batch-size", str(a.microbatches * (a.nproc // a.pp)),
           "--train-iters", str(a.iters), "--log-interval", "1", "--pipeline-schedule", schedule,
           "--metrics-file", metrics, *extra, *SCENARIOS[scenario]]
    if virtual:
        cmd += ["--num-layers-per-virtual-pipeline-stage", str(per_vstage)]
    return cmd


def run_once(a, variant: str, scenario: str) -> float:
    """Median step seconds of one job after the warm-up iterations."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(_train_cmd(a, variant, scenario, metrics), capture_output=True, text=True,
                             timeout=a.timeout, env=env)
        if res.returncode:
            raise RuntimeError(f"{variant}/{scenario} failed: {res.stderr[-2000:]}")
        steps = [json.loads(line)["step_time_s"] for line in Path(metrics).read_text().splitlines()]
    return statistics.median(steps[a.warmup:])


def schedule_peaks(a, variant: str) -> list[int]:
    """Peak in-flight activation sets per pipeline rank (static: simulated; dynamic: the cap)."""
    from megatronapp.dpp.scheduler import compute_default_caps
    from megatronapp.dpp.simulator import CostModel, simulate
    from megatronapp.pipeline.schedules import build_schedule

    schedule, virtual, _ = VARIANTS[variant]
    v = a.vpp if virtual else 1
    if schedule == "dynamic":
        return compute_default_caps(a.pp, v, a.microbatches)
    res = simulate(a.pp, v, a.microbatches, CostModel.uniform(a.pp, v),
                   schedule=build_schedule(schedule, a.pp, v, a.microbatches))
    return res.peak_activations


def report(a, times: dict) -> dict:
    out = {}
    for scenario in a.scenarios:
        base = statistics.median(times[(scenario, "interleaved")]) if (scenario, "interleaved") in times else None
        print(f"\n{scenario}: median ms/iteration over {a.repeats} repeats (spread), speed vs interleaved")
        for variant in a.variants:
            runs = times[(scenario, variant)]
            med = statistics.median(runs)
            speed = base / med if base else float("nan")
            per_vstage_layers = a.num_layers // (a.pp * (a.vpp if VARIANTS[variant][1] else 1))
            peaks = schedule_peaks(a, variant)
            print(f"  {variant:<17} {med * 1e3:8.1f} ms  ({min(runs) * 1e3:.1f}..{max(runs) * 1e3:.1f})  "
                  f"x{speed:.3f}  peak in-flight {peaks} sets of {per_vstage_layers} layer(s)")
            out[f"{scenario}/{variant}"] = {"median_s": med, "runs_s": runs, "speed_vs_interleaved": speed,
                                            "peak_inflight_sets": peaks, "layers_per_set": per_vstage_layers}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="per DP replica")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="2 ranks, tiny model, 1 repeat, balanced + jitter1")
    p.add_argument("--out", default="runs/dpp_bench")
    a = p.parse_args(argv)
    if a.smoke:
        a.nproc, a.pp, a.microbatches, a.num_layers, a.hidden_size, a.seq_length = 2, 2, 4, 4, 64, 32
        a.iters, a.warmup, a.repeats, a.scenarios = 5, 2, 1, ["balanced", "jitter1"]
        SCENARIOS["jitter1"] = ["--inject-jitter", "1:1.5"]
    rng, times = random.Random(a.seed), {}
    t0 = time.time()
    for rep in range(a.repeats):
        jobs = [(s, v) for s in a.scenarios for v in a.variants]
        rng.shuffle(jobs)
        for scenario, variant in jobs:
            times.setdefault((scenario, variant), []).append(run_once(a, variant, scenario))
        print(f"repeat {rep + 1}/{a.repeats} done after {time.time() - t0:.0f} s", flush=True)
    results = report(a, times)
    os.makedirs(a.out, exist_ok=True)
    path = Path(a.out) / "dpp_bench.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    os.replace(tmp, path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
