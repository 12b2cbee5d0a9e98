"""MegaDPP's W filling (dpp/scheduler.py, split backward): pure scheduler decisions replayed in
the simulator over many shapes, costs and delays. Never a deadlock, never over the cap (which
counts pending W), every W after its own I and before the step ends, W only as a filler."""

from __future__ import annotations

import random

import pytest

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.policies import TRAVERSALS, build_policy
from megatronapp.dpp.scheduler import RankScheduler, compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, simulate
from megatronapp.dpp.tasks import WEIGHT_GRAD, backward_task, forward_task, weight_task
from megatronapp.pipeline.actions import ActionKind

INPUT_GRAD = ActionKind.BACKWARD_INPUT  # how the simulator shows a backward task run split


def _random_case(seed: int):
    rng = random.Random(seed)
    pp, v = rng.randint(1, 6), rng.randint(1, 3)
    m = rng.randint(1, 4 * pp)
    cost = CostModel(
        tuple(tuple(rng.uniform(0.5, 2.0) for _ in range(v)) for _ in range(pp)),
        tuple(tuple(rng.uniform(1.0, 4.0) for _ in range(v)) for _ in range(pp)),
        p2p_latency_s=rng.choice([0.0, 0.1, 1.5]),
        weight_grad_share=rng.uniform(0.2, 0.7),
        jitter=tuple(JitterSpec(r, rng.uniform(1.0, 3.0), seed) for r in range(pp) if rng.random() < 0.5),
    )
    caps = compute_default_caps(pp, v, m)
    return pp, v, m, cost, caps, rng


@pytest.mark.parametrize("seed", range(40))
def test_w_filling_never_deadlocks_nor_exceeds_cap(seed):
    pp, v, m, cost, caps, rng = _random_case(seed)
    for traversal in TRAVERSALS:
        if traversal == "in-order" and m % pp:
            continue
        run_caps = caps if traversal == "in-order" else [rng.randint(v, c) for c in caps]  # tight caps too
        result = simulate(pp, v, m, cost, traversal=traversal, caps=run_caps, split_backward=True)  # raises on deadlock
        assert all(peak <= cap for peak, cap in zip(result.peak_activations, run_caps)), (traversal, run_caps)
        for rank in range(pp):
            spans = sorted((s for s in result.spans if s.pp_rank == rank), key=lambda s: s.start_s)
            ends = {(s.task.kind, s.task.chunk, s.task.microbatch): s.end_s for s in spans}
            assert len(spans) == 3 * v * m  # F, I and W of every (chunk, microbatch): all W before the step ends
            for s in spans:
                if s.task.kind is WEIGHT_GRAD:
                    assert s.start_s >= ends[(INPUT_GRAD, s.task.chunk, s.task.microbatch)]
                    # a filler: it ran only when the policy had nothing it would run
                    assert traversal == "in-order" or not s.decision.ready, s.decision.describe()


def test_w_filling_shortens_a_balanced_interleaved_step():
    # the W's fill interleaved 1F1B's bubbles: the simulated step is shorter at the same cap
    pp, v, m = 8, 2, 16
    cost, caps = CostModel.uniform(pp, v, 1.0, 2.0), compute_default_caps(pp, v, m)
    whole = simulate(pp, v, m, cost, traversal="in-order", caps=caps)
    split = simulate(pp, v, m, cost, traversal="in-order", caps=caps, split_backward=True)
    assert split.makespan_s < 0.96 * whole.makespan_s
    assert split.peak_activations == whole.peak_activations


def _scheduler(cap: int = 2) -> RankScheduler:
    # one rank, two chunks: every input is local
    return RankScheduler(0, 1, 2, 2, cap, build_policy("depth-first", 0, 1, 2, 2), split_backward=True)


def _run(s: RankScheduler, task) -> None:
    s.start(task)
    s.finish(task)


def test_pending_w_holds_its_slot_and_runs_when_nothing_else_can():
    s = _scheduler(cap=2)
    _run(s, forward_task(0, 0))
    _run(s, forward_task(1, 0))
    assert s.counter.activations == 2 and forward_task(0, 1) not in s.ready()  # cap binds
    _run(s, backward_task(1, 0))  # runs as I: its W is pending and still holds the slot
    assert s.pending_w == [weight_task(1, 0)] and s.counter.activations == 2
    decision = s.decide()
    assert decision.task == backward_task(0, 0)  # an I is ready: W waits
    _run(s, decision.task)
    decision = s.decide()  # only W's left that may run (F(0, 1) is over the cap)
    assert decision.task == weight_task(1, 0) and decision.policy == "w-fill"
    _run(s, decision.task)
    assert s.counter.activations == 1 and forward_task(0, 1) in s.ready()


def test_a_w_before_its_backward_is_refused():
    s = _scheduler()
    _run(s, forward_task(0, 0))
    with pytest.raises(RuntimeError, match="its backward has not run"):
        s.start(weight_task(0, 0))


def test_the_step_is_not_done_while_a_w_is_pending():
    s = RankScheduler(0, 1, 1, 1, 1, build_policy("in-order", 0, 1, 1, 1), split_backward=True)
    _run(s, forward_task(0, 0))
    _run(s, backward_task(0, 0))
    assert not s.done and s.decide().task == weight_task(0, 0)
    _run(s, weight_task(0, 0))
    assert s.done and s.counter.activations == 0


def test_schedule_show_draws_i_and_w_apart_and_simulate_can_turn_w_filling_off(tmp_path, capsys):
    from megatronapp.cli.main import main

    chrome = tmp_path / "s.json"
    assert (
        main(
            [
                "schedule",
                "show",
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-microbatches",
                "4",
                "--out",
                str(tmp_path / "s.png"),
                "--chrome",
                str(chrome),
            ]
        )
        == 0
    )
    import json

    cats = [e["cat"] for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]
    assert cats.count("forward") == cats.count("backward_input") == cats.count("weight_grad") == 2 * 2 * 4
    assert (
        main(
            [
                "schedule",
                "simulate",
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-microbatches",
                "4",
                "--json",
                "--no-split-backward",
            ]
        )
        == 0
    )
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        main(
            [
                "schedule",
                "simulate",
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-microbatches",
                "4",
                "--json",
            ]
        )
        == 0
    )
    split = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert whole["schedule"] == "dynamic/in-order" and split["schedule"] == "dynamic/in-order+W"
    assert split["iteration_s"] < whole["iteration_s"]
    assert main(["schedule", "simulate", "--weight-grad-share", "0"]) == 2
    assert "--weight-grad-share must be in (0, 1)" in capsys.readouterr().err
