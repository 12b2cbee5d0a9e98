"""The task matrix of one pipeline rank and the data dependencies between tasks.

A task is a compute `Action` (pipeline/actions.py): FORWARD or BACKWARD of (local chunk,
microbatch). With P pipeline ranks and V chunks per rank there are S = P*V virtual stages;
local chunk c of rank p is virtual stage c*P + p. Dependencies:
  * F(s, m) needs the output activation of F(s-1, m) (nothing for s = 0: tokens are local);
  * B(s, m) needs the gradient from B(s+1, m); for s = S-1 it needs only its own F(s, m),
    whose output is the loss.
So every task has exactly one input, produced by one task on one rank (possibly this one),
and `compute_consumer` names where each task's output goes.
"""

from __future__ import annotations

from megatronapp.pipeline.actions import Action, ActionKind, stage_location, virtual_stage

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
# split backward: a BACKWARD task runs as I (input gradient) and leaves this local task behind
WEIGHT_GRAD = ActionKind.BACKWARD_WEIGHT


def forward_task(chunk: int, microbatch: int) -> Action:
    return Action(FORWARD, chunk, microbatch)


def backward_task(chunk: int, microbatch: int) -> Action:
    return Action(BACKWARD, chunk, microbatch)


def weight_task(chunk: int, microbatch: int) -> Action:
    return Action(WEIGHT_GRAD, chunk, microbatch)


def compute_rank_tasks(num_chunks: int, num_microbatches: int) -> list[Action]:
    """Every task of one rank for one optimizer step (2 * V * M of them)."""
    return [
        Action(kind, c, m) for kind in (FORWARD, BACKWARD) for c in range(num_chunks) for m in range(num_microbatches)
    ]


def compute_consumer(task: Action, pp_rank: int, pp_size: int, num_chunks: int) -> tuple[int, Action] | None:
    """(pp rank, task) consuming `task`'s output, or None (the backward of virtual stage 0).

    The forward of the last virtual stage feeds its own backward (the loss stays local).
    """
    vs, last = virtual_stage(task.chunk, pp_rank, pp_size), pp_size * num_chunks - 1
    if task.kind is FORWARD:
        if vs == last:
            return pp_rank, backward_task(task.chunk, task.microbatch)
        rank, chunk = stage_location(vs + 1, pp_size)
        return rank, forward_task(chunk, task.microbatch)
    if vs == 0:
        return None
    rank, chunk = stage_location(vs - 1, pp_size)
    return rank, backward_task(chunk, task.microbatch)


def compute_producer_rank(task: Action, pp_rank: int, pp_size: int, num_chunks: int) -> int | None:
    """Pipeline rank producing `task`'s input, or None for F of virtual stage 0 (tokens)."""
    vs, last = virtual_stage(task.chunk, pp_rank, pp_size), pp_size * num_chunks - 1
    if task.kind is FORWARD:
        return None if vs == 0 else stage_location(vs - 1, pp_size)[0]
    return pp_rank if vs == last else stage_location(vs + 1, pp_size)[0]


def remote_inputs(pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int) -> list[tuple[Action, int]]:
    """(task, producing peer rank) for each task of this rank whose input comes from another rank."""
    found = []
    for task in compute_rank_tasks(num_chunks, num_microbatches):
        src = compute_producer_rank(task, pp_rank, pp_size, num_chunks)
        if src is not None and src != pp_rank:
            found.append((task, src))
    return found
