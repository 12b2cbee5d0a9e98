"""Identity-carrying asynchronous P2P for the dynamic runtime, over torch.distributed.

Wire format, per message, on one directed pair of ranks: the framed message of p2p/message.py
in its two-message layout, with ids (kind 0=forward activation / 1=backward gradient,
receiver's local chunk, microbatch):
  header: int64[HEADER_LEN] (dtype, shape, ids)                          (tag HEADER_TAG)
  payload: the tensor, shape and dtype from the header                   (tag PAYLOAD_TAG)
So a receiver never assumes the sender's order: the header names the task it feeds.

When every message a receiver can get from a peer has the same spec (shape and dtype, from the
model's input_spec / output_spec: a GPT's stages all exchange (B, S, H)), it posts header and
payload receives together and keeps `RECV_AHEAD` messages posted. Otherwise it must read a
header before it can size the payload. The difference shows on a slow link: a payload receive
posted only after its header arrived pays the link's latency a second time, and one message
at a time travels the link instead of several.

Why a receiver thread per peer: gloo cannot poll a P2P work (is_completed() stays False
until wait(), and a second wait() hangs), so one thread cannot both compute and notice an
arrival. Each `PeerReceiver` thread always has a recv from its peer posted and
blocks in wait() (which releases the GIL), then hands (task, tensor) to the compute thread
through a queue; the compute thread drains the queue without blocking whenever it decides,
and blocks on it only when no task is ready. Sends are `isend`s, issued by one sender thread
per step where each rank has a spare core (p2p.outbox.Outbox: gloo's isend writes in the calling
thread), and completed at the end of the step, so they never wait on a receiver. Per pair, messages stay FIFO (gloo and
NCCL both keep order per pair and tag), which is all the header/payload pairing needs.
On CUDA the same threads run with NCCL payloads: channels.py says which group carries what
(a two-rank group per direction for payloads, gloo for headers), and streams.py how a thread
learns that a payload is on the GPU (an event it blocks on) and how a send waits for its
producer only (an event on a side stream).
"""

from __future__ import annotations

import collections
import queue
import threading

import torch
import torch.distributed as dist

from megatronapp.dpp.streams import HostOrder
from megatronapp.dpp.tasks import BACKWARD, backward_task, forward_task
from megatronapp.p2p.message import HEADER_LEN, decode_header, encode_header
from megatronapp.p2p.outbox import Outbox, Send
from megatronapp.pipeline.actions import Action

HEADER_TAG, PAYLOAD_TAG = 7101, 7102
# Messages per peer with receives posted, when the peer's spec is known: each holds a payload
# buffer outside the in-flight cap's count, so a few, not a step's worth.
RECV_AHEAD = 4


def task_ids(task: Action) -> tuple[int, int, int]:
    """The ids of a message that feeds `task` on the receiving rank: (kind, chunk, microbatch)."""
    return int(task.kind is BACKWARD), task.chunk, task.microbatch


def decode_task_header(header: torch.Tensor) -> tuple[Action, torch.Size, torch.dtype]:
    """(task, payload shape, payload dtype); ValueError on a malformed header."""
    decoded = decode_header(header)
    if len(decoded.ids) != 3 or decoded.ids[0] not in (0, 1):
        raise ValueError(f"malformed dynamic-pipeline header {header.tolist()}")
    kind, chunk, mb = decoded.ids
    return (backward_task if kind else forward_task)(chunk, mb), decoded.shape, decoded.dtype


def route(channels, src: int, dst: int) -> tuple:
    """(header group, payload group) of messages src -> dst; None: the default group."""
    if channels is None:
        return None, None
    return channels.header_group, channels.payload_group(src, dst)


class PeerReceiver(threading.Thread):
    """Receives `count` messages from global rank `src` and puts (task, tensor, src) on `inbox`.

    `spec` (shape, dtype): every message from `src` has it, so receives are posted ahead
    (see the module docstring); None: header first, then a payload sized by it.
    An exception is put on the inbox too, so the compute thread re-raises it instead of
    waiting forever. `before_wait(src, work)` is the fault injector's link-delay hook.
    `groups`: (header group, payload group) of messages from `src` (None: the default group;
    channels.py); `order`: how a receive is known complete (streams.py).
    """

    def __init__(
        self,
        src: int,
        count: int,
        inbox: queue.SimpleQueue,
        device,
        before_wait=None,
        spec: tuple[torch.Size, torch.dtype] | None = None,
        groups=(None, None),
        order=None,
    ):
        super().__init__(name=f"dpp-recv-{src}", daemon=True)
        self.src, self.count, self.inbox, self.device = src, count, inbox, device
        self.before_wait, self.spec = before_wait, spec
        self.header_group, self.payload_group = groups
        self.order = order or HostOrder()

    def run(self) -> None:
        try:
            with self.order.side_stream():
                self._receive_all()
        except BaseException as exc:  # surfaced on the compute thread
            self.inbox.put((None, exc, self.src))

    def _receive_all(self) -> None:
        if self.spec is None:
            for _ in range(self.count):
                header, header_work = self._post_header()
                header_work.wait()
                task, shape, dtype = decode_task_header(header)
                self._deliver(task, self._post_payload(shape, dtype))
        else:
            self._run_ahead(*self.spec)

    def _run_ahead(self, shape: torch.Size, dtype: torch.dtype) -> None:
        posted: collections.deque = collections.deque()
        for _ in range(min(RECV_AHEAD, self.count)):
            posted.append((self._post_header(), self._post_payload(shape, dtype)))
        for k in range(self.count):
            (header, header_work), payload = posted.popleft()
            if k + RECV_AHEAD < self.count:  # keep RECV_AHEAD posted while this one completes
                posted.append((self._post_header(), self._post_payload(shape, dtype)))
            header_work.wait()
            task, got_shape, got_dtype = decode_task_header(header)
            if (got_shape, got_dtype) != (shape, dtype):
                raise ValueError(
                    f"rank {self.src} sent {tuple(got_shape)} {got_dtype} for {task}, but the model's "
                    f"spec for its messages is {tuple(shape)} {dtype}"
                )
            self._deliver(task, payload)

    def _post_header(self) -> tuple[torch.Tensor, object]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        return header, dist.irecv(header, src=self.src, tag=HEADER_TAG, group=self.header_group)

    def _post_payload(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        return payload, dist.irecv(payload, src=self.src, tag=PAYLOAD_TAG, group=self.payload_group)

    def _deliver(self, task: Action, payload: tuple[torch.Tensor, object]) -> None:
        tensor, work = payload
        self.order.complete(work, self.before_wait, self.src)
        self.inbox.put((task, tensor, self.src))


def send_task_message(
    outbox: Outbox, dst: int, task: Action, tensor: torch.Tensor, channels=None, rank: int = 0
) -> None:
    """Post `tensor` as the input of `task` on global rank `dst`: its header on the header group,
    the payload on the group of its direction (channels.py; None: the default group). A tensor
    no header can describe fails here, on the compute thread, before anything is queued."""
    tensor = tensor.detach().contiguous()
    header = encode_header(tensor, task_ids(task))
    header_group, payload_group = route(channels, rank, dst)
    outbox.post([Send(header, dst, HEADER_TAG, header_group), Send(tensor, dst, PAYLOAD_TAG, payload_group)])


def start_receivers(
    counts: dict[int, int],
    device,
    before_wait=None,
    specs: dict[int, tuple[torch.Size, torch.dtype]] | None = None,
    channels=None,
    rank: int = 0,
    order=None,
) -> tuple[queue.SimpleQueue, list]:
    """One PeerReceiver per global source rank with messages to receive this step; `specs`:
    the one spec of every message from a source, where there is one (see PeerReceiver);
    `channels`: which groups carry the messages to `rank` (channels.py; None: the default group)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    specs = specs or {}
    threads = [
        PeerReceiver(src, n, inbox, device, before_wait, specs.get(src), route(channels, src, rank), order)
        for src, n in counts.items()
        if n
    ]
    for t in threads:
        t.start()
    return inbox, threads
