"""MegaDPP's pure parts: cap rule, deadlock freedom over random layouts/costs/policies,
bubble formulas reproduced by the simulator, static breadth-first schedule (looped-bfs)."""

from __future__ import annotations

import random

import pytest

from megatronapp.dpp.config import DppConfigError, JitterSpec, parse_jitter
from megatronapp.dpp.policies import TRAVERSALS, build_policy, compute_depth_first_order
from megatronapp.dpp.scheduler import CapError, RankScheduler, compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, simulate, simulate_agents
from megatronapp.dpp.tasks import compute_consumer, compute_producer_rank, compute_rank_tasks
from megatronapp.pipeline.schedules import build_schedule
from megatronapp.pipeline.validate import validate_schedule


class RandomPolicy:
    """Adversarial: any ready task, at random (deadlock freedom must not depend on the policy)."""

    name = "random"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choose(self, ready, view):
        return self.rng.choice(sorted(ready, key=str)), self.name


def _random_case(seed: int):
    rng = random.Random(seed)
    pp, v = rng.randint(2, 4), rng.randint(1, 3)
    m = rng.randint(pp, 4 * pp)
    cost = CostModel(
        tuple(tuple(rng.uniform(0.5, 2.0) for _ in range(v)) for _ in range(pp)),
        tuple(tuple(rng.uniform(1.0, 4.0) for _ in range(v)) for _ in range(pp)),
        p2p_latency_s=rng.choice([0.0, 0.1, 1.5]),
        jitter=tuple(JitterSpec(r, rng.uniform(1.0, 3.0), seed) for r in range(pp) if rng.random() < 0.5),
    )
    cap = rng.randint(v, max(v, max(compute_default_caps(pp, v, m))))
    return pp, v, m, cost, cap


@pytest.mark.parametrize("seed", range(60))
def test_dynamic_never_deadlocks_nor_exceeds_cap(seed):
    pp, v, m, cost, cap = _random_case(seed)
    for traversal in TRAVERSALS:
        caps = compute_default_caps(pp, v, m) if traversal == "in-order" else [cap] * pp  # in-order: its own peak
        res = simulate(pp, v, m, cost, traversal=traversal, caps=caps)
        assert all(peak <= c for peak, c in zip(res.peak_activations, caps))
        assert len(res.spans) == 2 * pp * v * m
    # an adversarial policy, driven through the same scheduler
    agents = [RankScheduler(p, pp, v, m, cap, RandomPolicy(seed * 10 + p)) for p in range(pp)]
    res = simulate_agents(agents, cost)
    assert all(a.done for a in agents) and max(res.peak_activations) <= cap


def test_spans_respect_dependencies_and_transfer_time():
    pp, v, m = 3, 2, 6
    cost = CostModel.uniform(pp, v, p2p_latency_s=0.25, jitter=(JitterSpec(1, 2.0, 3),))
    res = simulate(pp, v, m, cost, traversal="adaptive", caps=compute_default_caps(pp, v, m))
    end = {(s.pp_rank, s.task): s.end_s for s in res.spans}
    per_rank = {}
    for s in res.spans:
        per_rank.setdefault(s.pp_rank, []).append((s.start_s, s.end_s))
        producer = compute_producer_rank(s.task, s.pp_rank, pp, v)
        if producer is None:
            continue
        feeding = [(r, t) for (r, t) in end if compute_consumer(t, r, pp, v) == (s.pp_rank, s.task)]
        assert len(feeding) == 1
        delay = 0.0 if feeding[0][0] == s.pp_rank else 0.25
        assert s.start_s >= end[feeding[0]] + delay - 1e-9
    for spans in per_rank.values():  # one task at a time per rank
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_cap_below_chunks_is_refused_in_one_line():
    with pytest.raises(CapError, match="below the 3 activation sets") as e:
        RankScheduler(0, 2, 3, 4, 2, build_policy("depth-first", 0, 2, 3, 4))
    assert "\n" not in str(e.value)
    RankScheduler(0, 2, 3, 4, 3, build_policy("depth-first", 0, 2, 3, 4))  # V is enough


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (3, 5)])
def test_simulator_reproduces_1f1b_bubble(pp, m):
    cost = CostModel.uniform(pp, 1)
    static = simulate(pp, 1, m, cost, schedule=build_schedule("1f1b", pp, 1, m))
    assert static.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert static.peak_activations == [min(pp - p, m) for p in range(pp)]
    dynamic = simulate(pp, 1, m, cost, traversal="depth-first", caps=compute_default_caps(pp, 1, m))
    assert dynamic.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_simulator_reproduces_interleaved_bubble(pp, v, m):
    cost = CostModel.uniform(pp, v)
    expected = (pp - 1) / (v * m + pp - 1)
    static = simulate(pp, v, m, cost, schedule=build_schedule("interleaved", pp, v, m))
    assert static.bubble_fraction == pytest.approx(expected)
    # the dynamic depth-first traversal at interleaved's own cap runs interleaved's timeline
    dynamic = simulate(pp, v, m, cost, traversal="depth-first", caps=compute_default_caps(pp, v, m))
    assert dynamic.bubble_fraction == pytest.approx(expected)
    assert all(d <= s for d, s in zip(dynamic.peak_activations, static.peak_activations))


@pytest.mark.parametrize("pp,v,m", [(2, 1, 3), (4, 2, 8), (3, 3, 5), (4, 3, 4), (1, 2, 3)])
def test_static_breadth_first_is_valid_and_has_interleaved_bubble(pp, v, m):
    schedule = build_schedule("looped-bfs", pp, v, m)
    validate_schedule(schedule)
    res = simulate(pp, v, m, CostModel.uniform(pp, v), schedule=schedule)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1) if m >= pp else res.bubble_fraction)
    assert res.peak_activations == [v * m] * pp  # looped BFS holds everything


def test_default_caps_are_interleaved_peaks():
    assert compute_default_caps(4, 1, 8) == [4, 3, 2, 1]
    # Megatron's warm-up count 2*(P-p-1) + (V-1)*P, plus the steady state's one
    assert compute_default_caps(4, 2, 8) == [2 * (4 - p - 1) + 4 + 1 for p in range(4)]
    assert all(c >= 3 for c in compute_default_caps(2, 3, 1))


def test_depth_first_order_covers_every_task_once_for_any_m():
    for pp, v, m in [(2, 2, 3), (4, 2, 5), (3, 3, 7), (4, 1, 2)]:
        for p in range(pp):
            order = compute_depth_first_order(p, pp, v, m)
            assert sorted(map(str, order)) == sorted(map(str, compute_rank_tasks(v, m)))


def test_jitter_spec_parsing():
    assert parse_jitter("3:1.5") == JitterSpec(3, 1.5, 0)
    assert parse_jitter("1:2:7") == JitterSpec(1, 2.0, 7)
    for bad in ("3", "a:1.5", "1:0.5", "1:2:3:4", "-1:2"):
        with pytest.raises(DppConfigError):
            parse_jitter(bad)


def test_newer_microbatch_leaves_the_older_ones_slot():
    # cap 2, V 2: after F(0,0), admitting microbatch 1 would take the slot F(1,0) still needs
    sched = RankScheduler(0, 1, 2, 3, 2, build_policy("breadth-first", 0, 1, 2, 3))
    order = []
    while not sched.done:
        d = sched.decide()
        sched.start(d.task)
        sched.finish(d.task)
        order.append(d.task)
    assert sched.counter.peak_activations == 2
    assert [str(t) for t in order[:3]] == ["F(c0,m0)", "F(c1,m0)", "B(c1,m0)"]


def test_jitter_injection_draws_what_the_simulator_draws(monkeypatch):
    import torch

    from megatronapp.dpp.jitter import apply_jitter
    from megatronapp.pipeline.runtime import NullInjector

    spec = JitterSpec(2, 1.5, 9)
    assert apply_jitter(None, (spec,), 1, torch.device("cpu")) is None  # other ranks untouched
    inj, slept = apply_jitter(NullInjector(), (spec,), 2, torch.device("cpu")), []
    monkeypatch.setattr("megatronapp.dpp.jitter.time.sleep", slept.append)
    for _ in range(5):
        with inj.compute():
            sum(range(20000))
    rng = random.Random("9:2")
    assert inj.factors == [rng.uniform(1.0, 1.5) for _ in range(5)]
    assert len(slept) == 5 and all(s >= 0 for s in slept)


@pytest.mark.parametrize("seed", range(30))
def test_in_order_runs_the_static_order_with_receives_ahead(seed):
    # in-order = interleaved 1F1B (1F1B for V = 1) under the eager comm model: the same
    # task start times on every rank, jitter and latency included; never above its cap
    pp, v, m, cost, _ = _random_case(seed)
    m = pp * max(1, m // pp)
    caps = compute_default_caps(pp, v, m)
    dynamic = simulate(pp, v, m, cost, traversal="in-order", caps=caps)
    static = simulate(pp, v, m, cost, schedule=build_schedule("interleaved" if v > 1 else "1f1b", pp, v, m))
    got = sorted((s.pp_rank, s.start_s, str(s.task)) for s in dynamic.spans)
    want = sorted((s.pp_rank, s.start_s, str(s.task)) for s in static.spans)
    # pytest.approx compares flat sequences of numbers only: tasks exactly, start times approximately
    assert [(rank, task) for rank, _, task in got] == [(rank, task) for rank, _, task in want]
    assert [start for _, start, _ in got] == pytest.approx([start for _, start, _ in want])
    assert all(peak <= c for peak, c in zip(dynamic.peak_activations, caps))


def test_in_order_cap_below_its_peak_is_refused_in_one_line():
    with pytest.raises(CapError, match="below the 11 activation sets the in-order traversal holds on pipeline rank 0"):
        RankScheduler(0, 4, 2, 8, 10, build_policy("in-order", 0, 4, 2, 8))
    RankScheduler(0, 4, 2, 8, 11, build_policy("in-order", 0, 4, 2, 8))


def test_message_pairs_are_the_directed_neighbours_of_each_pipeline():
    from megatronapp.dpp.channels import compute_message_pairs
    from megatronapp.parallel.layout import ParallelLayout

    assert compute_message_pairs(ParallelLayout(world_size=2, pp_size=2), 1) == [(0, 1), (1, 0)]
    # PP3, one chunk: neighbours only; two chunks: the last stage also feeds the first, and back
    assert compute_message_pairs(ParallelLayout(world_size=3, pp_size=3), 1) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert compute_message_pairs(ParallelLayout(world_size=3, pp_size=3, virtual_pp_size=2), 2) == [
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 2),
        (2, 0),
        (2, 1),
    ]
    # TP2 x DP2 x PP2: one pipeline per (tp, dp), stage stride tp * dp = 4
    lay = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    assert compute_message_pairs(lay, 1) == sorted([(r, r + 4) for r in range(4)] + [(r + 4, r) for r in range(4)])
