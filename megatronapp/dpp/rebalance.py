"""Move layers away from a persistently slow pipeline stage: the planner, pure and replayable.

Every rank feeds the same numbers (each rank's compute seconds per iteration, all-reduced by the
engine with the step's metrics) to its own `LayerRebalancer`, so every rank reaches the same
decision without talking. The model of a stage's time is linear in the work it holds:

    time_p = speed_p x (layers_p + extra_p)

`extra_p` is the output layer and loss on the last stage, in layer units from their FLOPs (the
embedding lookup is free); `speed_p` is measured, the median over a window of iterations of the
slowest rank of stage p (its TP and DP members wait for it). A plan gives each pipeline rank the
layers that minimise the slowest stage (filling one layer at a time into the stage whose time
grows least is optimal for this bottleneck objective), split over its virtual stages. It is
adopted only when it saves at least `min_gain` of the slowest stage's time and that saving, over
`amortize_iters` iterations, repays the move's cost `margin` times over. After a move the window
starts afresh, and a plan back to the partition before it must save `reverse_gain_factor` times
more, so noise cannot move layers back and forth. A partition measured within `memory_iters`
iterations is judged by its measured iteration time, not by the model, and a stage's speed is the slowest it
was measured at over that time (a stage relieved of layers can hide a throughput cap such as a CPU
quota): a move the model favours but that ran slower when tried is not tried again until that
measurement is old, so a fault that goes away moves the layers back after at most that long.
Once no stage is remembered slower per layer than the fastest by `min_gain` (the fault that moved
the work is over), the layers go back to the job's own partition, gain or not: within the model's
error the partitions tie, and the job's own is the one a clean run uses. Leaving it again is a first
move, so a fault the relieved stage had hidden moves the layers off once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronapp.dpp.rebalance_window import MeasurementWindow
from megatronapp.flags import Flag

REBALANCE_MODES = ("off", "layers", "microbatches", "all")  # all: layers and microbatches


class RebalanceConfigError(ValueError):
    """A bad rebalancing flag; the message is one line."""


@dataclass(frozen=True)
class RebalanceConfig:
    # one of REBALANCE_MODES; layers: move layers between pipeline stages; microbatches: move
    # microbatches between data-parallel replicas (dpp/rebalance_microbatches.py)
    mode: str = "off"
    window: int = 8  # iterations of measurements a plan reads (and waits for after a move)
    # share of the slowest stage's time a plan must save: 10%, the shift Greyhound's fail-slow detection
    # waits for; the last stage's output layer alone keeps a clean pipeline a few percent unbalanced
    min_gain: float = 0.10
    reverse_gain_factor: float = 2.0  # a plan back to the partition before the last move must save this many times more
    amortize_iters: int = 100  # iterations over which the saving must repay the move
    margin: float = 2.0  # ... this many times over
    first_move_cost_s: float = 1.0  # cost assumed for the first move; later moves use the last one measured
    # the job's first iterations (allocator, lazy initialisation, caches) measure start-up, not speed
    warmup_iters: int = 2
    memory_iters: int = 200  # a partition's measured iteration time vetoes the model's prediction this long
    memory_budget_gb: float | None = None  # per pipeline rank: params + fp32 master + Adam state of its layers

    def measurement_window(self) -> MeasurementWindow:
        """A fresh window of this config's sizes (dpp/rebalance_window.py)."""
        return MeasurementWindow(self.warmup_iters, self.window, self.memory_iters)

    def __post_init__(self) -> None:
        if self.mode not in REBALANCE_MODES:
            raise RebalanceConfigError(
                f"--dpp-rebalance must be one of {', '.join(REBALANCE_MODES)}, got {self.mode!r}"
            )
        if self.window < 2:
            raise RebalanceConfigError(f"--dpp-rebalance-window must be >= 2, got {self.window}")
        if not 0 < self.min_gain < 1:
            raise RebalanceConfigError(f"--dpp-rebalance-min-gain must be in (0, 1), got {self.min_gain}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise RebalanceConfigError(f"--dpp-rebalance-memory-gb must be > 0, got {self.memory_budget_gb}")


@dataclass(frozen=True)
class StageModel:
    """What the planner knows of the job: pipeline shape and the cost of each kind of work."""

    num_layers: int
    pp_size: int
    vpp_size: int
    head_layers: float  # the last stage's output layer + loss, in layer units
    bytes_per_layer: int  # params + fp32 master + two Adam moments + grad of one layer, one TP shard

    @staticmethod
    def of(job) -> StageModel:
        m, lay = job.model, job.layout
        h, s, f = m.hidden_size, m.seq_length, m.ffn_size
        layer_flops = 8 * h * h + 4 * h * f + 4 * h * s  # per token, forward: QKV + proj, MLP, attention
        per_layer = (4 * h * h + 2 * h * f) // lay.tp_size
        return StageModel(
            num_layers=m.num_layers,
            pp_size=lay.pp_size,
            vpp_size=lay.virtual_pp_size,
            head_layers=2 * h * m.padded_vocab_size / layer_flops,
            bytes_per_layer=per_layer * (2 + 4 + 8 + 4),
        )

    def extras(self) -> list[float]:
        return [0.0] * (self.pp_size - 1) + [self.head_layers]


@dataclass(frozen=True)
class Plan:
    stage_layers: tuple[int, ...]  # per virtual stage, parallel/partition.py's order
    rank_layers: tuple[int, ...]  # per pipeline rank
    predicted_s: float  # slowest stage, this plan
    current_s: float  # slowest stage, the partition in force
    reason: str

    @property
    def gain(self) -> float:
        return 1.0 - self.predicted_s / self.current_s


def compute_rank_layers(stage_layers: tuple[int, ...], pp_size: int) -> tuple[int, ...]:
    return tuple(sum(stage_layers[v] for v in range(p, len(stage_layers), pp_size)) for p in range(pp_size))


def split_over_virtual_stages(rank_layers: tuple[int, ...], vpp_size: int) -> tuple[int, ...]:
    """Per-rank layer counts -> per virtual stage (order chunk x PP + rank), earlier chunks taking the remainder."""
    return tuple(n // vpp_size + (1 if c < n % vpp_size else 0) for c in range(vpp_size) for n in rank_layers)


def compute_stage_times(speeds: list[float], rank_layers, extras: list[float]) -> list[float]:
    return [v * (n + e) for v, n, e in zip(speeds, rank_layers, extras)]


def plan_rank_layers(
    model: StageModel, speeds: list[float], max_layers: list[int] | None = None, current: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """Layers per pipeline rank minimising the slowest stage under `speeds` (seconds per layer unit);
    every rank keeps one layer per virtual stage, and at most `max_layers[p]` (memory). Of the splits
    with that smallest maximum, the one moving fewest layers from `current`."""
    extras = model.extras()
    counts = [model.vpp_size] * model.pp_size
    for _ in range(model.num_layers - sum(counts)):
        candidates = [p for p in range(model.pp_size) if max_layers is None or counts[p] < max_layers[p]]
        if not candidates:
            raise RebalanceConfigError("the layers do not fit the pipeline ranks' memory budget")
        best = min(candidates, key=lambda p: (speeds[p] * (counts[p] + 1 + extras[p]), p))
        counts[best] += 1
    if not current:
        return tuple(counts)
    bottleneck = max(compute_stage_times(speeds, counts, extras))
    return _closest_within(model, current, [_most_layers(v, e, bottleneck) for v, e in zip(speeds, extras)], max_layers)


def _most_layers(speed: float, extra: float, bottleneck: float) -> int:
    return int(bottleneck / speed - extra + 1e-9)


def _closest_within(model: StageModel, current, upper: list[int], max_layers: list[int] | None) -> tuple[int, ...]:
    """Counts within [vpp, upper] (and the memory caps) adding up to the layers, nearest `current`."""
    if max_layers is not None:
        upper = [min(u, m) for u, m in zip(upper, max_layers)]
    counts = [min(max(n, model.vpp_size), u) for n, u in zip(current, upper)]
    while sum(counts) > model.num_layers:
        p = max((p for p in range(model.pp_size) if counts[p] > model.vpp_size), key=lambda p: counts[p] - current[p])
        counts[p] -= 1
    while sum(counts) < model.num_layers:
        p = max((p for p in range(model.pp_size) if counts[p] < upper[p]), key=lambda p: current[p] - counts[p])
        counts[p] += 1
    return tuple(counts)


@dataclass
class LayerRebalancer:
    """Decides, from each iteration's per-rank compute seconds, when and where layers move."""

    config: RebalanceConfig
    model: StageModel
    stage_layers: tuple[int, ...]  # the partition in force
    ranks_of_stage: list[list[int]]  # global ranks of each pipeline rank (its TP and DP members)
    last_move_s: float | None = None
    previous_layers: tuple[int, ...] | None = None  # the partition before the last move
    # partition -> (median iteration seconds measured in it, iteration it was measured at)
    measured: dict[tuple[int, ...], tuple[float, int]] = field(default_factory=dict)
    measurements: MeasurementWindow | None = None  # None: the config's (RebalanceConfig.measurement_window)

    home_layers: tuple[int, ...] = ()  # the job's own partition (() : the one in force at the start)

    def __post_init__(self) -> None:
        self.measurements = self.measurements or self.config.measurement_window()
        self.home_layers = self.home_layers or self.stage_layers

    def observe(self, rank_compute_s: tuple[float, ...], step_s: float) -> Plan | None:
        """Add one iteration's measurements (each rank's compute seconds, the iteration's seconds);
        a plan when the partition should change now."""
        medians = self.measurements.add(rank_compute_s, self.ranks_of_stage, step_s)
        if medians is None:
            return None
        stage_s, self.measured[self.stage_layers] = medians[0], (medians[1], self.measurements.iteration)
        speeds = self._remember(stage_s)
        iteration = self.measurements.iteration
        if compute_home_due(self.config, speeds, self.measured, self.stage_layers, self.home_layers, iteration):
            return self._plan_of(
                self.home_layers, speeds, "no stage is slower per layer any more: back to the job's own split"
            )
        plan = self._propose(speeds)
        return plan if plan is not None and self._worth_it(plan) and not self._measured_worse(plan) else None

    def propose(self, stage_s: list[float]) -> Plan | None:
        """The best partition for measured stage times under the partition in force (None: no change)."""
        return self._propose(self._remember(stage_s))

    def _remember(self, stage_s: list[float]) -> list[float]:
        """Each stage's speed (seconds per layer unit): now, and the slowest measured lately."""
        current = compute_rank_layers(self.stage_layers, self.model.pp_size)
        return self.measurements.remember([t / (n + e) for t, n, e in zip(stage_s, current, self.model.extras())])

    def _plan_of(self, stage_layers: tuple[int, ...], speeds: list[float], reason: str) -> Plan:
        """The plan that moves to `stage_layers` (per virtual stage), with its predicted times."""
        pp, extras = self.model.pp_size, self.model.extras()
        ranks, current = compute_rank_layers(stage_layers, pp), compute_rank_layers(self.stage_layers, pp)
        predicted = max(compute_stage_times(speeds, ranks, extras))
        return Plan(stage_layers, ranks, predicted, max(compute_stage_times(speeds, current, extras)), reason)

    def _propose(self, speeds: list[float]) -> Plan | None:
        current = compute_rank_layers(self.stage_layers, self.model.pp_size)
        extras = self.model.extras()
        cap = None
        if self.config.memory_budget_gb is not None:
            cap = [int(self.config.memory_budget_gb * 2**30 // self.model.bytes_per_layer)] * self.model.pp_size
        planned = plan_rank_layers(self.model, speeds, cap, current)
        if planned == current:
            return None
        predicted = max(compute_stage_times(speeds, planned, extras))
        slow = max(range(len(speeds)), key=lambda p: speeds[p])
        reason = f"stage {slow} runs {speeds[slow] / min(speeds):.2f}x the fastest stage's time per layer"
        current_s = max(compute_stage_times(speeds, current, extras))
        return Plan(split_over_virtual_stages(planned, self.model.vpp_size), planned, predicted, current_s, reason)

    def _worth_it(self, plan: Plan) -> bool:
        return compute_worth_moving(self.config, plan, self.last_move_s, plan.stage_layers == self.previous_layers)

    def _measured_worse(self, plan: Plan) -> bool:
        iteration = self.measurements.iteration
        return compute_measured_worse(self.config, self.measured, plan.stage_layers, self.stage_layers, iteration)

    def moved(self, plan: Plan, seconds: float) -> None:
        """The move of `plan` happened and took `seconds`: measure afresh in the new partition. A move
        home clears the bar for undoing a move: leaving home again, when a fault hidden by the
        relieved stage shows once more, is a first move."""
        self.previous_layers = None if plan.stage_layers == self.home_layers else self.stage_layers
        self.stage_layers, self.last_move_s = plan.stage_layers, seconds
        self.restart()

    def restart(self) -> None:
        """Measure afresh (the work moved, here or between replicas)."""
        self.measurements.restart()


def compute_worth_moving(config: RebalanceConfig, plan, last_move_s: float | None, reverses: bool) -> bool:
    """The hysteresis every planner applies to a plan (anything with gain, current_s, predicted_s):
    it saves at least min_gain of the slowest part's time (reverse_gain_factor times more when it
    undoes the last move: noise must not undo a move), and that saving over amortize_iters repays
    the last move's measured cost (first_move_cost_s before any) margin times over."""
    cost = config.first_move_cost_s if last_move_s is None else last_move_s
    saving = (plan.current_s - plan.predicted_s) * config.amortize_iters
    needed = config.min_gain * (config.reverse_gain_factor if reverses else 1.0)
    return plan.gain >= needed and saving >= config.margin * cost


def compute_measured_worse(config: RebalanceConfig, measured: dict, there, here, iteration: int) -> bool:
    """Whether plan `there` was measured lately (`measured`: plan -> (median iteration seconds,
    iteration)) and ran no faster than `here`: a measurement beats the linear model (a CPU quota,
    for one, slows a rank only while its work exceeds the quota, so a rank relieved of work looks
    faster per unit than it will be)."""
    seen = measured.get(there)
    if seen is None or iteration - seen[1] > config.memory_iters:
        return False
    return seen[0] >= measured[here][0] * (1 - config.min_gain)


def compute_home_due(config: RebalanceConfig, speeds: list[float], measured: dict, here, home, iteration: int) -> bool:
    """Whether the work goes back to the job's own split `home`: it is elsewhere, no part's
    remembered speed (seconds per unit) is `min_gain` or more above the fastest part's, and home
    was not measured lately to run slower (compute_measured_worse)."""
    if here == home or max(speeds) >= (1 + config.min_gain) * min(speeds):
        return False
    return not compute_measured_worse(config, measured, home, here, iteration)


# `train`'s flags that set RebalanceConfig's fields (their defaults are the fields')
REBALANCE_FLAGS = (
    Flag(
        "--dpp-rebalance",
        "mode",
        "layers: while training, move whole layers off a pipeline stage that is persistently slower than "
        "the others (measured compute time per layer), exactly, and back when it recovers; microbatches: "
        "give a persistently slower data-parallel replica fewer microbatches of the same global batch "
        "(the gradient stays the balanced one); all: both",
        {"choices": REBALANCE_MODES},
    ),
    Flag("--dpp-rebalance-window", "window", "iterations of measurements a plan reads, and waits for after a move"),
    Flag("--dpp-rebalance-min-gain", "min_gain", "share of the slowest stage's time a move must save"),
    Flag(
        "--dpp-rebalance-memory-gb",
        "memory_budget_gb",
        "most GB of layer state (params, fp32 master, Adam moments, grads) a pipeline rank may be "
        "given (default: no limit)",
        {"type": float},
    ),
)
