"""The benchmark's fault scenarios: one definition (megatronapp/dpp/sim/scenarios.py) gives the real
run's flags and the simulator's perturbations, and they name the same pipeline stages."""

from __future__ import annotations

import pytest

from megatronapp.dpp.config import parse_jitter
from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_flags, compute_scenario_sim
from megatronapp.injection.inject import parse_fault_plan
from megatronapp.parallel.layout import ParallelLayout


def test_pp4_dp2_flags_target_stages_1_and_2_of_the_first_replica():
    assert compute_scenario_flags("jitter1", 4, 2) == ["--inject-jitter", "4:1.5"]
    assert compute_scenario_flags("jitter2", 4, 2) == ["--inject-jitter", "2:1.5:1", "--inject-jitter", "4:1.5:2"]
    assert compute_scenario_flags("link", 4, 2) == ["--inject-link-delay", "2:4:5"]
    assert compute_scenario_flags("balanced", 4, 2) == []


def _split(flags):
    jitter = [flags[i + 1] for i, f in enumerate(flags) if f == "--inject-jitter"]
    links = [flags[i + 1] for i, f in enumerate(flags) if f == "--inject-link-delay"]
    return jitter, links


@pytest.mark.parametrize("pp,dp", [(4, 2), (8, 1), (3, 2)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flags_and_simulation_perturb_the_same_stages(name, pp, dp):
    """Parse the flags as `megatronapp train` does, map global ranks to pipeline stages with the
    engine's layout, and compare with what the simulator injects for seed 0."""
    layout = ParallelLayout(world_size=pp * dp, pp_size=pp)
    jitter, links = _split(compute_scenario_flags(name, pp, dp))
    sim = compute_scenario_sim(name, pp, seed=0)
    real = sorted((layout.coords(j.rank).pp, j.max_factor, j.seed) for j in map(parse_jitter, jitter))
    assert real == sorted((j.rank, j.max_factor, j.seed) for j in sim["jitter"])
    plan = parse_fault_plan([], links)
    real_links = sorted(
        (layout.coords(s).pp, layout.coords(d).pp, delay.ms / 1e3) for (s, d), delay in plan.link_delays.items()
    )
    assert real_links == sorted(sim["link_delay_s"])
    for s, d, _ in real_links:  # a delayed link must carry pipeline messages: adjacent stages, replica 0
        assert abs(s - d) == 1
    assert all(layout.coords(j.rank).dp == 0 for j in map(parse_jitter, jitter))


def test_simulation_seeds_keep_two_jittered_ranks_independent():
    seeds = [tuple(j.seed for j in compute_scenario_sim("jitter2", 4, s)["jitter"]) for s in range(5)]
    flat = [x for pair in seeds for x in pair]
    assert len(set(flat)) == len(flat) and seeds[0] == (1, 2)


def test_unknown_scenario_and_short_pipeline_are_refused():
    with pytest.raises(ValueError, match="unknown scenario"):
        compute_scenario_flags("jitter9", 4, 2)
    with pytest.raises(ValueError, match="needs pp >= 3"):
        compute_scenario_sim("link", 2, 0)
