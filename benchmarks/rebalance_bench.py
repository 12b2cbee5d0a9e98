"""Rebalancing under real faults: iteration time of each schedule with and without `--dpp-rebalance`.

Each cell is one training job (CPU, gloo, one rank per core) run by the fault lab, so the fault
is the machine's and every schedule feels it alike, PyTorch's included. Scenarios, all on
`--slow-rank`: balanced; quota (a cgroup CPU quota of 1/`--factor` of the rank's fair share
from the start); compete (round(factor - 1) busy loops pinned to the rank's core); starts (the
quota from `--fault-at-s` after the ranks are up); stops (the quota until then); link (`tc`
limits the pipeline link `--slow-link` to `--link-mbit`, each rank in its own network namespace:
a fault a planner that reads compute times should not move layers for). Variants:
each of `--schedules` alone and with rebalancing (`--mode`); `torch-zb` is PyTorch's
`ScheduleInterleavedZeroBubble` on the same chunks (benchmarks/torch_zb_cell.py, never
rebalanced). Every round runs every cell once, in a fresh random order.

A cell's figures: `median_s`, the median step after `--skip` (rebalancing variants: after their
last move, so the figure is the partition they settled in); `tail_median_s`, the median of the
last quarter of the steps (where a stopped fault's work has moved back); the iteration of the
first move and of every move (`move_iters`); `slowed_at`, the iteration from which its steps ran slower (where a fault that starts
mid-run began to cost, so a re-plan's delay is `first_move - slowed_at`). The summary pairs each variant with its schedule alone in the same round, and only
when both ran in the same invocation, so one machine's pace is never paired with another's.

Every cell is written to `OUT/rebalance.json` as it ends; `--resume` continues that file where it
stopped (a device call cut short by its time limit loses at most the cell in flight), refusing
one whose measurement flags differ. Several runs can share a machine, each under `taskset` on its
own cores with its own `--tag`: a lab's faults keep to the cores it was started on, and each cell
records how many it had.

    python benchmarks/rebalance_bench.py --out runs/rebalance --repeats 3
    python benchmarks/rebalance_bench.py --out runs/rebalance --repeats 8 --resume
    python benchmarks/rebalance_bench.py --pp 2 --dp 2 --mode microbatches --out runs/rebalance-dp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatronapp.faultlab import EngineJob, LabPlan, ScriptJob, SlowLink, SlowRank, run_lab
from megatronapp.faultlab.cpu import Schedule, lab_cores
from megatronapp.files import write_text_atomic

SCENARIOS = ("balanced", "quota", "compete", "starts", "stops", "link")
TORCH_ZB = "torch-zb"
_FOREVER_MS = 10**9
_VIRTUAL = ("interleaved", "looped-bfs", "interleaved-zb", "dynamic", TORCH_ZB)  # schedules of virtual stages
_TORCH_ZB_STEPS = re.compile(r"torch-zb: \[([^\]]*)\] ms/step")
# Flags that do not change what a cell measures: a resumed file may differ in these.
_NOT_MEASURED = frozenset({"repeats", "resume", "out", "timeout", "tag"})


def faults(a, scenario: str) -> tuple:
    """The fault lab faults of `scenario` (none for balanced)."""
    at_ms = int(a.fault_at_s * 1000)
    schedule = {
        "starts": Schedule(on_ms=_FOREVER_MS, period_ms=_FOREVER_MS + 1, start_ms=at_ms),
        "stops": Schedule(on_ms=at_ms, period_ms=_FOREVER_MS),
    }.get(scenario)
    if scenario == "balanced":
        return ()
    if scenario == "link":
        src, dst = parse_link(a.slow_link)
        return (SlowLink(src, dst, a.link_mbit),)
    return (SlowRank(a.slow_rank, "compete" if scenario == "compete" else "quota", a.factor, schedule),)


def train_flags(a, schedule: str, metrics: Path | None) -> list[str]:
    """The cell's `megatronapp train` flags (torch-zb builds the interleaved cell's chunks)."""
    flags = ["--model", "demo", "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)]
    flags += ["--seq-length", str(a.seq_length), "--micro-batch-size", "1", "--global-batch-size", str(a.microbatches)]
    flags += ["--log-interval", "1", "--pipeline-schedule", "interleaved" if schedule == TORCH_ZB else schedule]
    if schedule in _VIRTUAL:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(a.num_layers // (a.pp * a.vpp))]
    if metrics is not None:
        flags += ["--metrics-file", str(metrics)]
    return flags


def _plan(a, scenario: str, schedule: str, rebalance: bool, metrics: Path) -> LabPlan:
    if schedule == TORCH_ZB:
        argv = ["train", "--pipeline-model-parallel-size", str(a.pp), "--train-iters", str(a.iters)]
        argv += ["--device", "cpu", *train_flags(a, schedule, None)]
        job = ScriptJob(str(Path(__file__).with_name("torch_zb_cell.py")), tuple(argv), a.pp * a.dp)
    else:
        extra = train_flags(a, schedule, metrics)
        if rebalance:
            extra += ["--dpp-rebalance", a.mode, "--dpp-rebalance-window", str(a.window)]
        job = EngineJob(1, a.pp, a.dp, iters=a.iters, extra=tuple(extra))
    fs = faults(a, scenario)
    nodes = job.nproc if any(isinstance(f, SlowLink) for f in fs) else 0  # tc needs a namespace per rank
    return LabPlan(job, fs, nodes=nodes, tag=a.tag)


def _steps(plan: LabPlan, result, metrics: Path) -> tuple[list[float], list[dict], list[int]]:
    """Per-step seconds, the moves and the iterations they happened at."""
    if isinstance(plan.job, ScriptJob):
        found = _TORCH_ZB_STEPS.findall(result.log.read_text())
        if not found:
            raise RuntimeError(f"torch-zb printed no step times: {result.log.read_text()[-2000:]}")
        return [float(x) / 1e3 for x in found[-1].split(",")], [], []
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    moves = [r for r in rows if r.get("rebalance")]
    return [r["step_time_s"] for r in rows], [r["rebalance"] for r in moves], [r["iteration"] for r in moves]


def cell_figures(steps: list[float], move_iters: list[int], skip: int) -> dict:
    """median_s after warm-up and the last move (iterations count from 1), tail_median_s over
    the last quarter, first_move."""
    start = max([skip, *(m + 2 for m in move_iters)])
    settled = steps[start:] or steps[-1:]
    return {
        "median_s": statistics.median(settled),
        "tail_median_s": statistics.median(steps[-max(1, len(steps) // 4) :]),
        "first_move": move_iters[0] if move_iters else None,
        "slowed_at": first_slowed_iteration(steps, skip),
    }


def first_slowed_iteration(steps: list[float], skip: int, factor: float = 1.25, run: int = 4) -> int | None:
    """The iteration (from 1) from which the step time rose: the first step that, and the median of
    the `run` steps it starts, exceed `factor` x the median of the steps before it (those after
    `skip`, at least `run`). A fault that starts mid-run shows here, in the run's own steps,
    whatever the job's start-up took."""
    for i in range(skip + run, len(steps) - run + 1):
        before = factor * statistics.median(steps[skip:i])
        if steps[i] > before and statistics.median(steps[i : i + run]) > before:
            return i + 1
    return None


def measure_cell(a, scenario: str, schedule: str, rebalance: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        plan = _plan(a, scenario, schedule, rebalance, metrics)
        result = run_lab(plan, Path(tmp) / "trace", timeout_s=a.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"exit {result.returncode}: {result.log.read_text()[-2000:]}")
        steps, moves, move_iters = _steps(plan, result, metrics)
    skip = a.skip - 1 if schedule == TORCH_ZB else a.skip  # torch_zb_cell leaves out its first step
    figures = cell_figures(steps, move_iters, skip)
    return {**figures, "moves": moves, "move_iters": move_iters, "steps_s": steps, "applied": result.applied}


def _ran(cell: dict | None) -> bool:
    return cell is not None and "error" not in cell


def paired_summary(cells: dict[str, list[dict | None]]) -> dict[str, dict]:
    """Per cell: median of its rounds; per rebalancing cell also the speed over its schedule
    alone, paired per round (schedule-alone median / rebalanced median) where both ran in the same
    invocation (`call`). A round not yet run is None."""
    out = {}
    for key, rounds in cells.items():
        ok = [c for c in rounds if _ran(c)]
        row = {"n": len(ok), "median_s": statistics.median(c["median_s"] for c in ok) if ok else None}
        row["tail_median_s"] = statistics.median(c["tail_median_s"] for c in ok) if ok else None
        base = cells.get(key.removesuffix("+rebalance"))
        if key.endswith("+rebalance") and base:
            pairs = [
                b["median_s"] / c["median_s"]
                for b, c in zip(base, rounds)
                if _ran(b) and _ran(c) and b.get("call") == c.get("call")
            ]
            if pairs:
                row.update(n_pairs=len(pairs), speedup=statistics.median(pairs), speedup_range=[min(pairs), max(pairs)])
        out[key] = row
    return out


def round_order(cells: list, seed: int, rep: int) -> list:
    """The cells of round `rep` in their order: fixed by (seed, round), so a resumed run orders
    its rounds as an uninterrupted one would."""
    return random.Random(f"{seed}/{rep}").sample(cells, len(cells))


def resumed_cells(a, payload: dict) -> dict[str, list[dict | None]]:
    """The rounds of an earlier run of the same measurement, padded to `a.repeats`; ValueError
    naming the first flag that differs (a flag the file predates counts at its default)."""
    now = {k: v for k, v in vars(a).items() if k not in _NOT_MEASURED}
    defaults = vars(build_parser().parse_args([]))
    for k, v in now.items():
        was = payload["args"].get(k, defaults[k])
        if was != v:
            raise ValueError(f"--{k.replace('_', '-')} {v} differs from the file's {was}")
    return {k: v + [None] * (a.repeats - len(v)) for k, v in payload["cells"].items()}


def _cells(a) -> list[tuple[str, str, bool]]:
    return [
        (s, sch, rb)
        for s in a.scenarios
        for sch in a.schedules
        for rb in ((False,) if sch == TORCH_ZB else (False, True))
    ]


def parse_link(text: str) -> tuple[int, int]:
    """`--slow-link` SRC:DST as two ranks; ValueError otherwise."""
    try:
        src, dst = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--slow-link: expected SRC:DST ranks, got {text!r}") from None
    return src, dst


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--factor", type=float, default=2.0, help="the fault: 1/factor of the rank's fair share")
    p.add_argument("--slow-link", default="0:1", help="link: SRC:DST ranks")
    p.add_argument("--link-mbit", type=float, default=40.0, help="link: the limit in Mbit/s")
    p.add_argument(
        "--fault-at-s",
        type=float,
        default=20.0,
        help="starts/stops: seconds after the ranks are up (start-up counts: on a busy host the first step came ~20 s later)",
    )
    p.add_argument("--schedules", nargs="+", default=["1f1b"], help=f"pipeline schedules, and {TORCH_ZB}")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=["balanced", "quota"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the cells' order in each round")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="runs/rebalance")
    p.add_argument("--resume", action="store_true", help="continue OUT/rebalance.json: run the cells it lacks")
    p.add_argument("--tag", default="rebal", help="the lab's namespaces and cgroups: one per bench run side by side")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if TORCH_ZB in a.schedules and a.vpp < 2:
        p.error(f"{TORCH_ZB} runs interleaved chunks: give --vpp >= 2")
    try:
        link = parse_link(a.slow_link)
        if a.link_mbit <= 0:
            raise ValueError(f"--link-mbit must be > 0, got {a.link_mbit}")
        if "link" in a.scenarios:
            LabPlan(EngineJob(1, a.pp, a.dp), (SlowLink(*link, a.link_mbit),), nodes=a.pp * a.dp)
    except ValueError as e:
        p.error(str(e))
    results, cells = {}, _cells(a)
    out = Path(a.out) / "rebalance.json"
    if a.resume and out.exists():
        try:
            results = resumed_cells(a, json.loads(out.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"--resume {out}: {e}")
    call = f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
    for rep in range(a.repeats):
        for scenario, schedule, rebalance in round_order(cells, a.seed, rep):
            key = f"{scenario}/{schedule}{'+rebalance' if rebalance else ''}"
            rounds = results.setdefault(key, [None] * a.repeats)
            if rounds[rep] is not None:
                continue
            try:
                cell = measure_cell(a, scenario, schedule, rebalance)
            except RuntimeError as e:
                cell = {"error": str(e)}
            rounds[rep] = {**cell, "call": call, "cores": len(lab_cores())}
            shown = cell.get("error", "")[:200] or f"{cell['median_s'] * 1e3:.1f} ms, first move {cell['first_move']}"
            print(f"round {rep}: {key}: {shown}", flush=True)
            _write(a, out, results)
    for key, row in paired_summary(results).items():
        print(f"{key:36s} {json.dumps(row)}")
    return 0


def _write(a, out: Path, results: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(a), "argv": sys.argv[1:], "cells": results, "summary": paired_summary(results)}
    write_text_atomic(out, json.dumps(payload, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
