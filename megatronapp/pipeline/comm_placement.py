"""Where the sends and recvs of a pipeline schedule go, given each rank's compute order.

A rank's compute order is a list of *steps*; a step is one compute action or a tuple of
compute actions that run back to back with no communication between them. Placement rule
(semantics of batches and FIFO matching: see actions.py):
  1. a send goes into the batch right after the step that produces it;
  2. a recv goes into the batch right before the step that consumes it (lazy: the receive
     buffer lives as short as possible), except that messages on one directed pair are
     matched in FIFO order, so if the step needs message X from rank A while earlier
     messages from A (in A's send order) are still unreceived, their recvs are posted first;
  3. as a safety net for arbitrary orders, the placement is simulated under the rendezvous
     model of validate.py (a send blocks until its recv is posted); whenever every rank is
     stuck, the recv of a blocked send is hoisted into the batch its receiver is stuck at.
     That only makes the receiver post earlier, so it always unblocks the sender; the
     schedules built in schedules.py never need it.
With one-compute steps, the middle rank of 1F1B comes out as Megatron's
F(j) [SF(j) RB(i)] B(i) [SB(i) RF(j+1)] F(j+1). With (F, B) steps, interleaved 1F1B comes out
as Megatron-Core's F(k) B(i) [SF(k) SB(i) RF(k+1) RB(i+1)]: lazy recvs with one-compute
steps would deadlock there (A blocks sending X to B while B blocks on a send to A whose
recv A posts only after X) and, where rule 3 breaks the cycle, leave large bubbles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatronapp.pipeline.actions import Action, ActionKind, stage_location, virtual_stage


@dataclass(frozen=True)
class _Op:
    """A comm action plus its place in the FIFO stream of its directed pair."""

    action: Action
    src: int
    dst: int
    seq: int  # k: the k-th message from src to dst

    @property
    def is_send(self) -> bool:
        return self.action.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)


# A step of a compute order: one compute action, or several run back to back without comm.
ComputeStep = Action | tuple[Action, ...]


def compute_step_actions(step: ComputeStep) -> tuple[Action, ...]:
    """The compute actions of one step, in order."""
    return step if isinstance(step, tuple) else (step,)


# A segment is a compute Action or a comm batch (list of _Op, possibly emptied by hoisting).
_Segment = Action | list[_Op]


def compute_outgoing_recv(action: Action, pp_rank: int, pp_size: int, num_chunks: int) -> tuple[int, Action] | None:
    """(peer rank, the RECV action it posts) for what this compute produces, or None if it stays local."""
    if action.kind is ActionKind.BACKWARD_WEIGHT:  # W only writes this rank's main grads
        return None
    vstage = virtual_stage(action.chunk, pp_rank, pp_size)
    forward = action.kind is ActionKind.FORWARD
    target = vstage + 1 if forward else vstage - 1
    if pp_size == 1 or not 0 <= target < num_chunks * pp_size:
        return None
    peer, peer_chunk = stage_location(target, pp_size)
    kind = ActionKind.RECV_FORWARD if forward else ActionKind.RECV_BACKWARD
    return peer, Action(kind, peer_chunk, action.microbatch, peer=pp_rank)


def compute_incoming_recv(action: Action, pp_rank: int, pp_size: int, num_chunks: int) -> Action | None:
    """The RECV action this compute consumes on its own rank, or None if its input is local."""
    if action.kind is ActionKind.BACKWARD_WEIGHT:  # W's operands were kept by its I
        return None
    vstage = virtual_stage(action.chunk, pp_rank, pp_size)
    forward = action.kind is ActionKind.FORWARD
    source = vstage - 1 if forward else vstage + 1
    if pp_size == 1 or not 0 <= source < num_chunks * pp_size:
        return None
    kind = ActionKind.RECV_FORWARD if forward else ActionKind.RECV_BACKWARD
    return Action(kind, action.chunk, action.microbatch, peer=stage_location(source, pp_size)[0])


def _fifo_streams(
    pp_size: int, num_chunks: int, compute_orders: Sequence[Sequence[ComputeStep]]
) -> dict[tuple[int, int], list[Action]]:
    """Per directed pair (src, dst): the recv actions dst must post, in src's send order."""
    streams: dict[tuple[int, int], list[Action]] = {}
    for rank, order in enumerate(compute_orders):
        for a in (a for step in order for a in compute_step_actions(step)):
            out = compute_outgoing_recv(a, rank, pp_size, num_chunks)
            if out is not None:
                streams.setdefault((rank, out[0]), []).append(out[1])
    return streams


def _batch_at_end(segments: list[_Segment]) -> list[_Op]:
    if not segments or not isinstance(segments[-1], list):
        segments.append([])
    return segments[-1]


def _send_op(a: Action, rank: int, pp_size: int, num_chunks: int, sent: dict[int, int]) -> _Op | None:
    out = compute_outgoing_recv(a, rank, pp_size, num_chunks)
    if out is None:
        return None
    dst = out[0]
    kind = ActionKind.SEND_FORWARD if a.kind is ActionKind.FORWARD else ActionKind.SEND_BACKWARD
    sent[dst] = sent.get(dst, 0) + 1
    return _Op(Action(kind, a.chunk, a.microbatch, peer=dst), rank, dst, sent[dst] - 1)


def _lazy_segments(
    rank: int, steps: Sequence[ComputeStep], pp_size: int, num_chunks: int, streams: dict[tuple[int, int], list[Action]]
) -> list[_Segment]:
    """Rules 1 and 2 for one rank."""
    position = {(src, recv): k for (src, dst), msgs in streams.items() if dst == rank for k, recv in enumerate(msgs)}
    received = {src: 0 for (src, dst) in streams if dst == rank}
    sent: dict[int, int] = {}
    segments: list[_Segment] = []
    for i, step in enumerate(steps):
        for a in compute_step_actions(step):
            needed = compute_incoming_recv(a, rank, pp_size, num_chunks)
            if needed is None:
                continue
            k = position.get((needed.peer, needed))
            if k is None:
                raise ValueError(
                    f"pp rank {rank}, step {i} {a}: needs {needed} but rank {needed.peer} never computes its producer"
                )
            while received[needed.peer] <= k:  # FIFO: earlier messages from this peer first
                seq = received[needed.peer]
                _batch_at_end(segments).append(_Op(streams[(needed.peer, rank)][seq], needed.peer, rank, seq))
                received[needed.peer] += 1
        segments.extend(compute_step_actions(step))
        for a in compute_step_actions(step):
            op = _send_op(a, rank, pp_size, num_chunks, sent)
            if op is not None:
                _batch_at_end(segments).append(op)
    for src, count in received.items():
        if count < len(streams[(src, rank)]):
            raise ValueError(
                f"pp rank {rank}: rank {src} sends {streams[(src, rank)][count]} "
                f"but pp rank {rank} never computes its consumer"
            )
    return segments


class _RendezvousPlanner:
    """Runs the rendezvous model over mutable segments and hoists recvs out of deadlocks (rule 3)."""

    def __init__(self, segments: list[list[_Segment]]):
        self.segments = segments
        self.pos = [0] * len(segments)
        # Segment index of each op, by (src, dst) pair and FIFO sequence number.
        self.send_seg: dict[tuple[int, int], dict[int, int]] = {}
        self.recv_seg: dict[tuple[int, int], dict[int, int]] = {}
        for rank_segments in segments:
            for s, seg in enumerate(rank_segments):
                for op in seg if isinstance(seg, list) else ():
                    table = self.send_seg if op.is_send else self.recv_seg
                    table.setdefault((op.src, op.dst), {})[op.seq] = s

    def _partner_posted(self, op: _Op) -> bool:
        if op.is_send:
            return self.recv_seg[(op.src, op.dst)][op.seq] <= self.pos[op.dst]
        return self.send_seg[(op.src, op.dst)][op.seq] <= self.pos[op.src]

    def _advance_all(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank, rank_segments in enumerate(self.segments):
                while self.pos[rank] < len(rank_segments):
                    seg = rank_segments[self.pos[rank]]
                    if isinstance(seg, list) and not all(self._partner_posted(op) for op in seg):
                        break
                    self.pos[rank] += 1
                    progress = True

    def _hoist_one_recv(self) -> bool:
        """Move the recv of one blocked send into the batch its receiver is stuck at."""
        for rank, rank_segments in enumerate(self.segments):
            if self.pos[rank] == len(rank_segments):
                continue
            for op in rank_segments[self.pos[rank]]:
                if op.is_send and not self._partner_posted(op):
                    old = self.recv_seg[(op.src, op.dst)][op.seq]
                    recv = next(r for r in self.segments[op.dst][old] if r.seq == op.seq and r.src == op.src)
                    self.segments[op.dst][old].remove(recv)
                    self.segments[op.dst][self.pos[op.dst]].append(recv)
                    self.recv_seg[(op.src, op.dst)][op.seq] = self.pos[op.dst]
                    return True
        return False

    def settle(self) -> list[list[_Segment]]:
        """Hoist until the whole schedule runs; ValueError if the compute orders themselves cycle."""
        self._advance_all()
        while any(p < len(s) for p, s in zip(self.pos, self.segments)):
            if not self._hoist_one_recv():
                stuck = [
                    f"rank {r} at segment {p}" for r, (p, s) in enumerate(zip(self.pos, self.segments)) if p < len(s)
                ]
                raise ValueError(f"compute orders have a dependency cycle; stuck: {', '.join(stuck)}")
            self._advance_all()
        return self.segments


def _flatten(segments: list[_Segment]) -> tuple[Action, ...]:
    actions: list[Action] = []
    for seg in segments:
        if isinstance(seg, list):
            actions.extend(op.action for op in seg)
        else:
            actions.append(seg)
    return tuple(actions)


def place_communication(
    pp_size: int, num_chunks: int, compute_orders: Sequence[Sequence[ComputeStep]]
) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action lists: the compute orders (lists of steps) with sends/recvs placed by rules 1-3.

    Raises ValueError if a needed input is never produced, a produced message is never
    consumed, or the compute orders are cyclic (no placement could run them).
    """
    if pp_size == 1:  # every virtual stage is local: no communication at all
        return (tuple(a for step in compute_orders[0] for a in compute_step_actions(step)),)
    streams = _fifo_streams(pp_size, num_chunks, compute_orders)
    segments = [_lazy_segments(rank, order, pp_size, num_chunks, streams) for rank, order in enumerate(compute_orders)]
    return tuple(_flatten(rank_segments) for rank_segments in _RendezvousPlanner(segments).settle())
