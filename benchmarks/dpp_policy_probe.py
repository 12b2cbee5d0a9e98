"""Probe: can a fill rule on top of the in-order traversal beat it at the same in-flight cap?

In-order (interleaved's order, receives posted ahead) is the best dynamic traversal in the
simulator (dpp_sim_study.py); it idles while its order's next task waits for input. Two
principled fills of that idle time, both deadlock-free for the in-order reason
(policies.InOrderPolicy: the order's next task still runs as soon as it is ready) and both
within the order's own peak (a backward frees a set, never takes one):
  * early-backward W: run a ready backward among the order's next W tasks (critical path:
    a backward feeds the upstream stage, which is otherwise idle);
  * bottleneck: the same, only while the rank's recent wait fraction is below a threshold
    (it is the slow stage, whose idle time is the iteration's).
Printed: speed vs the static runtime (interleaved/rendezvous), mean over seeds, and how many
tasks the fill ran over all seeds (so an unchanged speed is not an unused rule).

    python benchmarks/dpp_policy_probe.py --seeds 10
"""

from __future__ import annotations

import argparse
import statistics
import sys

from megatronapp.dpp.policies import InOrderPolicy, compute_depth_first_order
from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_sim
from megatronapp.dpp.scheduler import RankScheduler, compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, simulate, simulate_agents
from megatronapp.dpp.tasks import BACKWARD
from megatronapp.pipeline.schedules import build_schedule


class EarlyBackwardFill(InOrderPolicy):
    """In-order, plus a ready backward within the next `window` tasks while the next one waits
    (only while wait fraction < `max_wait`: 1.0 = always)."""

    def __init__(self, order, window: int, max_wait: float = 1.0):
        super().__init__(order)
        self.window, self.max_wait = window, max_wait

    def choose(self, ready, view):
        upcoming = [t for t in self.order if t not in view.started][: self.window + 1]
        if upcoming[0] in ready or view.wait_fraction >= self.max_wait:
            return super().choose(ready, view)
        fill = next((t for t in upcoming[1:] if t.kind is BACKWARD and t in ready), None)
        return (fill, "early-backward") if fill is not None else (None, self.name)


POLICIES = {"in-order": lambda o: InOrderPolicy(o), "early-backward 2": lambda o: EarlyBackwardFill(o, 2),
            "early-backward all": lambda o: EarlyBackwardFill(o, 10**6),
            "bottleneck 0.05": lambda o: EarlyBackwardFill(o, 10**6, 0.05),
            "bottleneck 0.15": lambda o: EarlyBackwardFill(o, 10**6, 0.15)}


def mean_makespan(pp, v, m, scen, seeds, make_policy=None) -> tuple[float, int]:
    """(mean seconds per step, tasks run as fills) over `seeds` seeds of scenario `scen`."""
    caps, out, fills = compute_default_caps(pp, v, m), [], 0
    for seed in range(seeds):
        cost = CostModel.uniform(pp, v, 10e-3, 20e-3, p2p_latency_s=0.5e-3, **compute_scenario_sim(scen, pp, seed))
        if make_policy is None:
            res = simulate(pp, v, m, cost, schedule=build_schedule("interleaved", pp, v, m), static_comm="rendezvous")
        else:
            orders = [compute_depth_first_order(p, pp, v, m) for p in range(pp)]
            res = simulate_agents([RankScheduler(p, pp, v, m, caps[p], make_policy(orders[p])) for p in range(pp)], cost)
        out.append(res.makespan_s)
        fills += sum(s.decision.policy == "early-backward" for s in res.spans if s.decision is not None)
    return statistics.fmean(out), fills


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    a = p.parse_args(argv)
    for pp, m in ((4, 8), (8, 16)):
        for scen in SCENARIOS:
            ref, cells = mean_makespan(pp, 2, m, scen, a.seeds)[0], []
            for name, make in POLICIES.items():
                t, fills = mean_makespan(pp, 2, m, scen, a.seeds, make)
                cells.append(f"{name} x{ref / t:.3f} ({fills} fills)")
            print(f"PP{pp} V2 M{m} {scen:<9} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
