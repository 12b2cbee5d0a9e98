"""The training loop's side of rebalancing: feed the planners, move, and say so.

Called on every rank with every step's metrics (the same numbers everywhere), it moves layers
through engine/repartition.py when the layer planner (dpp/rebalance.py) says so, or gives the
data-parallel replicas another microbatch split (Trainer.set_replica_microbatches) when the
microbatch planner (dpp/rebalance_microbatches.py) does, and reports each move as a line for the
progress display, a marker on the MegaScan timeline and a `rebalance` entry in that step's
metrics row. At most one move per step; after any move both planners measure afresh.
"""

from __future__ import annotations

import time

from megatronapp.dpp.rebalance import LayerRebalancer, RebalanceConfig, StageModel
from megatronapp.dpp.rebalance_microbatches import MicrobatchRebalancer, ReplicaModel
from megatronapp.engine.repartition import repartition
from megatronapp.engine.replica_split import compute_microbatch_granule
from megatronapp.parallel.partition import compute_stage_layers


def build_layer_rebalancer(config: RebalanceConfig, job) -> LayerRebalancer | None:
    lay = job.layout
    if config.mode not in ("layers", "all") or lay.pp_size < 2:
        return None
    stage_layers = lay.stage_layers or compute_stage_layers(job.model.num_layers, lay.pp_size, lay.virtual_pp_size)
    return LayerRebalancer(config, StageModel.of(job), stage_layers, compute_ranks_of_stage(lay))


def build_microbatch_rebalancer(config: RebalanceConfig, job) -> MicrobatchRebalancer | None:
    lay = job.layout
    if config.mode not in ("microbatches", "all") or lay.dp_size < 2:
        return None
    model = ReplicaModel(lay.dp_size, job.num_microbatches, compute_microbatch_granule(job.train.schedule, lay.pp_size))
    return MicrobatchRebalancer(config, model, compute_ranks_of_replica(lay))


def compute_ranks_of_stage(lay) -> list[list[int]]:
    """Global ranks of each pipeline rank (its TP and DP members): a stage runs at its slowest."""
    return [[lay.rank_of(t, d, p) for d in range(lay.dp_size) for t in range(lay.tp_size)] for p in range(lay.pp_size)]


def compute_ranks_of_replica(lay) -> list[list[int]]:
    """Global ranks of each DP replica (its TP and PP members): a replica runs at its slowest."""
    return [[lay.rank_of(t, d, p) for p in range(lay.pp_size) for t in range(lay.tp_size)] for d in range(lay.dp_size)]


def build_rebalance_hook(config: RebalanceConfig, job, trainer) -> RebalanceHook | None:
    """The hook for `--dpp-rebalance` (None when it is off)."""
    layers, microbatches = build_layer_rebalancer(config, job), build_microbatch_rebalancer(config, job)
    if layers is None and microbatches is None:
        return None
    return RebalanceHook(layers, trainer, microbatches)


class RebalanceHook:
    """on_step(metrics dict) for the training loop: may move layers, or microbatches between the
    data-parallel replicas, between this step and the next."""

    def __init__(self, rebalancer: LayerRebalancer | None, trainer, microbatches: MicrobatchRebalancer | None = None):
        self.rebalancer, self.trainer, self.microbatches = rebalancer, trainer, microbatches
        lay = trainer.job.layout
        self._dp_of_rank = [lay.coords(r).dp for r in range(lay.world_size)]

    def after_step(self, metrics: dict) -> str | None:
        """Feed one step's metrics; when work moved, the line that says what moved and why."""
        compute, step_s = tuple(metrics["rank_compute_s"]), metrics["step_time_s"]
        layer_plan = self.rebalancer.observe(self._per_balanced_replica(compute), step_s) if self.rebalancer else None
        split_plan = self.microbatches.observe(compute, step_s) if self.microbatches else None
        if layer_plan is not None:
            return self._move_layers(layer_plan, metrics)
        if split_plan is not None:
            return self._move_microbatches(split_plan, metrics)
        return None

    def _per_balanced_replica(self, compute: tuple[float, ...]) -> tuple[float, ...]:
        """Each rank's compute seconds as if its replica ran the balanced count: the layer planner
        compares stages, not the replicas' shares of the batch."""
        split = self.trainer.replica_microbatches
        if split is None:
            return compute
        m = self.trainer.job.num_microbatches
        return tuple(c * m / split[self._dp_of_rank[r]] for r, c in enumerate(compute))

    def _move_layers(self, plan, metrics: dict) -> str:
        before = self.rebalancer.stage_layers
        seconds = repartition(self.trainer, plan.stage_layers)
        self.rebalancer.moved(plan, seconds)
        if self.microbatches is not None:
            self.microbatches.restart()
        self._record(metrics, "layers", before, plan.stage_layers, plan, seconds)
        return (
            f"iteration {metrics['iteration']}: layers moved {','.join(map(str, before))} -> "
            f"{','.join(map(str, plan.stage_layers))} ({plan.reason}; predicted {100 * plan.gain:.0f}% faster; "
            f"the move took {seconds:.2f} s)"
        )

    def _move_microbatches(self, plan, metrics: dict) -> str:
        before, after = self.microbatches.split, plan.replica_microbatches
        start = time.perf_counter()
        self.trainer.set_replica_microbatches(None if after == self.microbatches.model.balanced else after)
        seconds = time.perf_counter() - start
        self.microbatches.moved(plan, seconds)
        if self.rebalancer is not None:
            self.rebalancer.restart()
        self._record(metrics, "microbatches", before, after, plan, seconds)
        return (
            f"iteration {metrics['iteration']}: microbatches per data-parallel replica "
            f"{','.join(map(str, before))} -> {','.join(map(str, after))} ({plan.reason}; "
            f"predicted {100 * plan.gain:.0f}% faster)"
        )

    def _record(self, metrics: dict, what: str, before, after, plan, seconds: float) -> None:
        entry = {
            "moved": what,
            "from": list(before),
            "to": list(after),
            "reason": plan.reason,
            "predicted_gain": round(plan.gain, 4),
            "move_s": round(seconds, 4),
        }
        metrics["rebalance"] = entry
        self.trainer.tracer.mark_iteration(metrics["iteration"], "rebalance", **entry)
