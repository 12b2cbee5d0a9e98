"""The simulator's static comm models (eager, gloo rendezvous) and per-link delays; pure."""

from __future__ import annotations

import random

import pytest

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, simulate
from megatronapp.dpp.sim.static_agents import RendezvousHub
from megatronapp.pipeline.schedules import build_schedule


def test_rendezvous_op_completes_when_both_sides_posted_plus_transfer():
    woken = []
    hub = RendezvousHub(lambda src, dst: 0.5 if (src, dst) == (0, 1) else 9.0)
    hub.wake = lambda t, rank: woken.append((t, rank))
    hub.post((0, 1, 0), 1.0)  # the send, posted first: nothing moves yet
    assert hub.complete == {} and woken == []
    hub.post((0, 1, 0), 3.0)  # the receiver posts at 3
    assert hub.complete == {(0, 1, 0): 3.5}
    assert sorted(woken) == [(3.5, 0), (3.5, 1)] and not hub.posted


def _random_case(seed: int):
    rng = random.Random(seed)
    pp, v = rng.randint(2, 4), rng.randint(1, 3)
    m = pp * rng.randint(1, 3)
    cost = CostModel(
        tuple(tuple(rng.uniform(0.5, 2.0) for _ in range(v)) for _ in range(pp)),
        tuple(tuple(rng.uniform(1.0, 4.0) for _ in range(v)) for _ in range(pp)),
        p2p_latency_s=rng.choice([0.0, 0.1, 1.5]),
        jitter=tuple(JitterSpec(r, rng.uniform(1.0, 3.0), seed) for r in range(pp) if rng.random() < 0.5),
        link_delay_s=((0, 1, rng.uniform(0, 3)),) if rng.random() < 0.5 else (),
    )
    names = (["1f1b", "gpipe"] if v == 1 else []) + ["interleaved", "looped-bfs"]
    return pp, v, m, cost, names


@pytest.mark.parametrize("seed", range(40))
def test_rendezvous_only_adds_waits(seed):
    # Same order, same task times (jitter is drawn in run order): the rendezvous model only
    # adds constraints, so it can never finish earlier than the eager one; and every op pairs.
    pp, v, m, cost, names = _random_case(seed)
    for name in names:
        schedule = build_schedule(name, pp, v, m)
        eager = simulate(pp, v, m, cost, schedule=schedule)
        rdv = simulate(pp, v, m, cost, schedule=schedule, static_comm="rendezvous")
        assert rdv.makespan_s >= eager.makespan_s - 1e-9
        assert len(rdv.spans) == 2 * pp * v * m
        assert rdv.peak_activations == eager.peak_activations


@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (3, 2, 6)])
def test_rendezvous_keeps_the_bubble_formulas_when_links_are_free(pp, v, m):
    name = "1f1b" if v == 1 else "interleaved"
    res = simulate(
        pp, v, m, CostModel.uniform(pp, v), schedule=build_schedule(name, pp, v, m), static_comm="rendezvous"
    )
    assert res.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_rendezvous_serializes_lazy_breadth_first():
    # Looped BFS with lazily posted recvs: a sender's batch [SF(c, m), RF(c, m+1)] is waited
    # whole, so each send waits for the receiver to reach its recv: far slower than eager.
    pp, v, m = 4, 2, 8
    cost = CostModel.uniform(pp, v, p2p_latency_s=0.1)
    schedule = build_schedule("looped-bfs", pp, v, m)
    eager = simulate(pp, v, m, cost, schedule=schedule).makespan_s
    assert simulate(pp, v, m, cost, schedule=schedule, static_comm="rendezvous").makespan_s > 1.3 * eager


def test_unknown_static_comm_model_is_refused():
    with pytest.raises(ValueError, match="unknown static comm model 'nccl'"):
        simulate(2, 1, 2, CostModel.uniform(2, 1), schedule=build_schedule("1f1b", 2, 1, 2), static_comm="nccl")


def test_link_delay_applies_to_its_directed_pair_only():
    cost = CostModel.uniform(2, 1, p2p_latency_s=0.25, link_delay_s=((0, 1, 5.0),))
    assert cost.transfer_s(0, 1) == 5.25 and cost.transfer_s(1, 0) == 0.25
    # one microbatch: F0, link 0->1, F1, B1, link 1->0, B0 (forward 1, backward 2)
    for kw in (
        dict(schedule=build_schedule("1f1b", 2, 1, 1)),
        dict(schedule=build_schedule("1f1b", 2, 1, 1), static_comm="rendezvous"),
        dict(traversal="depth-first", caps=compute_default_caps(2, 1, 1)),
    ):
        assert simulate(2, 1, 1, cost, **kw).makespan_s == pytest.approx(1 + 5.25 + 1 + 2 + 0.25 + 2)


@pytest.mark.parametrize("traversal", [None, "in-order"])
def test_a_per_rank_task_overhead_is_that_ranks_alone(traversal):
    """task_overhead_s per pp rank: the same step as that rank's tasks being that much longer."""
    pp, v, m = 2, 2, 4
    per_rank = CostModel.uniform(pp, v, 1.0, 2.0, task_overhead_s=(0.0, 0.7))
    folded = CostModel(((1.0, 1.0), (1.7, 1.7)), ((2.0, 2.0), (2.7, 2.7)))
    kw = (
        {"schedule": build_schedule("interleaved", pp, v, m)}
        if traversal is None
        else {"traversal": traversal, "caps": compute_default_caps(pp, v, m)}
    )
    assert simulate(pp, v, m, per_rank, **kw).makespan_s == pytest.approx(simulate(pp, v, m, folded, **kw).makespan_s)
    assert (
        per_rank.task_overhead_of(1) == 0.7 and CostModel.uniform(pp, v, task_overhead_s=0.2).task_overhead_of(1) == 0.2
    )


def test_trace_overheads_are_per_rank_gaps_with_the_input_ready():
    """Rank 0 waits 3 ms between its two tasks with its input long there (its sends' waits count
    as host gap), rank 1 0.5 ms; the pooled mean would charge each 1.75 ms."""
    from megatronapp.dpp.sim.simulator import Span
    from megatronapp.dpp.sim.trace_costs import TracedRun, estimate_task_overhead_s, estimate_task_overheads_s
    from megatronapp.dpp.tasks import backward_task, forward_task

    spans = [
        Span(0, forward_task(0, 0), 0.000, 0.010),
        Span(0, forward_task(0, 1), 0.013, 0.023),
        Span(1, forward_task(0, 0), 0.011, 0.021),
        Span(1, forward_task(0, 1), 0.0240, 0.030),
        Span(1, backward_task(0, 0), 0.0305, 0.040),
    ]
    run = TracedRun(2, 1, 2, "1f1b", {0: spans})
    assert estimate_task_overheads_s(run, 0.0) == pytest.approx((0.003, 0.0005))
    assert estimate_task_overhead_s(run, 0.0) == pytest.approx((0.003 + 0.0005) / 2)
