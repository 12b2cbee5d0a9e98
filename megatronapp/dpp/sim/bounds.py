"""Provable lower bounds on one pipeline step's time, for ANY per-rank task order. Pure.

The model is the simulator's (simulator.py): each pipeline rank runs its 2*V*M tasks one at a
time; a task's input is the output of the previous task of its microbatch's chain
F(0), ..., F(S-1), B(S-1), ..., B(0) over the S = P*V virtual stages, and arrives
`transfer_s` after that task ended (0 on the same rank); the k-th task a rank runs takes
cost * f[k] + task_overhead_s, f being the rank's jitter draws in run order (all 1 without
jitter). Whatever the order, every rank r and every set X of r's tasks satisfy

    makespan >= min_{j in X} release(j) + work(X) + min_{j in X} tail(j)        (*)

(X's tasks run one after another on r, none before its release, and after the last one
ends its tail still has to run). release(j) is j's chain before it at unjittered cost
(factors >= 1) plus the transfers; tail(j) the chain after it likewise. work(X) is bounded
below two ways:
  * clairvoyant: X occupies |X| distinct run positions, so its time is at least its costs,
    largest first, times the rank's |X| smallest draws, smallest first (rearrangement
    inequality). Holds per seed, even for an oracle that knows every draw;
  * expected: a policy that picks a task before its draw is made (every real one: the
    factor is the machine's) gets, at each position, a factor independent of the task, so
    E[work(X)] = mean factor * costs and E[makespan] >= (*) with it (whether a task belongs
    to X is known when it is picked, for both kinds of set below). Holds for the mean over
    seeds only, not per seed.
Sets X used (the bound is the max over ranks and sets):
  * thresholds: the tasks of every class (kind, chunk) with release >= a and tail >= b, for
    every pair (a, b) of class values on the rank. X = all tasks is the classic "head + the
    rank's work + tail"; later classes alone win when M is small next to P (the chunk-1
    tasks cannot start before a full round through every rank);
  * the in-flight cap c (activation sets held: +1 at a forward's start, -1 at a backward's
    end, the scheduler's and the static order's unit): the (c+1)-th forward a rank starts
    needs a backward finished, so it, every later forward and every backward start at or
    after the earliest backward release R_B. X = all backwards + the V*M - c cheapest
    forwards (whichever forwards are the first c, the rest cost at least that), from R_B.
What it leaves out, so it can be loose: the other ranks' contention (each rank is bounded
alone, the others are infinitely fast past their unjittered chain), jitter on the chains
before and after a rank, and the cap's effect after the first backward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatronapp.dpp.sim.simulator import CostModel
from megatronapp.dpp.tasks import BACKWARD, FORWARD
from megatronapp.pipeline.actions import stage_location

FACTOR_MODES = ("clairvoyant", "expected", "none")  # "none": factors taken as 1 (valid, weakest)


@dataclass(frozen=True)
class TaskClass:
    """The M tasks (kind, chunk) of one rank: their cost, release and tail (seconds)."""

    kind: object
    chunk: int
    cost_s: float
    release_s: float
    tail_s: float


def _stage_cost(cost: CostModel, vs: int, kind, pp: int) -> float:
    rank, chunk = stage_location(vs, pp)
    return (cost.forward_s if kind is FORWARD else cost.backward_s)[rank][chunk] + cost.task_overhead_of(rank)


def _hop(cost: CostModel, src_vs: int, dst_vs: int, pp: int) -> float:
    src, dst = src_vs % pp, dst_vs % pp
    return 0.0 if src == dst else cost.transfer_s(src, dst)


def compute_chain_times(cost: CostModel, pp: int, vpp: int) -> tuple[list[tuple[float, float]], list[tuple]]:
    """(times, steps): per step of a microbatch's chain, steps = F(0)..F(S-1), B(S-1)..B(0) as
    (kind, virtual stage), times = (earliest start, least time after its end), every task at
    unjittered cost plus task_overhead_s, transfers between ranks included."""
    stages = pp * vpp
    steps = [(FORWARD, s) for s in range(stages)] + [(BACKWARD, s) for s in reversed(range(stages))]
    durations = [_stage_cost(cost, vs, kind, pp) for kind, vs in steps]
    hops = [_hop(cost, steps[i][1], steps[i + 1][1], pp) for i in range(len(steps) - 1)]  # F(S-1) -> B(S-1): local
    starts, t = [], 0.0
    for i, d in enumerate(durations):
        starts.append(t)
        t += d + (hops[i] if i < len(hops) else 0.0)
    total = t
    return [(starts[i], total - starts[i] - durations[i]) for i in range(len(steps))], steps


def compute_task_classes(cost: CostModel, pp: int, vpp: int, pp_rank: int) -> list[TaskClass]:
    """The 2V task classes of `pp_rank` with their chain release and tail."""
    times, steps = compute_chain_times(cost, pp, vpp)
    out = []
    for (start, tail), (kind, vs) in zip(times, steps):
        rank, chunk = stage_location(vs, pp)
        if rank == pp_rank:
            out.append(
                TaskClass(kind, chunk, _stage_cost(cost, vs, kind, pp) - cost.task_overhead_of(rank), start, tail)
            )
    return out


def compute_rank_draws(cost: CostModel, pp_rank: int, num_tasks: int) -> tuple[list[float], float]:
    """(the jitter factors `pp_rank` draws in one step, in run order as the simulator draws them;
    their distribution's mean): ([1.0] * num_tasks, 1.0) on a rank without jitter."""
    spec = {j.rank: j for j in cost.jitter}.get(pp_rank)
    if spec is None:
        return [1.0] * num_tasks, 1.0
    rng = random.Random(f"{spec.seed}:{pp_rank}")
    return [rng.uniform(1.0, spec.max_factor) for _ in range(num_tasks)], (1.0 + spec.max_factor) / 2


def compute_least_work_s(
    costs: list[float], draws: list[float], mean_factor: float, mode: str, overhead_s: float = 0.0
) -> float:
    """Least time `costs` (one task each) take on a rank with jitter `draws` (module docstring):
    clairvoyant pairs the costs, largest first, with the smallest draws; expected scales them by
    `mean_factor`; none by 1. Plus `overhead_s` per task."""
    if mode not in FACTOR_MODES:
        raise ValueError(f"unknown factor mode {mode!r}; choose one of {', '.join(FACTOR_MODES)}")
    if len(costs) > len(draws):
        raise ValueError(f"{len(costs)} tasks but only {len(draws)} draws")
    if mode == "none":
        factored = sum(costs)
    elif mode == "expected":
        factored = sum(costs) * mean_factor
    else:
        smallest = sorted(draws)[: len(costs)]
        factored = sum(c * f for c, f in zip(sorted(costs, reverse=True), smallest))
    return factored + overhead_s * len(costs)


def _threshold_bound(classes: list[TaskClass], m: int, work) -> float:
    best = 0.0
    for a in {c.release_s for c in classes}:
        for b in {c.tail_s for c in classes}:
            chosen = [c for c in classes if c.release_s >= a and c.tail_s >= b]
            if chosen:
                best = max(best, a + work([c.cost_s for c in chosen for _ in range(m)]) + b)
    return best


def _cap_bound(classes: list[TaskClass], m: int, cap: int, work) -> float:
    backwards = [c for c in classes if c.kind is BACKWARD]
    forward_costs = sorted(c.cost_s for c in classes if c.kind is FORWARD for _ in range(m))
    late_forwards = forward_costs[: max(0, len(forward_costs) - cap)]  # the cheapest that must wait
    chosen = [c.cost_s for c in backwards for _ in range(m)] + late_forwards
    return min(c.release_s for c in backwards) + work(chosen) + min(c.tail_s for c in backwards)


def compute_rank_bound_s(
    cost: CostModel, pp: int, vpp: int, m: int, pp_rank: int, cap: int | None = None, mode: str = "clairvoyant"
) -> float:
    """Lower bound (*) for `pp_rank` alone: max over the threshold sets and, with `cap`, the cap set."""
    classes = compute_task_classes(cost, pp, vpp, pp_rank)
    draws, mean_factor = compute_rank_draws(cost, pp_rank, 2 * vpp * m)
    overhead = cost.task_overhead_of(pp_rank)
    work = lambda costs: compute_least_work_s(costs, draws, mean_factor, mode, overhead)
    bound = _threshold_bound(classes, m, work)
    if cap is not None:
        bound = max(bound, _cap_bound(classes, m, cap, work))
    return bound


def compute_step_bound_s(
    cost: CostModel, pp: int, vpp: int, m: int, caps: list[int] | None = None, mode: str = "clairvoyant"
) -> float:
    """Lower bound on the step time of any schedule of (pp, vpp, m) under `cost` (its jitter seeds),
    holding at most caps[r] activation sets on rank r (None: any memory). `mode`: clairvoyant
    (per seed, any order, even one knowing every draw), expected (bounds the mean over seeds
    of any policy that cannot see a draw before choosing), none (every factor taken as 1: valid
    always, exact without jitter)."""
    if caps is not None and len(caps) != pp:
        raise ValueError(f"caps has {len(caps)} entries for {pp} pipeline ranks")
    return max(compute_rank_bound_s(cost, pp, vpp, m, r, None if caps is None else caps[r], mode) for r in range(pp))
