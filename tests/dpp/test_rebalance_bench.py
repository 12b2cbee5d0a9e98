"""The rebalancing benchmark's bookkeeping (benchmarks/rebalance_bench.py): which steps a cell's
figures come from, the pairing of a rebalanced cell with its schedule alone, the faults of each
scenario."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rebalance_bench as R


def test_a_cells_median_leaves_out_the_warm_up_and_the_steps_before_its_last_move_settled():
    steps = [9.0, 9.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0]
    assert R.cell_figures(steps, [], skip=2)["median_s"] == 2.0  # steps 2..7: 2 2 2 2 1 1
    moved = R.cell_figures(steps, [4], skip=2)  # moved at iteration 4: steps from index 6 on
    assert moved["median_s"] == 1.0 and moved["first_move"] == 4
    assert moved["tail_median_s"] == 1.0  # the last quarter: steps 6 and 7


def test_the_iteration_a_late_fault_began_to_cost_is_found_in_the_steps_and_noise_is_not():
    late = [6.0, 1.0, 1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 2.0, 1.9, 2.1, 2.0, 2.0, 2.0]
    assert R.first_slowed_iteration(late, skip=1) == 9  # the ninth step is the first slow one
    noisy = [6.0, 1.0, 1.2, 0.9, 1.1, 1.3, 0.8, 1.0, 1.2, 0.9, 1.1, 1.0]
    assert R.first_slowed_iteration(noisy, skip=1) is None
    assert R.cell_figures(late, [11], skip=1)["slowed_at"] == 9


def test_a_rebalanced_cell_is_paired_with_its_schedule_alone_round_by_round():
    cells = {
        "quota/1f1b": [{"median_s": 2.0, "tail_median_s": 2.0}, {"median_s": 3.0, "tail_median_s": 3.0}],
        "quota/1f1b+rebalance": [{"median_s": 1.0, "tail_median_s": 1.0}, {"error": "exit 1"}],
    }
    row = R.paired_summary(cells)["quota/1f1b+rebalance"]
    assert row["n"] == 1 and row["speedup"] == 2.0 and row["speedup_range"] == [2.0, 2.0]
    assert "speedup" not in R.paired_summary(cells)["quota/1f1b"]


@pytest.mark.parametrize(
    ("scenario", "method", "start_ms", "on_ms"),
    [
        ("quota", "quota", None, None),
        ("compete", "compete", None, None),
        ("starts", "quota", 5000, None),
        ("stops", "quota", 0, 5000),
    ],
)
def test_each_scenario_slows_the_chosen_rank_when_it_says(scenario, method, start_ms, on_ms):
    a = SimpleNamespace(slow_rank=2, factor=2.0, fault_at_s=5.0)
    (fault,) = R.faults(a, scenario)
    assert (fault.rank, fault.method, fault.factor) == (2, method, 2.0)
    if start_ms is None:
        assert fault.schedule is None
    else:
        assert fault.schedule.start_ms == start_ms and (on_ms is None or fault.schedule.on_ms == on_ms)
    assert R.faults(a, "balanced") == ()


def test_the_link_scenario_limits_the_chosen_link_with_a_namespace_per_rank():
    a = R.build_parser().parse_args(
        ["--pp", "2", "--dp", "2", "--scenarios", "link", "--slow-link", "1:3", "--link-mbit", "25"]
    )
    assert R.faults(a, "link") == (R.SlowLink(1, 3, 25.0),)
    plan = R._plan(a, "link", "1f1b", True, Path("m.jsonl"))
    assert plan.nodes == 4 and plan.faults == (R.SlowLink(1, 3, 25.0),)
    assert R._plan(a, "quota", "1f1b", True, Path("m.jsonl")).nodes == 0


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", False), ("interleaved-zb", True), ("torch-zb", True)])
def test_a_schedule_of_virtual_stages_gets_their_layer_count(schedule, virtual):
    a = R.build_parser().parse_args(["--pp", "2", "--vpp", "2", "--num-layers", "8"])
    flags = R.train_flags(a, schedule, None)
    assert ("--num-layers-per-virtual-pipeline-stage" in flags) == virtual
    assert not virtual or flags[flags.index("--num-layers-per-virtual-pipeline-stage") + 1] == "2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slow-link", "0-1"], "expected SRC:DST"),
        (["--slow-link", "0:4"], "names rank 4"),
        (["--link-mbit", "0"], "--link-mbit must be > 0"),
    ],
)
def test_a_bad_link_is_refused_in_one_line_before_any_cell_runs(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        R.main(["--pp", "2", "--scenarios", "link", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and not (tmp_path / "rebalance.json").exists()


def test_cells_of_different_invocations_or_rounds_not_run_are_not_paired():
    cells = {
        "quota/1f1b": [{"median_s": 2.0, "tail_median_s": 2.0, "call": "a"}, {"median_s": 3.0, "tail_median_s": 3.0, "call": "a"}, None],
        "quota/1f1b+rebalance": [{"median_s": 1.0, "tail_median_s": 1.0, "call": "a"}, {"median_s": 1.0, "tail_median_s": 1.0, "call": "b"}, None],
    }  # fmt: skip
    row = R.paired_summary(cells)["quota/1f1b+rebalance"]
    assert row["n"] == 2 and row["n_pairs"] == 1 and row["speedup"] == 2.0


def _args(**over):
    base = dict(pp=4, dp=1, seed=0, repeats=2, resume=True, out="o", timeout=60.0, scenarios=["quota"])
    return SimpleNamespace(**(base | over))


def test_a_resumed_file_keeps_its_rounds_and_refuses_other_measurement_flags():
    earlier = {
        "args": vars(_args(repeats=1, resume=False, timeout=120.0)),
        "cells": {"quota/1f1b": [{"median_s": 1.0}]},
    }
    assert R.resumed_cells(_args(repeats=3), earlier) == {"quota/1f1b": [{"median_s": 1.0}, None, None]}
    with pytest.raises(ValueError, match="--pp 2 differs from the file's 4"):
        R.resumed_cells(_args(pp=2), earlier)


def test_a_file_older_than_a_flag_resumes_when_the_flag_is_at_its_default():
    earlier = {"args": vars(_args(repeats=1)), "cells": {"quota/1f1b": [{"median_s": 1.0}]}}
    assert R.resumed_cells(_args(link_mbit=40.0), earlier) == {"quota/1f1b": [{"median_s": 1.0}, None]}
    with pytest.raises(ValueError, match="--link-mbit 10.0 differs from the file's 40.0"):
        R.resumed_cells(_args(link_mbit=10.0), earlier)


def test_a_rounds_order_depends_on_the_seed_and_round_only():
    cells = list(range(8))
    assert R.round_order(cells, 1, 3) == R.round_order(cells, 1, 3)
    assert sorted(R.round_order(cells, 1, 3)) == cells
    assert len({tuple(R.round_order(cells, 1, r)) for r in range(6)}) > 1


def test_the_overhead_benchmark_makes_no_plan_on_balanced_measurements():
    import rebalance_overhead as O

    for pp, dp, tp, layers in O.SHAPES[:2]:
        us, plans = O.time_observe(pp, dp, tp, layers, steps=100, seed=1)
        assert plans == 0 and us > 0
