"""dpp/sim/bounds.py: the lower bound is below every simulated schedule (randomised instances, many
orders, the schedule's own peak as the cap), exact where the formula is known, and it refuses
bad input."""

from __future__ import annotations

import random

import pytest

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.policies import _OrderPolicy
from megatronapp.dpp.scheduler import RankScheduler, compute_default_caps
from megatronapp.dpp.sim.bounds import compute_least_work_s, compute_step_bound_s
from megatronapp.dpp.sim.simulator import CostModel, simulate, simulate_agents
from megatronapp.dpp.tasks import compute_rank_tasks
from megatronapp.pipeline.schedules import build_schedule


def _random_cost(rng: random.Random, pp: int, vpp: int) -> CostModel:
    table = lambda lo, hi: tuple(tuple(rng.uniform(lo, hi) for _ in range(vpp)) for _ in range(pp))
    jitter = tuple(JitterSpec(r, rng.uniform(1.0, 2.0), rng.randrange(1000)) for r in range(pp) if rng.random() < 0.4)
    links = tuple((s, (s + 1) % pp, rng.uniform(0, 0.5)) for s in range(pp) if rng.random() < 0.3)
    return CostModel(
        table(0.5, 1.5),
        table(1.0, 3.0),
        p2p_latency_s=rng.uniform(0, 0.3),
        jitter=jitter,
        link_delay_s=links,
        task_overhead_s=rng.choice([0.0, 0.05]),
    )


def _random_order_agents(rng: random.Random, pp: int, vpp: int, m: int, caps: list[int]) -> list:
    """Dynamic ranks whose priority is a random permutation of their tasks (any order the
    scheduler's rules allow), a different one per rank."""
    agents = []
    for p in range(pp):
        order = compute_rank_tasks(vpp, m)
        rng.shuffle(order)
        agents.append(RankScheduler(p, pp, vpp, m, caps[p], _OrderPolicy("random", order)))
    return agents


def _instances(count: int):
    rng = random.Random(7)
    for _ in range(count):
        pp, vpp = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
        m = pp * rng.choice([1, 2, 3])  # interleaved needs M divisible by PP
        yield rng, pp, vpp, m, _random_cost(rng, pp, vpp)


def _check_below(result, cost, pp, vpp, m, label) -> None:
    """Bound with the run's own peak activation sets as the cap: the run held no more."""
    for mode in ("clairvoyant", "none"):
        bound = compute_step_bound_s(cost, pp, vpp, m, list(result.peak_activations), mode=mode)
        assert bound <= result.makespan_s + 1e-9, (label, mode, bound, result.makespan_s)


def test_bound_is_below_every_schedule_on_random_instances():
    for i, (rng, pp, vpp, m, cost) in enumerate(_instances(40)):
        caps = compute_default_caps(pp, vpp, m)
        runs = {}
        static = ["interleaved", "looped-bfs"] if vpp > 1 else ["1f1b", "gpipe"]
        for name in static:
            for comm in ("eager", "rendezvous"):
                runs[f"{name}/{comm}"] = simulate(
                    pp, vpp, m, cost, schedule=build_schedule(name, pp, vpp, m), static_comm=comm
                )
        for traversal in ("depth-first", "breadth-first", "adaptive", "in-order"):
            runs[traversal] = simulate(pp, vpp, m, cost, traversal=traversal, caps=caps)
        for k in range(3):
            cap = [c + rng.randrange(3) for c in caps]
            runs[f"random{k}"] = simulate_agents(_random_order_agents(rng, pp, vpp, m, cap), cost)
        for label, result in runs.items():
            _check_below(result, cost, pp, vpp, m, (i, pp, vpp, m, label))


def test_cap_set_binds_where_the_threshold_sets_do_not():
    """Last rank of PP4 V2 with a 0.5 s link: its first backward is a full round away, and the
    cap stops it from filling that wait with forwards, so the cap bound is higher - and still
    below what the capped schedules reach."""
    pp, vpp, m = 4, 2, 8
    cost = CostModel.uniform(pp, vpp, 1.0, 2.0, p2p_latency_s=0.5)
    caps = compute_default_caps(pp, vpp, m)
    capped, free = compute_step_bound_s(cost, pp, vpp, m, caps), compute_step_bound_s(cost, pp, vpp, m)
    assert capped > free
    for traversal in ("depth-first", "in-order"):
        assert simulate(pp, vpp, m, cost, traversal=traversal, caps=caps).makespan_s >= capped - 1e-9


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (3, 1, 3), (2, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 16)])
def test_bound_is_exact_on_uniform_costs_without_latency(pp, vpp, m):
    """F = 1, B = 2, no latency: 1F1B and interleaved 1F1B take (V*M + P - 1)(F + B), the known
    bubble formula; the bound (the last rank's head + work + tail) is that number and the
    schedule reaches it, so the bound is tight."""
    cost = CostModel.uniform(pp, vpp, 1.0, 2.0)
    formula = (vpp * m + pp - 1) * 3.0
    schedule = build_schedule("interleaved" if vpp > 1 else "1f1b", pp, vpp, m)
    assert simulate(pp, vpp, m, cost, schedule=schedule).makespan_s == pytest.approx(formula)
    assert compute_step_bound_s(cost, pp, vpp, m, compute_default_caps(pp, vpp, m)) == pytest.approx(formula)


def test_constant_slowdown_bound_is_reached_by_1f1b_at_its_cap():
    """pp 1 of 3 at 1.5x (constant, as --inject-slowdown). Without a cap: F before it + its work
    6 x (1.5 + 3) + B after it = 30. At 1F1B's cap of 2 sets on that rank its first backward
    can start at 1 + 1.5 + 1 + 2 = 5.5, and all 6 backwards plus the 4 forwards past the cap
    run after it: 5.5 + 18 + 4 x 1.5 + 2 = 31.5, which 1F1B and in-order reach: at the same
    cap no order beats them."""
    pp, m = 3, 6
    cost = CostModel(((1.0,), (1.5,), (1.0,)), ((2.0,), (3.0,), (2.0,)))
    caps = compute_default_caps(pp, 1, m)
    assert caps[1] == 2
    assert compute_step_bound_s(cost, pp, 1, m) == pytest.approx(30.0)
    assert compute_step_bound_s(cost, pp, 1, m, caps) == pytest.approx(31.5)
    assert simulate(pp, 1, m, cost, schedule=build_schedule("1f1b", pp, 1, m)).makespan_s == pytest.approx(31.5)
    assert simulate(pp, 1, m, cost, traversal="in-order", caps=caps).makespan_s == pytest.approx(31.5)


def test_least_work_pairs_largest_costs_with_smallest_draws():
    draws = [1.5, 1.0, 1.2, 1.1]
    assert compute_least_work_s([2.0, 1.0], draws, 1.25, "clairvoyant") == pytest.approx(2.0 * 1.0 + 1.0 * 1.1)
    assert compute_least_work_s([2.0, 1.0], draws, 1.25, "expected", overhead_s=0.1) == pytest.approx(3.75 + 0.2)
    assert compute_least_work_s([2.0, 1.0], draws, 1.25, "none") == pytest.approx(3.0)


def test_expected_bound_is_the_mean_work_bound():
    """pp 1 of 3 jittered up to 2x, V 1, M 3: head 1 + 1.5 x its work 9 + tail 2 = 16.5, above
    the last rank's 2 + 9 + 4 = 15; per seed the clairvoyant bound lies between 15 and 1 + 2 x 9 + 2."""
    cost = CostModel.uniform(3, 1, 1.0, 2.0, jitter=(JitterSpec(1, 2.0, 3),))
    assert compute_step_bound_s(cost, 3, 1, 3, mode="expected") == pytest.approx(16.5)
    assert compute_step_bound_s(cost, 3, 1, 3, mode="none") == pytest.approx(15.0)
    assert 15.0 <= compute_step_bound_s(cost, 3, 1, 3) < 21.0


def test_bad_input_is_refused_in_one_line():
    cost = CostModel.uniform(2, 1)
    with pytest.raises(ValueError, match="caps has 1 entries for 2"):
        compute_step_bound_s(cost, 2, 1, 2, caps=[2])
    with pytest.raises(ValueError, match="unknown factor mode"):
        compute_step_bound_s(cost, 2, 1, 2, mode="psychic")
