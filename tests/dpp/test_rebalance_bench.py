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
