"""benchmarks/dpp_bound.py and dpp_order_search.py: the bound is below every policy and every
searched order on every seed, the search never loses to its start, the constant-slowdown
scenario scales one rank, and the CLI refuses configurations it cannot run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dpp_bound  # noqa: E402
import dpp_order_search  # noqa: E402

from megatronapp.dpp.policies import compute_depth_first_order  # noqa: E402
from megatronapp.dpp.sim.simulator import CostModel, simulate  # noqa: E402
from megatronapp.pipeline.schedules import build_schedule  # noqa: E402

BASE = CostModel.uniform(4, 2, 1.0, 2.0, p2p_latency_s=0.1)


@pytest.mark.parametrize("scen", ["jitter2", "slow1"])
def test_bound_is_below_every_variant_and_the_search_on_every_seed(scen):
    cell = dpp_bound.run_cell(BASE, 8, scen, 3, ["depth-first", "in-order"], search=(40, 2))
    runs = cell["runs"]
    for seed, bound in enumerate(runs["bound"]):
        assert runs["bound-nocap"][seed] <= bound + 1e-12
        for name in ("interleaved/rendezvous", "interleaved/eager", "dynamic-depth-first", "dynamic-in-order"):
            assert bound <= runs[name][seed] + 1e-9, (name, seed)
    for seed, found in enumerate(cell["search_s"]):
        assert runs["bound"][seed] - 1e-9 <= found <= runs["interleaved/eager"][seed] + 1e-9
    rows = dpp_bound.summarize(cell, "interleaved/rendezvous")
    assert rows["interleaved/rendezvous"]["median"] == 1.0
    assert rows["bound"]["lo"] >= rows["interleaved/eager"]["lo"] - 1e-12
    assert 0.0 <= rows["bound"]["share_ge_target"] <= 1.0


def test_search_starts_from_interleaved_order_with_eager_comm():
    schedule = build_schedule("interleaved", 4, 2, 8)
    orders = [compute_depth_first_order(p, 4, 2, 8) for p in range(4)]
    assert dpp_order_search.simulate_orders(orders, BASE, 2) == pytest.approx(
        simulate(4, 2, 8, BASE, schedule=schedule, static_comm="eager").makespan_s)
    deadlocking = [list(reversed(o)) for o in orders]  # every backward before its forward
    assert dpp_order_search.simulate_orders(deadlocking, BASE, 2) is None


def test_slow1_scales_only_the_slow_stage():
    cost = dpp_bound.scenario_cost(BASE, "slow1", 4, 0)
    assert cost.forward_s[2] == (1.5, 1.5) and cost.backward_s[2] == (3.0, 3.0)
    assert cost.forward_s[1] == (1.0, 1.0) and not cost.jitter


def test_cli_writes_json_and_refuses_bad_configs(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert dpp_bound.main(["--configs", "4x2x8", "--seeds", "2", "--scenarios", "jitter1",
                           "--traversals", "in-order", "--search-moves", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["results"]["PP4V2M8"]
    assert set(data) == {"jitter1"} and len(data["jitter1"]["runs"]["bound"]) == 2
    printed = capsys.readouterr().out
    assert "speed vs interleaved/rendezvous" in printed and "jitter1   295.4 ms" in printed  # measured-run line
    for bad in (["--configs", "4x2x6"], ["--configs", "2x2x4"], ["--configs", "4-2-8"], ["--search-moves", "-1"]):
        with pytest.raises(SystemExit):
            dpp_bound.main(bad)
        assert capsys.readouterr().err.strip()
