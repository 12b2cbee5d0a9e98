"""What `--dpp-rebalance` costs a job where nothing is slow: the planners' time per step.

With rebalancing on and no re-plan, the only added work on a rank is one `observe` per step of
each planner (dpp/rebalance_hook.py) on the per-rank compute seconds the engine gathers with every
step's metrics anyway (for the summary and online detection), so its cost is that call's time.
This times it on balanced measurements with ±5 % noise, for the R1 job's shape and larger ones,
and prints microseconds per step and the share of a given step time.

    python benchmarks/rebalance_overhead.py --step-ms 600
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from megatronapp.dpp.rebalance import LayerRebalancer, RebalanceConfig, StageModel
from megatronapp.dpp.rebalance_hook import compute_ranks_of_replica, compute_ranks_of_stage
from megatronapp.dpp.rebalance_microbatches import MicrobatchRebalancer, ReplicaModel
from megatronapp.parallel.layout import ParallelLayout

SHAPES = ((4, 1, 1, 16), (8, 8, 1, 64), (16, 32, 8, 128))  # (pp, dp, tp, layers)


def planners(pp: int, dp: int, tp: int, layers: int, config: RebalanceConfig) -> list:
    """The planners a PP x DP x TP job with rebalancing "all" builds, over the job's rank order."""
    lay = ParallelLayout(pp * dp * tp, tp_size=tp, pp_size=pp)
    model = StageModel(layers, pp, 1, head_layers=0.5, bytes_per_layer=2**20)
    out = [LayerRebalancer(config, model, (layers // pp,) * pp, compute_ranks_of_stage(lay))]
    if dp > 1:
        out.append(MicrobatchRebalancer(config, ReplicaModel(dp, 8 * dp, 1), compute_ranks_of_replica(lay)))
    return out


def time_observe(pp: int, dp: int, tp: int, layers: int, steps: int, seed: int) -> tuple[float, int]:
    """Median microseconds of one step's observe calls (every planner's) over `steps` steps, and
    the plans made (none is expected: nothing is slow)."""
    rng = random.Random(seed)
    ranks, every = pp * dp * tp, planners(pp, dp, tp, layers, RebalanceConfig(mode="all"))
    plans, times = 0, []
    for _ in range(steps):
        compute = tuple(0.5 * rng.uniform(0.95, 1.05) for _ in range(ranks))
        t0 = time.perf_counter_ns()
        plans += sum(planner.observe(compute, 0.6) is not None for planner in every)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times), plans


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=600.0, help="the step time the cost is a share of")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    for pp, dp, tp, layers in SHAPES:
        us, plans = time_observe(pp, dp, tp, layers, a.steps, a.seed)
        share = us / (a.step_ms * 1e3)
        print(
            f"PP{pp} DP{dp} TP{tp} ({pp * dp * tp} ranks, {layers} layers): {us:.1f} us/step, {share:.2e} of a {a.step_ms:g} ms step, {plans} plans"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
