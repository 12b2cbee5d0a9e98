"""A clairvoyant order search: the best per-rank task orders a local search finds for ONE seed.

It knows the seed's every jitter draw (it re-simulates each candidate with them), so what it
finds is an achieved schedule no real policy could run; it only shows how much room there is
between the achieved policies and the lower bound (dpp/sim/bounds.py). Not a bound itself: a
search that stops can miss better orders.

Candidates are fixed per-rank compute orders run with every receive posted ahead (the
simulator's "eager" static agent: a rank waits only for its order's next input), starting
from interleaved 1F1B's order; a move takes one task of one rank and reinserts it up to
`window` places away; an order whose peak in-flight activation sets exceed the rank's cap is
refused, one that deadlocks is refused, one no slower than the current is kept.
"""

from __future__ import annotations

import random

from megatronapp.dpp.policies import compute_depth_first_order
from megatronapp.dpp.scheduler import compute_peak_inflight
from megatronapp.dpp.sim.simulator import CostModel, simulate_agents
from megatronapp.dpp.sim.static_agents import EagerStaticAgent


class _Orders:
    """The part of PipelineSchedule that EagerStaticAgent reads."""

    def __init__(self, orders: list[list], num_chunks: int):
        self.orders, self.pp_size, self.num_chunks = orders, len(orders), num_chunks

    def for_rank(self, pp_rank: int) -> list:
        return self.orders[pp_rank]


def simulate_orders(orders: list[list], cost: CostModel, num_chunks: int) -> float | None:
    """Step time of per-rank compute `orders` (eager comm), or None if they deadlock."""
    schedule = _Orders(orders, num_chunks)
    try:
        return simulate_agents([EagerStaticAgent(p, schedule) for p in range(len(orders))], cost).makespan_s
    except RuntimeError:  # an order that waits for an input its own rank must produce later
        return None


def search_orders(cost: CostModel, pp: int, vpp: int, m: int, caps: list[int], moves: int,
                  seed: int = 0, window: int = 6) -> tuple[float, float]:
    """(interleaved order's step time, best step time found within `moves` candidate moves)."""
    rng = random.Random(seed)
    orders = [compute_depth_first_order(p, pp, vpp, m) for p in range(pp)]
    start = best = simulate_orders(orders, cost, vpp)
    for _ in range(moves):
        p = rng.randrange(pp)
        i = rng.randrange(len(orders[p]))
        j = min(len(orders[p]) - 1, max(0, i + rng.randint(-window, window)))
        if i == j:
            continue
        trial = list(orders[p])
        trial.insert(j, trial.pop(i))
        if compute_peak_inflight(trial) > caps[p]:
            continue
        candidate = orders[:p] + [trial] + orders[p + 1:]
        t = simulate_orders(candidate, cost, vpp)
        if t is not None and t <= best:
            orders, best = candidate, t
    return start, best
