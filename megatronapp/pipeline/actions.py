"""The vocabulary of pipeline schedules: a schedule is, for each pipeline rank, a list of actions.

Model chunks and virtual stages (Megatron's interleaving rule): with P pipeline ranks and V
chunks per rank, local chunk `c` on pipeline rank `p` is virtual stage `c * P + p`. Virtual
stage 0 holds the embedding, virtual stage V*P-1 the output head and loss. Forward
activations flow from virtual stage s to s+1; gradients from s+1 back to s.

Communication semantics (what the runtime does, and what the validator simulates):
  * A maximal run of consecutive communication actions in a rank's list is one *batch*,
    posted together (torch.distributed.batch_isend_irecv on NCCL).
  * Messages between a directed pair of ranks are matched in FIFO order: the k-th send
    from A to B pairs with the k-th recv on B from A, and both must name the same message.
  * A FORWARD(c, m) on a non-first virtual stage consumes the RECV_FORWARD(c, m) posted
    earlier on that rank; a BACKWARD(c, m) (or BACKWARD_INPUT(c, m)) on a non-last virtual
    stage consumes RECV_BACKWARD(c, m). BACKWARD_WEIGHT neither receives nor sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ActionKind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    # split backward (parallel/wgrad_defer.py), torch.distributed.pipelining's letters: I is
    # the input gradient (what the previous stage waits for, sent like B's), W the deferred
    # weight gradients of the same (chunk, microbatch), local, any time after its I and
    # before the step's optimizer update
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_FORWARD = "SF"  # send output activation of (chunk, mb) to the next virtual stage
    RECV_FORWARD = "RF"  # receive input activation of (chunk, mb) from the previous virtual stage
    SEND_BACKWARD = "SB"  # send grad w.r.t. the input of (chunk, mb) to the previous virtual stage (B or I)
    RECV_BACKWARD = "RB"  # receive grad w.r.t. the output of (chunk, mb) from the next virtual stage

    @property
    def is_comm(self) -> bool:
        return self not in _COMPUTE_KINDS

    @property
    def is_backward(self) -> bool:
        """B or I: the compute that consumes the output gradient and produces the input gradient."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


_COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    chunk: int  # local model chunk index on this rank
    microbatch: int
    peer: int | None = None  # pipeline rank of the other side, for communication actions

    def __str__(self) -> str:
        peer = (
            f"->{self.peer}"
            if self.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
            else (f"<-{self.peer}" if self.peer is not None else "")
        )
        return f"{self.kind.value}(c{self.chunk},m{self.microbatch}){peer}"


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-pipeline-rank action lists for one optimizer step."""

    pp_size: int
    num_chunks: int  # model chunks per pipeline rank (virtual pipeline size)
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # indexed by pipeline rank
    name: str = "custom"

    def for_rank(self, pp_rank: int) -> tuple[Action, ...]:
        return self.actions[pp_rank]


def virtual_stage(chunk: int, pp_rank: int, pp_size: int) -> int:
    return chunk * pp_size + pp_rank


def stage_location(vstage: int, pp_size: int) -> tuple[int, int]:
    """(pp_rank, chunk) holding a virtual stage."""
    return vstage % pp_size, vstage // pp_size


def comm_batches(actions: tuple[Action, ...] | list[Action]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the maximal runs of communication actions."""
    runs, start = [], None
    for i, a in enumerate(actions):
        if a.kind.is_comm and start is None:
            start = i
        elif not a.kind.is_comm and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(actions)))
    return runs
