"""benchmarks/dpp_sim_study.py: its bounds bound every simulated schedule, and its summary rows."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dpp_sim_study as study  # noqa: E402

from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_sim  # noqa: E402
from megatronapp.dpp.sim.simulator import CostModel, simulate  # noqa: E402


@pytest.mark.parametrize("pp,m", [(3, 6), (4, 8)])
@pytest.mark.parametrize("scen", list(SCENARIOS))
def test_clairvoyant_bound_is_below_every_schedule_on_every_seed(pp, m, scen):
    base = CostModel.uniform(pp, 2, 1.0, 2.0, p2p_latency_s=0.05)
    for seed in range(4):
        cost = replace(base, **compute_scenario_sim(scen, pp, seed))
        bound, online = study.lower_bounds_s(cost, pp, 2, m)
        for name, kw in study.variants(pp, 2, m, ["depth-first", "in-order"], cap_extra=(3,)).items():
            assert simulate(pp, 2, m, cost, **kw).makespan_s >= bound - 1e-9, (name, seed)
        if scen in ("balanced", "link"):  # no jitter: both bounds are the same number
            assert online == pytest.approx(bound)


def test_online_bound_is_the_mean_work_bound():
    """pp 2 of 3 jittered up to 1.5x: online = 2 forwards before it + 1.25 x its work + 2 backwards after."""
    cost = CostModel.uniform(3, 1, 1.0, 2.0, **compute_scenario_sim("jitter1", 3, 0))
    _, online = study.lower_bounds_s(cost, 3, 1, 3)
    assert online == pytest.approx(2 * 1.0 + 1.25 * 3 * 3.0 + 2 * 2.0)


def test_rows_compare_with_the_static_runtime_and_bracket_the_mean_ratio():
    base = CostModel.uniform(4, 2, 1.0, 2.0, p2p_latency_s=0.05)
    res = study.study_config(base, 8, ["jitter2"], 3, ["in-order"])["jitter2"]
    rows = res["rows"]
    assert rows[study.REFERENCE]["speed"] == 1.0
    for name, r in rows.items():
        assert r["speed_min"] - 1e-12 <= r["speed"] <= r["speed_max"] + 1e-12, name
        assert len(res["runs"][name]) == 3


def test_sweep_covers_the_issue_and_says_what_it_skips(capsys):
    assert {(pp, m) for pp, _, m in study.SWEEP} == {(4, 8), (4, 12), (4, 16), (8, 8), (8, 16)}
    with pytest.raises(SystemExit):
        study.main(["--pp", "4", "-m", "6"])
    assert "divisible" in capsys.readouterr().err
