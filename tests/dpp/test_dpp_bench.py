"""The MegaDPP benchmark's bookkeeping (megatronapp/dpp/sim/bench_cells.py): every cell on disk
as soon as it is measured, the time budget, failures recorded, paired speeds; the trace-gap
analysis of traced cells (dpp/sim/trace_gap.py); and benchmarks/dpp_bench.py run as a program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatronapp.dpp.sim import bench_cells as B
from megatronapp.dpp.sim import trace_gap

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "dpp_bench.py"
SCENARIOS = ("balanced", "jitter1", "jitter2", "link")
VARIANTS = ("interleaved", "breadth-first", "dynamic-df", "dynamic-inorder", "dynamic-w")
GRID = B.CellGrid(
    nproc=8,
    pp=4,
    vpp=2,
    microbatches=8,
    num_layers=8,
    hidden_size=256,
    heads=4,
    seq_length=128,
    iters=10,
    scenario_flags={s: [] for s in SCENARIOS},
)


class FakeClock:
    """Advances `step` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_each_cell_is_written_when_measured_and_failures_are_kept(tmp_path):
    log_path, seen_on_disk = tmp_path / "dpp_bench.jsonl", []

    def measure(rep, scenario, variant):
        seen_on_disk.append(len(log_path.read_text().splitlines()))
        if (scenario, variant) == ("link", "breadth-first"):
            raise subprocess.TimeoutExpired("train", 1)
        steps = [0.5, 0.4, 0.6] if variant == "interleaved" else [0.25]
        return B.make_record(GRID, scenario, variant, rep, steps, 1.0)

    plan = B.build_plan(SCENARIOS, VARIANTS, repeats=2, seed=0, trace_cells=False)
    with open(log_path, "a") as log:
        records = B.run_cells(plan, measure, log, budget_s=None, clock=FakeClock(1.0))
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    # 2 repeats x 4 scenarios x 5 variants; cell k saw k cells on disk
    assert lines == records and len(lines) == 2 * 4 * 5 and seen_on_disk == list(range(40))
    failed = [r for r in lines if "error" in r]
    assert {(r["scenario"], r["variant"]) for r in failed} == {("link", "breadth-first")} and len(failed) == 2
    summary = B.compute_summary(GRID, SCENARIOS, VARIANTS, records)
    assert summary["jitter1/dynamic-df"]["speed_vs_interleaved"] == 2.0  # 0.5 s median vs 0.25 s
    assert summary["balanced/interleaved"]["peak_inflight_sets"] == [11, 9, 7, 5]
    assert "link/breadth-first" not in summary


def test_budget_stops_starting_cells(tmp_path):
    plan = B.build_plan(SCENARIOS, VARIANTS, repeats=2, seed=0, trace_cells=False)
    clock = FakeClock(100.0)  # every read advances 100 s: a cell takes 100 s
    with open(tmp_path / "log.jsonl", "a") as log:
        records = B.run_cells(plan, lambda rep, s, v: {"repeat": rep}, log, budget_s=1000, clock=clock)
        assert 0 < len(records) < len(plan)
        unbounded = B.run_cells(plan, lambda rep, s, v: {"repeat": rep}, log, budget_s=None, clock=clock)
        assert len(unbounded) == len(plan)


def test_plan_shuffles_each_repeat_and_puts_the_traced_pass_last():
    plan = B.build_plan(SCENARIOS[:2], VARIANTS[:3], repeats=2, seed=3, trace_cells=True)
    cells = sorted((s, v) for s in SCENARIOS[:2] for v in VARIANTS[:3])
    for rep in (0, 1, B.TRACED_REPEAT):
        assert sorted((s, v) for r, s, v in plan if r == rep) == cells
    assert [r for r, _, _ in plan[-6:]] == [B.TRACED_REPEAT] * 6
    assert plan == B.build_plan(SCENARIOS[:2], VARIANTS[:3], repeats=2, seed=3, trace_cells=True)


def test_paired_speeds_divide_within_a_repeat_and_skip_unpaired_repeats():
    rec = lambda v, rep, t: {"scenario": "jitter1", "variant": v, "repeat": rep, "median_s": t}
    records = [
        rec("interleaved", 0, 0.6),
        rec("dynamic-inorder", 0, 0.5),  # 1.2
        rec("interleaved", 1, 0.9),
        rec("dynamic-inorder", 1, 1.0),  # 0.9: a slow repeat for both
        rec("dynamic-inorder", 2, 0.1),  # its interleaved cell failed: no pair
        {"scenario": "link", "variant": "interleaved", "repeat": 2, "median_s": 0.05},
    ]
    assert B.paired_speeds(records, "jitter1", "dynamic-inorder") == [1.2, 0.9]
    summary = B.paired_summary(records, "jitter1", "dynamic-inorder")
    assert summary["n"] == 2 and summary["median"] == 1.05


def test_a_cells_train_flags_carry_its_device_schedule_and_injection():
    grid = B.CellGrid(
        nproc=2,
        pp=2,
        vpp=2,
        microbatches=4,
        num_layers=4,
        hidden_size=64,
        heads=4,
        seq_length=32,
        iters=5,
        device="cuda",
        scenario_flags={"jitter1": ["--inject-jitter", "1:1.5"]},
    )
    argv = B.compute_train_argv(grid, "dynamic-inorder", "jitter1", "m.jsonl", trace_dir="t")
    assert argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--pipeline-schedule") + 1] == "dynamic"
    assert argv[argv.index("--inject-jitter") + 1] == "1:1.5"
    assert argv[argv.index("--num-layers-per-virtual-pipeline-stage") + 1] == "1"
    assert argv[argv.index("--global-batch-size") + 1] == "4" and argv[-3:] == ["--trace", "--trace-dir", "t"]
    assert "--trace" not in B.compute_train_argv(grid, "1f1b", "jitter1", "m.jsonl")


def _run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_gpu_cells_need_a_gpu_per_rank():
    """On this CPU machine no GPU is visible: 8 ranks by default are refused before any job."""
    res = _run_script(["--device", "cuda"], timeout=120)
    assert res.returncode == 2 and "--device cuda needs one GPU per rank: 8 ranks, 0 GPUs visible" in res.stderr


def test_persistent_ranks_run_every_cell_one_after_the_other(tmp_path):
    """The default mode: one launched set of ranks runs all cells (static and dynamic schedules,
    with and without jitter) with fresh groups per cell; every cell's record reaches the JSONL.
    --trace-cells adds a traced pass that the statistics leave out and the trace-gap analysis reads."""
    res = _run_script(
        [
            "--smoke",
            "--out",
            str(tmp_path),
            "--variants",
            "interleaved",
            "dynamic-df",
            "--timeout",
            "240",
            "--trace-cells",
        ],
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "dpp_bench.jsonl").read_text().splitlines()]
    cells = [
        ("balanced", "dynamic-df"),
        ("balanced", "interleaved"),
        ("jitter1", "dynamic-df"),
        ("jitter1", "interleaved"),
    ]
    measured = [r for r in lines if r["repeat"] == 0]
    assert sorted((r["scenario"], r["variant"]) for r in measured) == cells
    assert sorted((r["scenario"], r["variant"]) for r in lines if r["repeat"] == B.TRACED_REPEAT) == cells
    for r in lines:
        assert "error" not in r and len(r["steps_s"]) == 3 and all(t > 0 for t in r["steps_s"])
    # a cell leaves no thread or connection behind (the first may start lazily made ones)
    state = [(r["process"]["threads"], r["process"]["fds"]) for r in measured]
    assert state[1] == state[2] == state[3], state
    summary = json.loads((tmp_path / "dpp_bench.json").read_text())["results"]
    assert all(len(summary[f"{s}/{v}"]["runs_s"]) == 1 for s, v in cells)  # the traced pass is not counted

    result = trace_gap.analyse(trace_gap.load_cells(tmp_path, warmup=2), seeds=2)
    assert set(result) == {"balanced", "jitter1"}
    for scenario, rows in result.items():
        assert set(rows) == {"interleaved", "dynamic-df"}
        for row in rows.values():
            assert row["iterations"] == 3 and row["measured_ms"] > 0 and row["predicted_ms"] > 0
            assert all(0 < b <= 1 for b in row["busy"])
        assert rows["dynamic-df"]["measured_speed"] > 0 and rows["dynamic-df"]["predicted_speed"] > 0
    # the jitter the cell ran with reaches the simulator, on the traced pipeline's pp ranks
    traced = trace_gap.load_cells(tmp_path, warmup=2)[("jitter1", "interleaved")]
    assert [(j.rank, j.max_factor) for j in trace_gap.injections(traced, 0)["jitter"]] == [(1, 1.5)]


def test_trace_gap_takes_the_jitter_out_of_a_jittered_ranks_task_times():
    """The simulator draws a cell's jitter again, so the jittered rank's traced mean is divided
    by the mean factor (1 + 1.5) / 2 first; other ranks' times are kept as traced."""
    from megatronapp.dpp.sim.simulator import Span
    from megatronapp.dpp.sim.trace_costs import TracedRun
    from megatronapp.dpp.tasks import backward_task, forward_task

    spans = [
        Span(0, forward_task(0, 0), 0.0, 0.010),
        Span(1, forward_task(0, 0), 0.011, 0.036),
        Span(1, backward_task(0, 0), 0.036, 0.086),
        Span(0, backward_task(0, 0), 0.087, 0.107),
    ]
    run = TracedRun(2, 1, 1, "1f1b", {0: spans}, {"inject_jitter": ["1:1.5:3"]}, 1)
    cost = trace_gap.dejittered_costs(run)
    assert [round(x[0], 6) for x in cost.forward_s] == [0.010, 0.020]
    assert [round(x[0], 6) for x in cost.backward_s] == [0.020, 0.040]
    (jitter,) = trace_gap.injections(run, 2)["jitter"]
    assert (jitter.rank, jitter.max_factor, jitter.seed) == (1, 1.5, 2 * 1 + 3)  # another draw per seed
