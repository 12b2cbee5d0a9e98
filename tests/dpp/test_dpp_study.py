"""megatronapp/dpp/sim/study.py: its bounds bound every simulated schedule, its summary rows, the link
and activation-memory costs of a simulated step; benchmarks/dpp_sim_study.py refuses a bad config."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.sim import study
from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_sim
from megatronapp.dpp.sim.simulator import CostModel, Span, simulate
from megatronapp.dpp.tasks import backward_task, forward_task
from megatronapp.pipeline.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[2]


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


def test_sweep_covers_the_goal_and_the_script_refuses_a_bad_config():
    assert {(pp, m) for pp, _, m in study.SWEEP} == {(4, 8), (4, 12), (4, 16), (8, 8), (8, 16)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dpp_sim_study.py"), "--pp", "4", "-m", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "divisible" in proc.stderr


def test_message_is_one_microbatch_residual_stream():
    assert study.compute_message_bytes(1, 2048, 2048, "bf16") == 8 * 2**20
    assert study.compute_message_bytes(2, 128, 256, "fp32") == 2 * 128 * 256 * 4


def test_link_cost_adds_latency_and_bytes_over_bandwidth_and_keeps_task_times():
    traced = CostModel(((1e-3, 2e-3),) * 4, ((3e-3, 4e-3),) * 4)
    cost = study.compute_link_cost(traced, 8 * 2**20, bandwidth_GBps=350.0, latency_us=10.0)
    assert cost.transfer_s(1, 2) == pytest.approx(10e-6 + 8 * 2**20 / 350e9)
    assert cost.forward_s == traced.forward_s and cost.backward_s == traced.backward_s
    with pytest.raises(ValueError, match="bandwidth > 0"):
        study.compute_link_cost(traced, 1, bandwidth_GBps=0.0, latency_us=1.0)


@pytest.mark.parametrize("how", ["interleaved", "looped-bfs", "dynamic"])
def test_peak_bytes_with_unit_sets_equal_the_in_flight_counters_peak(how):
    """Two independent accounts of held activations: the span replay (bytes) and the
    schedulers' own counters (sets), under jitter; with 1 byte per set they must agree."""
    pp, v, m = 4, 2, 8
    cost = CostModel.uniform(pp, v, p2p_latency_s=0.3, jitter=(JitterSpec(2, 1.5, 7),))
    kw = (
        dict(traversal="depth-first", caps=compute_default_caps(pp, v, m))
        if how == "dynamic"
        else dict(schedule=build_schedule(how, pp, v, m))
    )
    res = simulate(pp, v, m, cost, **kw)
    assert study.compute_peak_activation_bytes(res.spans, [[1] * v] * pp, pp) == res.peak_activations


def test_peak_bytes_weigh_sets_by_their_chunk():
    spans = [
        Span(0, forward_task(0, 0), 0.0, 1.0),
        Span(0, forward_task(1, 0), 1.0, 2.0),
        Span(0, backward_task(1, 0), 2.0, 3.0),
        Span(0, forward_task(0, 1), 3.0, 4.0),
        Span(0, backward_task(0, 0), 4.0, 5.0),
        Span(0, backward_task(0, 1), 5.0, 6.0),
    ]
    assert study.compute_peak_activation_bytes(spans, [[10, 100]], 1) == [110]
