"""The cells of the MegaDPP benchmark (benchmarks/dpp_bench.py) and their bookkeeping.

A *cell* is one scenario (scenarios.py) under one schedule variant, run as a `megatronapp train`
job. This module holds what does not start processes: the variants and the train flags of a
cell, the plan of cells, the simulator's prediction and the activation memory of each variant,
one record per measured cell, the statistics over repeats (medians, paired speeds against
static interleaved) and the loop that measures cells one after the other, writing each record
the moment it is measured and stopping at a time budget.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from megatronapp.paired import bootstrap_median_ci

VARIANTS = {  # name: (schedule, virtual stages?, extra flags)
    "1f1b": ("1f1b", False, []),
    "interleaved": ("interleaved", True, []),
    # the same schedule on each static transport (pipeline/transport.py; "interleaved" takes the
    # default, batched): receives posted ahead, or each run of comm actions as one batch where
    # the schedule has it (on gloo: receives posted lazily)
    "interleaved-ahead": ("interleaved", True, ["--pipeline-recv-ahead"]),
    "interleaved-batched": ("interleaved", True, ["--no-pipeline-recv-ahead"]),
    "breadth-first": ("looped-bfs", True, []),
    # static zero-bubble schedules: backward split into I and W, W in the unit-cost bubbles
    "zb-h1": ("zb-h1", False, []),
    "interleaved-zb": ("interleaved-zb", True, []),
    # the dynamic runtime without W filling (whole backward), as published before the split
    "dynamic-df": ("dynamic", True, ["--dpp-traversal", "depth-first", "--no-split-backward"]),
    "dynamic-adaptive": ("dynamic", True, ["--dpp-traversal", "adaptive", "--no-split-backward"]),
    "dynamic-inorder": ("dynamic", True, ["--dpp-traversal", "in-order", "--no-split-backward"]),
    # sends on the compute thread (no sender thread, p2p.outbox.Outbox); dynamic-inorder's
    # default (auto) uses the thread where each rank has a spare core
    "dynamic-inorder-inline": (
        "dynamic",
        True,
        ["--dpp-traversal", "in-order", "--dpp-send-thread", "off", "--no-split-backward"],
    ),
    # the default dynamic schedule: in-order with W filling (split backward)
    "dynamic-w": ("dynamic", True, ["--dpp-traversal", "in-order"]),
    # PyTorch's ScheduleInterleavedZeroBubble on the same chunks (benchmarks/torch_zb_cell.py; the
    # flags only describe the model and layout; persistent mode, balanced scenario only)
    "torch-zb": ("interleaved", True, []),
}
TORCH_ZB = "torch-zb"
TRACED_REPEAT = -1  # the traced pass (--trace-cells): traced, left out of the statistics


@dataclass(frozen=True)
class CellGrid:
    """The job every cell shares: ranks, pipeline, microbatches per replica and model shape."""

    nproc: int
    pp: int
    vpp: int
    microbatches: int
    num_layers: int
    hidden_size: int
    heads: int  # only for the activation-memory estimate
    seq_length: int
    iters: int
    device: str = "cpu"
    seed: int = 0  # the scenarios' jitter seeds, the plan's shuffles
    simulate_scenarios: bool = True  # False: predictions without the scenarios' injections (smoke runs)
    scenario_flags: dict = field(default_factory=dict)  # scenario -> its injection flags for `train`


def compute_train_argv(
    grid: CellGrid, variant: str, scenario: str, metrics: str, trace_dir: str | None = None
) -> list[str]:
    """`megatronapp train` arguments of a cell, without the launch flags."""
    schedule, virtual, extra = VARIANTS[variant]
    argv = [
        "train",
        "--device",
        grid.device,
        "--model",
        "demo",
        "--pipeline-model-parallel-size",
        str(grid.pp),
        "--num-layers",
        str(grid.num_layers),
        "--hidden-size",
        str(grid.hidden_size),
        "--seq-length",
        str(grid.seq_length),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(grid.microbatches * (grid.nproc // grid.pp)),
        "--train-iters",
        str(grid.iters),
        "--log-interval",
        "1",
        "--pipeline-schedule",
        schedule,
        "--metrics-file",
        metrics,
        *extra,
        *grid.scenario_flags[scenario],
    ]
    if virtual:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(grid.num_layers // (grid.pp * grid.vpp))]
    if trace_dir is not None:  # every iteration, base spans: what the trace-gap analysis reads
        argv += ["--trace", "--trace-dir", trace_dir]
    return argv


def build_plan(scenarios, variants, repeats: int, seed: int, trace_cells: bool) -> list[tuple[int, str, str]]:
    """(repeat, scenario, variant) for every cell; the cells of each repeat shuffled by `seed`,
    so a slow drift of the host hits all variants alike; the traced pass last."""
    rng, cells, plan = random.Random(seed), [(s, v) for s in scenarios for v in variants], []
    for rep in range(repeats):
        rng.shuffle(cells)
        plan += [(rep, s, v) for s, v in cells]
    if trace_cells:
        rng.shuffle(cells)
        plan += [(TRACED_REPEAT, s, v) for s, v in cells]
    return plan


def schedule_peaks(grid: CellGrid, variant: str) -> list[int]:
    """Peak in-flight activation sets per pipeline rank (static: simulated; dynamic: the cap)."""
    from megatronapp.dpp.scheduler import compute_default_caps
    from megatronapp.pipeline.schedules import build_schedule
    from megatronapp.pipeline.zero_bubble import compute_peak_live

    schedule, virtual, _ = VARIANTS[variant]
    v = grid.vpp if virtual else 1
    if schedule == "dynamic":
        return compute_default_caps(grid.pp, v, grid.microbatches)
    built = build_schedule(schedule, grid.pp, v, grid.microbatches)  # a set lives from its F to its B (or W)
    return [compute_peak_live([x for x in built.for_rank(p) if not x.kind.is_comm]) for p in range(grid.pp)]


def static_comm_model(grid: CellGrid, extra: list[str]) -> str:
    """The simulator's model of a static cell's transport (pipeline/transport.py): "eager" where
    receives are posted ahead (--pipeline-recv-ahead), "rendezvous" where the schedule's batches
    are (the default)."""
    return "eager" if "--pipeline-recv-ahead" in extra and grid.device == "cpu" else "rendezvous"


def predicted_step_s(grid: CellGrid, scenario: str, variant: str) -> float:
    """The simulator's step time for a cell, in units of one virtual stage's forward (F = 1,
    B = 2 = I + W; the scenario's link delays stay in seconds, so they weigh as F = 1 s): the
    scenario's jitter and link delays, static schedules under the eager comm model where receives
    are posted ahead (static_comm_model) and the rendezvous one where the schedule's batches are
    posted, dynamic ones at their default caps. Uniform task times: a
    prediction of the schedule's effect, not of a host's absolute times."""
    from megatronapp.dpp.scheduler import compute_default_caps
    from megatronapp.dpp.sim.scenarios import compute_scenario_sim
    from megatronapp.dpp.sim.simulator import CostModel, simulate
    from megatronapp.pipeline.schedules import build_schedule

    schedule, virtual, extra = VARIANTS[variant]
    schedule = "interleaved-zb" if variant == TORCH_ZB else schedule  # torch's: our interleaved-zb's idea
    pp, v, m = grid.pp, (grid.vpp if virtual else 1), grid.microbatches
    sim = compute_scenario_sim(scenario, pp, grid.seed) if grid.simulate_scenarios else {}
    per_task = grid.vpp / v  # a chunk of a non-virtual variant holds vpp chunks' layers
    cost = CostModel.uniform(pp, v, per_task, 2.0 * per_task, **sim)
    if schedule != "dynamic":
        built = build_schedule(schedule, pp, v, m)
        return simulate(pp, v, m, cost, schedule=built, static_comm=static_comm_model(grid, extra)).makespan_s
    traversal = extra[extra.index("--dpp-traversal") + 1]
    return simulate(
        pp,
        v,
        m,
        cost,
        traversal=traversal,
        caps=compute_default_caps(pp, v, m),
        split_backward="--no-split-backward" not in extra,
    ).makespan_s


def memory_fields(grid: CellGrid, variant: str) -> dict:
    """Peak in-flight sets per pipeline rank and what they hold: layer inputs, and the activation
    memory of Korthikanti et al.'s formula for those layers (fp32, micro-batch 1, an estimate)."""
    layers = grid.num_layers // (grid.pp * (grid.vpp if VARIANTS[variant][1] else 1))
    peaks = schedule_peaks(grid, variant)
    s, h = grid.seq_length, grid.hidden_size
    per_layer = 2 * s * h * (34 + 5 * grid.heads * s / h)
    return {
        "peak_inflight_sets": peaks,
        "layers_per_set": layers,
        "layer_input_MiB": [round(p * layers * s * h * 4 / 2**20, 2) for p in peaks],
        "activation_MiB_est": [round(p * layers * per_layer / 2**20, 1) for p in peaks],
    }


def make_record(grid: CellGrid, scenario: str, variant: str, repeat: int, steps: list[float], wall_s: float) -> dict:
    return {
        "scenario": scenario,
        "variant": variant,
        "repeat": repeat,
        "median_s": statistics.median(steps),
        "steps_s": steps,
        "wall_s": round(wall_s, 1),
        **memory_fields(grid, variant),
    }


def measured(records: list[dict]) -> list[dict]:
    """The records that count: measured, and not from the traced pass."""
    return [r for r in records if "median_s" in r and r["repeat"] != TRACED_REPEAT]


def paired_speeds(records: list[dict], scenario: str, variant: str) -> list[float]:
    """Per repeat that measured both: interleaved's time over `variant`'s (cells of one repeat run
    close together, so a slow phase of the host hits both: the ratio cancels it)."""
    by = {(r["variant"], r["repeat"]): r["median_s"] for r in measured(records) if r["scenario"] == scenario}
    return [
        by[("interleaved", rep)] / by[(variant, rep)]
        for (v, rep) in sorted(by)
        if v == variant and ("interleaved", rep) in by
    ]


def paired_summary(records: list[dict], scenario: str, variant: str) -> dict | None:
    """Median paired speed with its 95 % bootstrap interval; None with fewer than two pairs."""
    speeds = paired_speeds(records, scenario, variant)
    if len(speeds) < 2:
        return None
    med, lo, hi = bootstrap_median_ci(speeds)
    return {"median": med, "ci95": [lo, hi], "n": len(speeds), "speeds": speeds}


def compute_summary(grid: CellGrid, scenarios, variants, records: list[dict]) -> dict:
    """ "scenario/variant" -> median over repeats, the runs, speed vs interleaved (ratio of the
    medians; the simulator's; the paired per-repeat median) and memory; unmeasured cells left out."""
    times: dict = {}
    for r in measured(records):
        times.setdefault((r["scenario"], r["variant"]), []).append(r["median_s"])
    out = {}
    for scenario in scenarios:
        base = statistics.median(times[(scenario, "interleaved")]) if (scenario, "interleaved") in times else None
        for variant in variants:
            runs = times.get((scenario, variant))
            if not runs:
                continue
            med = statistics.median(runs)
            predicted = predicted_step_s(grid, scenario, "interleaved") / predicted_step_s(grid, scenario, variant)
            paired = paired_summary(records, scenario, variant) if variant != "interleaved" else None
            out[f"{scenario}/{variant}"] = {
                "median_s": med,
                "runs_s": runs,
                "speed_vs_interleaved": base / med if base else float("nan"),
                "simulated_speed_vs_interleaved": predicted,
                "paired_speed_vs_interleaved": paired,
                **memory_fields(grid, variant),
            }
    return out


def append_record(log, rec: dict) -> None:
    """One JSON line, on disk before the next cell starts."""
    log.write(json.dumps(rec) + "\n")
    log.flush()
    os.fsync(log.fileno())


def run_cells(
    plan: list[tuple[int, str, str]],
    measure: Callable[[int, str, str], dict],
    log,
    *,
    budget_s: float | None,
    clock: Callable[[], float],
    on_record: Callable[[int, dict], None] = lambda done, rec: None,
) -> list[dict]:
    """Measure every (repeat, scenario, variant) of `plan` in order with `measure`, appending each
    record to `log` at once; a cell whose job fails or times out is kept as an error record.
    With `budget_s`, no cell starts that would end after it, judged by the slowest cell so far."""
    records, t0, slowest = [], clock(), 0.0
    for rep, scenario, variant in plan:
        if budget_s is not None and clock() - t0 + slowest > budget_s:
            break
        start = clock()
        try:
            rec = measure(rep, scenario, variant)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            rec = {
                "scenario": scenario,
                "variant": variant,
                "repeat": rep,
                "error": str(exc)[-500:],
                "wall_s": round(clock() - start, 1),
            }
        append_record(log, rec)
        records.append(rec)
        slowest = max(slowest, clock() - start)
        on_record(len(records), rec)
    return records
