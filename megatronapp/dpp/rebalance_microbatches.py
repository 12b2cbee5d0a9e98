"""Give a persistently slow data-parallel replica fewer microbatches: the planner, pure and replayable.

Every rank feeds the same numbers (each rank's compute seconds per iteration, all-reduced by the
engine with the step's metrics) to its own `MicrobatchRebalancer`, so every rank reaches the same
split without talking. The model of a replica's time is linear in the microbatches it runs:

    time_r = speed_r x m_r

`speed_r` is measured: the median over a window of iterations of the slowest rank of replica r
(its pipeline and TP members wait for it) divided by the microbatches it ran, and, as for layers
(dpp/rebalance.py), the slowest it was measured at within `memory_iters` iterations (a replica
relieved of work can hide a throughput cap such as a CPU quota). A split gives each replica the
microbatches that minimise the slowest replica (adding one granule at a time to the replica whose
time grows least is optimal for this bottleneck objective); the interleaved schedules move them in
groups of the pipeline size (engine/replica_split.py). A split is adopted under the layer planner's
rules (compute_worth_moving: min_gain, amortisation, the reverse factor) and never while a split
measured lately ran no faster (compute_measured_worse), so noise does not re-plan and a fault that
goes away moves the microbatches back once its measurements are old: as soon as no replica is
remembered slower per microbatch than the fastest by `min_gain`, the balanced split comes back,
gain or not (compute_home_due). The engine applies a split exactly: the gradient stays the
balanced run's (engine/replica_split.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from megatronapp.dpp.rebalance import RebalanceConfig, compute_home_due, compute_measured_worse, compute_worth_moving
from megatronapp.dpp.rebalance_window import MeasurementWindow


@dataclass(frozen=True)
class ReplicaModel:
    """What the planner knows of the job's data parallelism."""

    dp_size: int
    num_microbatches: int  # per replica, balanced
    granule: int = 1  # a replica's count moves in steps of this (engine/replica_split.py)

    @property
    def balanced(self) -> tuple[int, ...]:
        return (self.num_microbatches,) * self.dp_size


@dataclass(frozen=True)
class MicrobatchPlan:
    replica_microbatches: tuple[int, ...]
    predicted_s: float  # slowest replica, this split
    current_s: float  # slowest replica, the split in force
    reason: str

    @property
    def gain(self) -> float:
        return 1.0 - self.predicted_s / self.current_s


def plan_replica_microbatches(
    model: ReplicaModel, speeds: list[float], current: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """Microbatches per replica minimising the slowest replica under `speeds` (seconds per
    microbatch); each replica runs at least one granule. Of the splits with that smallest
    maximum, the one nearest `current` (ties otherwise to the lower replica)."""
    g, total = model.granule, model.dp_size * model.num_microbatches
    counts = [g] * model.dp_size
    # the greedy fill through a heap of (time with one more granule, replica): a plan is made every
    # step once the window is full, and a scan of every replica per granule is quadratic
    grow = [(speeds[r] * (counts[r] + g), r) for r in range(model.dp_size)]
    heapq.heapify(grow)
    for _ in range((total - sum(counts)) // g):
        _, best = heapq.heappop(grow)
        counts[best] += g
        heapq.heappush(grow, (speeds[best] * (counts[best] + g), best))
    if not current:
        return tuple(counts)
    bottleneck = max(compute_replica_times(speeds, counts))
    upper = [max(g, int(bottleneck / v / g + 1e-9) * g) for v in speeds]  # the most each may run
    nearest = [min(m, u) for m, u in zip(current, upper)]
    while sum(nearest) < total:  # the greedy split fits under `upper`, so there is room
        r = max((r for r in range(model.dp_size) if nearest[r] < upper[r]), key=lambda r: current[r] - nearest[r])
        nearest[r] += g
    return tuple(nearest)


def compute_replica_times(speeds: list[float], split) -> list[float]:
    return [v * m for v, m in zip(speeds, split)]


@dataclass
class MicrobatchRebalancer:
    """Decides, from each iteration's per-rank compute seconds, when and how microbatches move."""

    config: RebalanceConfig
    model: ReplicaModel
    ranks_of_replica: list[list[int]]  # global ranks of each DP replica (its TP and PP members)
    split: tuple[int, ...] = ()  # the split in force (() : balanced)
    last_move_s: float | None = None
    previous_split: tuple[int, ...] | None = None  # the split before the last move
    # split -> (median iteration seconds measured under it, iteration it was measured at)
    measured: dict[tuple[int, ...], tuple[float, int]] = field(default_factory=dict)
    measurements: MeasurementWindow | None = None  # None: the config's (RebalanceConfig.measurement_window)

    def __post_init__(self) -> None:
        self.split = self.split or self.model.balanced
        self.measurements = self.measurements or self.config.measurement_window()

    def observe(self, rank_compute_s: tuple[float, ...], step_s: float) -> MicrobatchPlan | None:
        """Add one iteration's measurements (each rank's compute seconds, the iteration's seconds);
        a plan when the split should change now."""
        medians = self.measurements.add(rank_compute_s, self.ranks_of_replica, step_s)
        if medians is None:
            return None
        iteration = self.measurements.iteration
        self.measured[self.split] = (medians[1], iteration)
        speeds = self._remember(medians[0])
        home = self.model.balanced
        if compute_home_due(self.config, speeds, self.measured, self.split, home, iteration):
            current_s = max(compute_replica_times(speeds, self.split))
            reason = "no replica is slower per microbatch any more: back to the balanced split"
            return MicrobatchPlan(home, max(compute_replica_times(speeds, home)), current_s, reason)
        plan = self._propose(speeds)
        if plan is None or not compute_worth_moving(self.config, plan, self.last_move_s, self._reverses(plan)):
            return None
        measured_worse = compute_measured_worse(
            self.config, self.measured, plan.replica_microbatches, self.split, iteration
        )
        return None if measured_worse else plan

    def propose(self, replica_s: list[float]) -> MicrobatchPlan | None:
        """The best split for measured replica times under the split in force (None: no change)."""
        return self._propose(self._remember(replica_s))

    def _remember(self, replica_s: list[float]) -> list[float]:
        """Each replica's speed (seconds per microbatch): now, and the slowest measured lately."""
        return self.measurements.remember([t / m for t, m in zip(replica_s, self.split)])

    def _propose(self, speeds: list[float]) -> MicrobatchPlan | None:
        planned = plan_replica_microbatches(self.model, speeds, self.split)
        current_s = max(compute_replica_times(speeds, self.split))
        predicted = max(compute_replica_times(speeds, planned))
        if planned == self.split or predicted >= current_s:
            return None
        slow = max(range(self.model.dp_size), key=lambda r: speeds[r])
        reason = f"replica {slow} runs {speeds[slow] / min(speeds):.2f}x the fastest replica's time per microbatch"
        return MicrobatchPlan(planned, predicted, current_s, reason)

    def _reverses(self, plan: MicrobatchPlan) -> bool:
        return plan.replica_microbatches == self.previous_split

    def moved(self, plan: MicrobatchPlan, seconds: float) -> None:
        """The split of `plan` is in force and took `seconds` to apply: measure afresh under it (a
        move to the balanced split clears the bar for undoing a move, as for layers)."""
        self.previous_split = None if plan.replica_microbatches == self.model.balanced else self.split
        self.split, self.last_move_s = plan.replica_microbatches, seconds
        self.restart()

    def restart(self) -> None:
        """Measure afresh (the work moved, here or between pipeline stages)."""
        self.measurements.restart()
