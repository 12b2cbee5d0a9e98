"""Traversal policies: which ready task a rank runs next.

A traversal is a priority order over the rank's 2*V*M tasks; the policy runs the ready
task that comes first in it. So when every input arrives in time the rank runs exactly
the static schedule of that traversal, and when one is late the rank runs the next task
it can instead of idling (list scheduling). Orders:
  * depth-first: Megatron's interleaved 1F1B order (1F1B for V = 1): microbatches in
    groups of P go through every chunk before the next group starts, one backward after
    each forward in the steady state; few activations in flight;
  * breadth-first: looped BFS, every microbatch through chunk 0, then chunk 1, ..., then
    the backwards from the last chunk down. More independent work is queued, so late
    inputs are hidden better, at the price of memory (the in-flight cap bounds it: a
    forward over the cap is not ready, so the next backward in the order runs);
  * adaptive: depth-first while the rank keeps up; breadth-first while it recently waited
    for inputs more than `starve_enter` of its time, until that drops below `starve_exit`
    (hysteresis keeps it from flapping every task), and never within one slot of the cap.
  * in-order: the depth-first order, never left: the rank waits for the order's next task
    even when others are ready (it returns None). This is interleaved 1F1B with every
    receive posted ahead and sends that never block, the best the simulator found at the
    same cap (dpp_sim_study.py, BENCHMARKS.md: reordering on a missing input costs ~1.5%,
    the late task is usually on the critical path). Its deadlock freedom is the static
    order's, not scheduler.py's: see InOrderPolicy.
A policy is a pure function of the ready set and what the rank observed (`RankView`), so a
decision can be replayed from a trace. For every policy that picks some ready task whenever
one exists, deadlock freedom does not depend on it (scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatronapp.pipeline.actions import Action
from megatronapp.pipeline.comm_placement import compute_step_actions
from megatronapp.pipeline.schedules import (
    compute_1f1b_order,
    compute_breadth_first_order,
    compute_interleaved_steps,
)

TRAVERSALS = ("depth-first", "breadth-first", "adaptive", "in-order")


@dataclass(frozen=True)
class RankView:
    """What a rank knows when it decides (beyond the ready set)."""

    in_flight: int  # activation sets this rank holds
    cap: int  # the most it may hold
    wait_fraction: float  # recent share of time spent waiting for inputs (EWMA, 0..1)
    started: frozenset | set = frozenset()  # tasks of this step already started (read only)


def compute_depth_first_order(pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int) -> list[Action]:
    """Interleaved 1F1B's compute order for any M (M is padded to a multiple of P, extras dropped)."""
    if num_chunks == 1:
        return compute_1f1b_order(pp_size, pp_rank, num_microbatches)
    padded = -(-num_microbatches // pp_size) * pp_size
    steps = compute_interleaved_steps(pp_size, pp_rank, num_chunks, padded)
    return [a for s in steps for a in compute_step_actions(s) if a.microbatch < num_microbatches]


class _OrderPolicy:
    def __init__(self, name: str, order: list[Action]):
        self.name = name
        self.priority = {task: i for i, task in enumerate(order)}

    def pick(self, ready: Sequence[Action]) -> Action:
        return min(ready, key=self.priority.__getitem__)

    def choose(self, ready: Sequence[Action], view: RankView) -> tuple[Action, str]:
        return self.pick(ready), self.name


class AdaptivePolicy:
    """Depth-first by default, breadth-first while starved (module docstring)."""

    name = "adaptive"

    def __init__(
        self, depth: _OrderPolicy, breadth: _OrderPolicy, starve_enter: float = 0.2, starve_exit: float = 0.05
    ):
        self.depth, self.breadth = depth, breadth
        self.starve_enter, self.starve_exit = starve_enter, starve_exit
        self.starved = False

    def choose(self, ready: Sequence[Action], view: RankView) -> tuple[Action, str]:
        if self.starved and view.wait_fraction < self.starve_exit:
            self.starved = False
        elif not self.starved and view.wait_fraction > self.starve_enter:
            self.starved = True
        if self.starved and view.in_flight + 1 < view.cap:
            return self.breadth.pick(ready), self.breadth.name
        return self.depth.pick(ready), self.depth.name


class InOrderPolicy:
    """Runs `order` exactly; None (wait) while its next task is not ready.

    Deadlock freedom: every rank runs its depth-first order, i.e. Megatron's interleaved 1F1B
    (1F1B for V = 1), whose schedule validate.py proves deadlock-free even when a send blocks
    until its recv is posted; here sends never block and receives are posted ahead, so each
    task waits only for its own input and the rank's previous task, which can only make
    every task start earlier. For M not a multiple of P the order is the padded one with the
    extra microbatches dropped on every rank; they depend only on themselves, so dropping
    them everywhere keeps every remaining start time feasible. The in-flight cap must let the
    order through (scheduler.check_order_fits), which is checked before the step starts.
    """

    name = "in-order"

    def __init__(self, order: list[Action]):
        self.order = order

    def choose(self, ready: Sequence[Action], view: RankView) -> tuple[Action | None, str]:
        nxt = next(t for t in self.order if t not in view.started)
        return (nxt if nxt in ready else None), self.name


def build_policy(traversal: str, pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int):
    """A policy with `.name` and `.choose(ready, view) -> (task, name of the order that picked it)`."""
    if traversal not in TRAVERSALS:
        raise ValueError(f"unknown traversal {traversal!r}; choose one of {', '.join(TRAVERSALS)}")
    depth = _OrderPolicy("depth-first", compute_depth_first_order(pp_rank, pp_size, num_chunks, num_microbatches))
    breadth = _OrderPolicy("breadth-first", compute_breadth_first_order(num_chunks, num_microbatches))
    if traversal == "adaptive":
        return AdaptivePolicy(depth, breadth)
    if traversal == "in-order":
        return InOrderPolicy(list(depth.priority))
    return depth if traversal == "depth-first" else breadth
