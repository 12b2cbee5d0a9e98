"""The microbatch rebalancing planner: pure decisions from measured per-rank compute times."""

from __future__ import annotations

import random

import pytest

from megatronapp.dpp.rebalance import RebalanceConfig
from megatronapp.dpp.rebalance_microbatches import MicrobatchRebalancer, ReplicaModel, plan_replica_microbatches

MODEL = ReplicaModel(dp_size=2, num_microbatches=4)


def _rebalancer(config=None, model=MODEL) -> MicrobatchRebalancer:
    ranks = [[r] for r in range(model.dp_size)]
    config = config or RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0)
    return MicrobatchRebalancer(config, model, ranks)


def _replica_times(split, speeds) -> tuple[float, ...]:
    return tuple(m * v for m, v in zip(split, speeds))


def test_the_split_minimises_the_slowest_replica():
    assert plan_replica_microbatches(MODEL, [1.0, 1.0]) == (4, 4)
    assert plan_replica_microbatches(MODEL, [1.0, 2.0]) == (6, 2)  # 6 x 1 vs 2 x 2: no split has a smaller maximum
    assert plan_replica_microbatches(MODEL, [1.0, 2.0], current=(4, 4)) == (5, 3)  # as small, nearer (4, 4)
    assert plan_replica_microbatches(MODEL, [1.0, 100.0]) == (7, 1)  # every replica keeps one
    grouped = ReplicaModel(dp_size=2, num_microbatches=4, granule=2)  # interleaved over PP2
    assert plan_replica_microbatches(grouped, [1.0, 2.0]) == (6, 2)  # 6 vs 4 beats 4 vs 8
    assert plan_replica_microbatches(ReplicaModel(3, 2), [1.0, 1.0, 3.0]) == (3, 2, 1)


def test_a_replica_measured_twice_as_slow_gets_fewer_microbatches_after_one_window():
    rebalancer = _rebalancer()
    window = rebalancer.config.window
    plans = [rebalancer.observe(_replica_times((4, 4), (1.0, 2.0)), 8.0) for _ in range(window)]
    assert plans[:-1] == [None] * (window - 1)
    plan = plans[-1]
    assert plan.replica_microbatches == (5, 3) and plan.gain == pytest.approx(1 - 6 / 8)
    assert "replica 1 runs 2.00x" in plan.reason
    rebalancer.moved(plan, seconds=0.01)
    # settled: the same fault under the new split asks for nothing more
    assert all(rebalancer.observe(_replica_times((5, 3), (1.0, 2.0)), 6.0) is None for _ in range(5 * window))


def test_the_slowest_rank_of_a_replica_sets_its_speed():
    layout = [[0, 2], [1, 3]]  # replica 0: ranks 0 and 2 (its two pipeline stages), replica 1: 1 and 3
    config = RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0)
    rebalancer = MicrobatchRebalancer(config, MODEL, layout)
    plans = [rebalancer.observe((4.0, 4.0, 1.0, 8.0), 8.0) for _ in range(config.window)]
    assert plans[-1].replica_microbatches == (5, 3)


def test_noise_on_balanced_replicas_never_moves_microbatches():
    """+-20% per iteration: a single iteration can look like a 1.5x slower replica, a window's median cannot."""
    rng = random.Random(0)
    rebalancer = _rebalancer()
    for _ in range(500):
        assert rebalancer.observe((4.0 * rng.uniform(0.8, 1.2), 4.0 * rng.uniform(0.8, 1.2)), 4.0) is None


def test_a_fault_that_goes_away_moves_the_microbatches_back():
    config = RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0, memory_iters=20)
    rebalancer = _rebalancer(config)
    plan = [rebalancer.observe(_replica_times((4, 4), (1.0, 3.0)), 12.0) for _ in range(config.window)][-1]
    assert plan.replica_microbatches == (6, 2)
    rebalancer.moved(plan, seconds=0.01)
    # the fault stops: replica 1 is as fast as replica 0 again; (4, 4) ran slower when measured under
    # the fault, so the split goes back once that measurement is 20 iterations old
    back = [rebalancer.observe(_replica_times((6, 2), (1.0, 1.0)), 6.0) for _ in range(6 * config.window)]
    moved_back = [i for i, p in enumerate(back) if p is not None]
    assert moved_back and back[moved_back[0]].replica_microbatches == (4, 4)
    assert config.window + moved_back[0] <= 2 * config.memory_iters


def test_a_small_saving_does_not_undo_the_last_move():
    rebalancer = _rebalancer(
        RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0, memory_iters=4)
    )
    plan = [rebalancer.observe(_replica_times((4, 4), (1.0, 1.5)), 6.0) for _ in range(rebalancer.config.window)][-1]
    assert plan.replica_microbatches == (5, 3)
    rebalancer.moved(plan, seconds=0.01)
    # replica 1 still 1.12x slower: back to 4,4 would save 10% of 5.0 s (4.48 s), enough for a first
    # move, not to undo one
    speeds = (1.0, 1.12)
    assert all(rebalancer.observe(_replica_times((5, 3), speeds), 5.0) is None for _ in range(3 * 8))
    assert rebalancer.propose(list(_replica_times((5, 3), speeds))).replica_microbatches == (4, 4)
    # the fault is over (within noise): the balanced split comes back, under the bar for undoing a move
    plans = [rebalancer.observe(_replica_times((5, 3), (1.0, 1.06)), 5.0) for _ in range(3 * 8)]
    homes = [p for p in plans if p is not None]
    assert homes and homes[0].replica_microbatches == (4, 4) and "no replica is slower" in homes[0].reason


def test_a_fault_the_relieved_replica_hid_moves_microbatches_off_again_after_the_balanced_split_came_back():
    """Replica 1 is 1.5x slower per microbatch with 4, as fast as replica 0 with 3: moving one off
    saves 17% (a first move's bar, not an undoing's), so it must happen again after the probe home."""
    config = RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0, memory_iters=8)
    rebalancer = _rebalancer(config)
    measured = {(4, 4): ((4.0, 6.0), 6.5), (5, 3): ((5.0, 3.0), 5.5)}
    moves = []
    for _ in range(60):
        compute, step = measured[rebalancer.split]
        plan = rebalancer.observe(compute, step)
        if plan is not None:
            rebalancer.moved(plan, seconds=0.01)
            moves.append(plan.replica_microbatches)
    assert moves[:3] == [(5, 3), (4, 4), (5, 3)], moves


def test_a_split_that_ran_slower_when_tried_is_not_tried_again_while_the_measurement_is_fresh():
    """A quota-like fault: replica 1 is 3x slower per microbatch while loaded, but with one
    microbatch it stays under its quota and looks fast; the model then wants microbatches back,
    the measurements say no."""
    rebalancer = _rebalancer(
        RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0, memory_iters=100)
    )
    measured = {(4, 4): ((4.0, 12.0), 12.0), (6, 2): ((6.0, 5.0), 6.0), (7, 1): ((7.0, 1.1), 7.0)}
    moves = []
    for _ in range(80):
        compute, step = measured.get(rebalancer.split, ((4.0, 12.0), 12.0))
        plan = rebalancer.observe(compute, step)
        if plan is not None:
            rebalancer.moved(plan, seconds=0.01)
            moves.append(plan.replica_microbatches)
    assert moves[0] == (6, 2) and len(moves) <= 3, moves
    assert len(moves) * rebalancer.config.window <= 40  # settled: no move in the last windows


class _SplitOnlyTrainer:
    """What the hook asks of a trainer when only microbatches move (a layer move fails the test)."""

    def __init__(self, job):
        from megatronapp.engine.hooks import NULL_TRACER

        self.job, self.tracer, self.replica_microbatches = job, NULL_TRACER, None

    def set_replica_microbatches(self, split) -> None:
        self.replica_microbatches = split


def test_all_moves_microbatches_off_a_slow_replica_and_leaves_the_balanced_stages_alone():
    from engine_jobs import make_job

    from megatronapp.dpp.rebalance_hook import build_rebalance_hook

    job = make_job(4, pp=2, global_batch=8, micro_batch=1)  # DP2 x PP2, 4 microbatches per replica
    trainer = _SplitOnlyTrainer(job)
    hook = build_rebalance_hook(
        RebalanceConfig(mode="all", warmup_iters=0, window=2, first_move_cost_s=0.0), job, trainer
    )
    replica = [job.layout.coords(r).dp for r in range(4)]
    lines = []
    for it in range(1, 13):  # replica 1's ranks (1 and 3) take 3 s a microbatch, replica 0's 1 s
        split = trainer.replica_microbatches or (4, 4)
        compute = [split[d] * (3.0 if d == 1 else 1.0) for d in replica]
        metrics = {"iteration": it, "rank_compute_s": compute, "step_time_s": max(compute)}
        lines.append(hook.after_step(metrics))
    moved = [line for line in lines if line]
    assert trainer.replica_microbatches == (6, 2) and len(moved) == 1, moved
    assert "microbatches per data-parallel replica 4,4 -> 6,2" in moved[0]


def test_the_first_iterations_of_a_job_are_not_measurements_of_speed():
    """A clean job whose first two iterations ran slow on one replica (start-up) keeps its split."""
    rebalancer = _rebalancer(RebalanceConfig(mode="microbatches", first_move_cost_s=0.0, window=2))
    startup = [(0.8, 0.1), (0.8, 0.1)]  # replica 0 slow while it warms up
    steady = [(0.1, 0.1)] * 8
    plans = [rebalancer.observe(compute, max(compute)) for compute in startup + steady]
    assert plans == [None] * 10
    eager = _rebalancer(RebalanceConfig(mode="microbatches", warmup_iters=0, first_move_cost_s=0.0, window=2))
    assert any(eager.observe(c, max(c)) for c in startup + steady)  # not vacuous: counted, they would move


def _greedy_by_scan(model: ReplicaModel, speeds: list[float]) -> tuple[int, ...]:
    """The greedy fill written the plain way: every granule to the replica whose time grows least."""
    g, counts = model.granule, [model.granule] * model.dp_size
    for _ in range((model.dp_size * model.num_microbatches - sum(counts)) // g):
        best = min(range(model.dp_size), key=lambda r: (speeds[r] * (counts[r] + g), r))
        counts[best] += g
    return tuple(counts)


@pytest.mark.parametrize("seed", range(20))
def test_the_fill_is_the_plain_greedy_fill_ties_included(seed):
    rng = random.Random(seed)
    model = ReplicaModel(rng.randint(2, 12), rng.randint(1, 40), rng.choice((1, 2, 4)))
    speeds = [rng.choice((1.0, 1.0, 1.5, rng.uniform(0.5, 3.0))) for _ in range(model.dp_size)]  # ties on purpose
    assert plan_replica_microbatches(model, speeds) == _greedy_by_scan(model, speeds)
