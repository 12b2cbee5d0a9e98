"""How the static runtime moves one step's messages: receives posted ahead, or batched.

Both carry the same packed frames (p2p/message.py) with the same checked ids (direction,
virtual stage that consumes the message, microbatch), in the schedule's order per pair of
ranks, so they pair the same messages and give the same tensors; they differ in *when* a
receive is posted and how a send is issued.

* `AheadTransport` (gloo): every receive of the step is posted up to RECV_AHEAD messages ahead
  of its consumer (p2p/receives.py) instead of at the schedule's RECV action, so a message
  travels while the receiver computes, and a compute waits only for its own message, not for
  the sends of its batch; sends are single `isend`s through an `Outbox` (p2p/outbox.py),
  issued by a sender thread where each rank has a spare core (gloo's isend writes the payload
  in the calling thread once the receive is posted), and completed at the end of the step.
* `BatchedTransport`: each maximal run of the schedule's communication actions is one
  `batch_isend_irecv`, posted where the schedule has it. NCCL needs it: NCCL runs one pair's
  point-to-point work in posting order on one stream, so a receive posted ahead on the shared
  communicator would sit in front of a later send its peer waits for (dpp/channels.py explains
  the deadlock); grouping each batch's sends and receives is how NCCL pairs them.

Which one runs (`resolve_recv_ahead`): the batched one unless asked (--pipeline-recv-ahead).
Measured on a 2-core machine, PP2 with 2 virtual stages, 2 ranks (BENCHMARKS.md, MegaDPP):
ahead 1.07x and 1.08x [1.02, 1.27] the batched transport's speed, within 4 % of the dynamic
runtime (which posts ahead too); where other jobs overload the cores it can lose (0.69x in
one such run: gloo's socket threads then move an early message while both ranks compute and
take that time from them, where a lazy receive moves it while its receiver sits idle). It is
not the default yet because MegaScan's slow-link attribution reads the batched timing: on a
traced PP2 x DP2 run with a delayed link it names the reverse link under this transport.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronapp.p2p.message import empty_message, pack_message, unpack_expected
from megatronapp.p2p.outbox import Outbox, Send
from megatronapp.p2p.receives import PostedReceives
from megatronapp.pipeline.actions import Action, ActionKind, virtual_stage

SEND_KINDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)


def resolve_recv_ahead(setting: bool, device_type: str) -> bool:
    """Whether the static runtime posts receives ahead: `setting`; ValueError off the CPU (NCCL
    needs the batches)."""
    if setting and device_type != "cpu":
        raise ValueError("receives posted ahead need gloo (the CPU): NCCL needs the schedule's batches")
    return setting


def compute_message_ids(a: Action, pp_rank: int, pp_size: int) -> tuple[int, int, int]:
    """(direction, virtual stage that consumes it, microbatch) of the message a comm action
    sends or receives: sender and receiver compute the same ids."""
    vs = virtual_stage(a.chunk, pp_rank, pp_size)
    if a.kind in (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD):
        return 0, vs + (a.kind is ActionKind.SEND_FORWARD), a.microbatch
    return 1, vs - (a.kind is ActionKind.SEND_BACKWARD), a.microbatch


def action_key(a: Action) -> tuple:
    return a.kind, a.chunk, a.microbatch


class _StepTransport:
    """One step's messages for one rank; `to_send` maps a send's key to the tensor the
    compute left for it; `receive(key)` returns a checked received tensor; `peak_posted`: the
    most receives posted and not yet consumed."""

    def __init__(self, runtime, microbatches: list, to_send: dict):
        self.runtime, self.microbatches, self.to_send = runtime, microbatches, to_send
        self.pp_rank, self.pp_size = runtime.groups.pp_rank, runtime.schedule.pp_size

    def peer(self, a: Action) -> int:
        return self.runtime.groups.pp_ranks[a.peer]

    def ids(self, a: Action) -> tuple[int, int, int]:
        return compute_message_ids(a, self.pp_rank, self.pp_size)

    def packed_send(self, a: Action) -> torch.Tensor:
        return pack_message(self.to_send.pop(action_key(a)), self.ids(a))

    def empty_receive(self, a: Action) -> tuple[torch.Tensor, tuple]:
        """A buffer for the message of RECV action `a` and (shape, dtype, ids) it must carry."""
        model, mb = self.runtime.model, self.microbatches[a.microbatch]
        spec = model.input_spec(a.chunk, mb) if a.kind is ActionKind.RECV_FORWARD else model.output_spec(a.chunk, mb)
        buf = empty_message(spec.shape, spec.dtype, self.runtime.device)
        return buf, (spec.shape, spec.dtype, self.ids(a))

    def unpack(self, key, buf: torch.Tensor, src: int, expected: tuple) -> torch.Tensor:
        shape, dtype, ids = expected
        what = "activation" if key[0] is ActionKind.RECV_FORWARD else "gradient"
        return unpack_expected(buf, shape, dtype, ids, what, src)


class AheadTransport(_StepTransport):
    """Receives posted ahead, sends through an outbox (see the module docstring)."""

    def __init__(self, runtime, microbatches: list, to_send: dict, send_thread: bool = False):
        super().__init__(runtime, microbatches, to_send)
        recvs = [a for a in runtime.actions if a.kind.is_comm and a.kind not in SEND_KINDS]
        self.recv_actions = {action_key(a): a for a in recvs}
        self.receives = PostedReceives([action_key(a) for a in recvs], self._post_receive)
        self.outbox = Outbox(threaded=send_thread)
        self.receives.start()

    def _post_receive(self, key) -> tuple:
        a = self.recv_actions[key]
        buf, expected = self.empty_receive(a)
        return buf, dist.irecv(buf, src=self.peer(a)), self.peer(a), expected

    def post_batch(self, batch: tuple[Action, ...]) -> None:
        for a in batch:
            if a.kind in SEND_KINDS:
                self.outbox.post([Send(self.packed_send(a), self.peer(a))])
            else:
                self.receives.ensure_posted(action_key(a))

    @property
    def peak_posted(self) -> int:
        return self.receives.peak_posted

    def receive(self, key) -> torch.Tensor:
        buf, work, src, expected = self.receives.take(key)
        self.runtime.injector.before_recv_wait(src, work)
        work.wait()
        return self.unpack(key, buf, src, expected)

    def finish(self) -> None:
        self.outbox.drain()
        if self.receives.pending:
            raise RuntimeError("pipeline step ended with receives not consumed: schedule and runtime disagree")

    def close(self) -> None:
        self.outbox.close()
        self.receives.close()


class _PostedBatch:
    """Works of one batch_isend_irecv. NCCL may return one work for the whole group, so a recv
    waits for its whole batch; gloo must not be waited twice, hence the flag."""

    def __init__(self, works):
        self.works, self.done = works, False

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True


class BatchedTransport(_StepTransport):
    """Each run of the schedule's comm actions as one batch_isend_irecv (see the module docstring)."""

    def __init__(self, runtime, microbatches: list, to_send: dict):
        super().__init__(runtime, microbatches, to_send)
        self.recvs: dict = {}  # key -> (buffer, batch, src, op index, expected frame)
        self.batches: list = []  # every posted batch, completed at step end
        self.peak_posted = 0  # most receives posted and not yet consumed

    def post_batch(self, batch: tuple[Action, ...]) -> None:
        ops, recv_keys = [], []
        for a in batch:
            if a.kind in SEND_KINDS:
                ops.append(dist.P2POp(dist.isend, self.packed_send(a), self.peer(a)))
            else:
                buf, expected = self.empty_receive(a)
                recv_keys.append((action_key(a), buf, self.peer(a), len(ops), expected))
                ops.append(dist.P2POp(dist.irecv, buf, self.peer(a)))
        posted = _PostedBatch(dist.batch_isend_irecv(ops))
        for key, buf, peer, index, expected in recv_keys:
            self.recvs[key] = (buf, posted, peer, index, expected)
        self.batches.append(posted)
        self.peak_posted = max(self.peak_posted, len(self.recvs))

    def receive(self, key) -> torch.Tensor:
        buf, batch, src, index, expected = self.recvs.pop(key)
        # gloo returns one work per op, NCCL may return one for the whole group
        work = batch.works[index] if index < len(batch.works) else batch.works[-1]
        self.runtime.injector.before_recv_wait(src, work)
        batch.wait()
        return self.unpack(key, buf, src, expected)

    def finish(self) -> None:
        for batch in self.batches:
            batch.wait()
        if self.recvs:
            raise RuntimeError("pipeline step ended with receives not consumed: schedule and runtime disagree")

    def close(self) -> None:
        pass
