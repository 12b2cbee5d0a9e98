"""The training loop's side of layer rebalancing: feed the planner, move, and say so.

Called on every rank with every step's metrics (the same numbers everywhere), it moves layers
through engine/repartition.py when the planner (dpp/rebalance.py) says so, and reports each move
as a line for the progress display, a marker on the MegaScan timeline and a `rebalance` entry in that step's
metrics row.
"""

from __future__ import annotations

from megatronapp.dpp.rebalance import LayerRebalancer, RebalanceConfig, StageModel
from megatronapp.engine.repartition import repartition
from megatronapp.parallel.partition import compute_stage_layers


def build_layer_rebalancer(config: RebalanceConfig, job) -> LayerRebalancer | None:
    lay = job.layout
    if config.mode == "off" or lay.pp_size < 2:
        return None
    stage_layers = lay.stage_layers or compute_stage_layers(job.model.num_layers, lay.pp_size, lay.virtual_pp_size)
    ranks_of_stage = [
        [lay.rank_of(t, d, p) for d in range(lay.dp_size) for t in range(lay.tp_size)] for p in range(lay.pp_size)
    ]
    return LayerRebalancer(config, StageModel.of(job), stage_layers, ranks_of_stage)


class RebalanceHook:
    """on_step(metrics dict) for the training loop: may move layers between this step and the next."""

    def __init__(self, rebalancer: LayerRebalancer, trainer):
        self.rebalancer, self.trainer = rebalancer, trainer

    def after_step(self, metrics: dict) -> str | None:
        """Feed one step's metrics; when layers moved, the line that says what moved and why."""
        plan = self.rebalancer.observe(tuple(metrics["rank_compute_s"]), metrics["step_time_s"])
        if plan is None:
            return None
        before = self.rebalancer.stage_layers
        seconds = repartition(self.trainer, plan.stage_layers)
        self.rebalancer.moved(plan, seconds)
        entry = {
            "from": list(before),
            "to": list(plan.stage_layers),
            "reason": plan.reason,
            "predicted_gain": round(plan.gain, 4),
            "move_s": round(seconds, 4),
        }
        metrics["rebalance"] = entry
        self.trainer.tracer.mark_iteration(metrics["iteration"], "rebalance", **entry)
        return (
            f"iteration {metrics['iteration']}: layers moved {','.join(map(str, before))} -> "
            f"{','.join(map(str, plan.stage_layers))} ({plan.reason}; predicted {100 * plan.gain:.0f}% faster; "
            f"the move took {seconds:.2f} s)"
        )
