"""Zero-bubble schedules: (interleaved) 1F1B with each backward split into I and W, W in the bubbles.

Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024): a backward is I, the input gradient
the previous stage waits for, and W, the weight gradients nobody waits for until the optimizer
step (parallel/wgrad_defer.py runs them apart). Keeping 1F1B's order of forwards and I's but
placing each W where its rank would otherwise wait removes most of the bubble at the same
activation memory. ZB-H1 does this for 1F1B; `interleaved-zb` for Megatron's interleaved
1F1B with virtual stages (the idea of torch.distributed.pipelining's
ScheduleInterleavedZeroBubble, built here with the rule below).

The rule, one rank at a time in a unit-time simulation of all ranks (F, I and W one tick each,
communication free, as the paper's cost model F = B = W):
  1. the ranks run the base order's steps (a forward, an I, or interleaved 1F1B's (F, I)
     pair) in order, each when its inputs have been produced;
  2. memory: before a step's forward, while the rank's live activation sets (forwards whose
     W has not run) would exceed the base order's peak, the oldest pending W runs first:
     the schedule never holds more than its 1F1B counterpart;
  3. filling: while the next step must wait for an input at least one tick, the oldest
     pending W runs in the gap;
  4. the W's still pending after the last step run at the end, before the optimizer step.
The W's run before a step form one step with it (comm_placement.py posts the step's receives
before them, so they overlap the transfer they would otherwise wait for). The result is a
plain per-rank compute order; comm placement and the validator
(validate.py: W after its I, all W before the optimizer, deadlock simulation) treat it like
every other schedule, so correctness does not rest on the simulation, only the bubble does.

Where the gain shows: validate.py's unit-time timeline blocks a rank at each comm batch until
its partners post, so a W cannot overlap a wait there and its bubble for these schedules is no
smaller than 1F1B's. The MegaDPP simulator (dpp/sim) models the runtimes' waits: with every
receive posted ahead ("eager") interleaved-zb is 7% shorter than interleaved 1F1B on a
balanced PP8 V2 M16 step; under the static gloo runtime's lazy receives ("rendezvous") it is
not (0.99x), because a send moves only once its receiver reaches the batch of that receive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from megatronapp.pipeline.actions import Action, ActionKind, stage_location, virtual_stage
from megatronapp.pipeline.comm_placement import ComputeStep, compute_step_actions

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_I, _W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
TICKS = {_F: 1, _I: 1, _W: 1}


def _as_input_grad(step: ComputeStep) -> ComputeStep:
    """The step with every whole backward B turned into I."""
    swap = [Action(_I, a.chunk, a.microbatch) if a.kind is _B else a for a in compute_step_actions(step)]
    return tuple(swap) if isinstance(step, tuple) else swap[0]


def _producer(a: Action, rank: int, pp_size: int, num_chunks: int) -> tuple[int, Action] | None:
    """(rank, compute) whose output `a` consumes; None for the first forward (tokens are local)."""
    vs, last = virtual_stage(a.chunk, rank, pp_size), pp_size * num_chunks - 1
    if a.kind is _F:
        if vs == 0:
            return None
        r, c = stage_location(vs - 1, pp_size)
        return r, Action(_F, c, a.microbatch)
    if vs == last:  # the loss: its own forward
        return rank, Action(_F, a.chunk, a.microbatch)
    r, c = stage_location(vs + 1, pp_size)
    return r, Action(_I, c, a.microbatch)


def compute_peak_live(order: Sequence[ComputeStep]) -> int:
    """Peak activation sets (forwards whose backward, or W, has not run) along an order."""
    live = peak = 0
    for a in (a for step in order for a in compute_step_actions(step)):
        live += 1 if a.kind is _F else -1 if a.kind in (_B, _W) else 0
        peak = max(peak, live)
    return peak


class _RankFill:
    """One rank's progress through its base order in the unit-time simulation (module doc)."""

    def __init__(self, steps: list[ComputeStep], limit: int):
        self.steps, self.limit = steps, limit
        self.pos = self.clock = self.live = 0
        self.pending: deque[Action] = deque()  # W's whose I ran, oldest first
        self.out: list[ComputeStep] = []

    def run_oldest_w(self) -> Action:
        self.clock += TICKS[_W]
        self.live -= 1
        return self.pending.popleft()

    def run_step(self, step: ComputeStep, ready: list[int], finished: dict) -> None:
        forwards = sum(a.kind is _F for a in compute_step_actions(step))
        ws = []
        while self.pending and self.live + forwards > self.limit:  # rule 2
            ws.append(self.run_oldest_w())
        while self.pending and self.clock + TICKS[_W] <= ready[0]:  # rule 3
            ws.append(self.run_oldest_w())
        for a, at in zip(compute_step_actions(step), ready):
            self.clock = max(self.clock, at) + TICKS[a.kind]
            finished[a] = self.clock
            if a.kind is _F:
                self.live += 1
            else:
                self.pending.append(Action(_W, a.chunk, a.microbatch))
        # the W's lead the step: its receives are posted before them, so they overlap the transfer
        self.out.append(tuple(ws) + compute_step_actions(step) if ws else step)
        self.pos += 1


def compute_zero_bubble_orders(
    base_orders: Sequence[Sequence[ComputeStep]], pp_size: int, num_chunks: int
) -> list[list[ComputeStep]]:
    """Per-rank compute orders with I/W split and W placed by the module's rule, from a base
    F/B order per rank (e.g. 1F1B's). Raises ValueError if the base orders cannot run."""
    ranks = [_RankFill([_as_input_grad(s) for s in order], compute_peak_live(order)) for order in base_orders]
    finished: list[dict[Action, int]] = [{} for _ in ranks]
    progress = True
    while progress:
        progress = False
        for r, rank in enumerate(ranks):
            while rank.pos < len(rank.steps):
                step = rank.steps[rank.pos]
                ready, actions = [], compute_step_actions(step)
                for a in actions:
                    src = _producer(a, r, pp_size, num_chunks)
                    if src is not None and src[0] == r and src[1] in actions:
                        ready.append(0)  # produced earlier in the same step: run_step orders them
                    else:
                        ready.append(0 if src is None else finished[src[0]].get(src[1], -1))
                if min(ready) < 0:  # an input is not produced yet in the simulation
                    break
                rank.run_step(step, ready, finished[r])
                progress = True
    stuck = [r for r, rank in enumerate(ranks) if rank.pos < len(rank.steps)]
    if stuck:
        raise ValueError(f"base orders cannot run: pp ranks {stuck} wait for inputs never produced")
    for rank in ranks:
        while rank.pending:  # rule 4
            rank.out.append(rank.run_oldest_w())
    return [rank.out for rank in ranks]
