"""Identity-carrying asynchronous P2P for the dynamic runtime, over torch.distributed.

Wire format, per message, on one directed pair of ranks: a fixed header, then the payload.
  header: int64[9] = (kind 0=forward activation / 1=backward gradient, receiver's local
          chunk, microbatch, dtype code, ndim, shape padded to 4 dims)  (tag HEADER_TAG)
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
per step where each rank has a spare core (`Outbox`: gloo's isend writes in the calling
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
from megatronapp.pipeline.actions import Action

HEADER_TAG, PAYLOAD_TAG = 7101, 7102
# Messages per peer with receives posted, when the peer's spec is known: each holds a payload
# buffer outside the in-flight cap's count, so a few, not a step's worth.
RECV_AHEAD = 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER_LEN = 9


def check_sendable(tensor: torch.Tensor) -> None:
    """ValueError unless a header can describe `tensor`."""
    if tensor.dim() > 4 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dim()}-dim {tensor.dtype} tensor (at most 4 dims, "
                         f"dtypes {_DTYPES})")


def encode_header(task: Action, tensor: torch.Tensor) -> torch.Tensor:
    """The header announcing `tensor` as the input of `task` on the receiving rank."""
    check_sendable(tensor)
    shape = list(tensor.shape) + [0] * (4 - tensor.dim())
    return torch.tensor([int(task.kind is BACKWARD), task.chunk, task.microbatch, _DTYPES.index(tensor.dtype),
                         tensor.dim(), *shape], dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[Action, torch.Size, torch.dtype]:
    """(task, payload shape, payload dtype); ValueError on a malformed header."""
    kind, chunk, mb, dtype, ndim, *shape = (int(x) for x in header.tolist())
    if kind not in (0, 1) or not 0 <= dtype < len(_DTYPES) or not 0 <= ndim <= 4 or min(chunk, mb) < 0:
        raise ValueError(f"malformed dynamic-pipeline header {header.tolist()}")
    task = (backward_task if kind else forward_task)(chunk, mb)
    return task, torch.Size(shape[:ndim]), _DTYPES[dtype]


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

    def __init__(self, src: int, count: int, inbox: queue.SimpleQueue, device, before_wait=None,
                 spec: tuple[torch.Size, torch.dtype] | None = None, groups=(None, None), order=None):
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
                task, shape, dtype = decode_header(header)
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
            task, got_shape, got_dtype = decode_header(header)
            if (got_shape, got_dtype) != (shape, dtype):
                raise ValueError(f"rank {self.src} sent {tuple(got_shape)} {got_dtype} for {task}, but the model's "
                                 f"spec for its messages is {tuple(shape)} {dtype}")
            self._deliver(task, payload)

    def _post_header(self) -> tuple[torch.Tensor, object]:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        return header, dist.irecv(header, src=self.src, tag=HEADER_TAG, group=self.header_group)

    def _post_payload(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        return payload, dist.irecv(payload, src=self.src, tag=PAYLOAD_TAG, group=self.payload_group)

    def _deliver(self, task: Action, payload: tuple[torch.Tensor, object]) -> None:
        tensor, work = payload
        self.order.complete(work, self.before_wait, self.src)
        self.inbox.put((task, tensor, self.src))


class Outbox:
    """Asynchronous sends of one step, issued by a sender thread (or inline, `threaded=False`);
    `finish()` completes them (end of step), `close()` stops the thread on an error path.

    Why a thread: gloo's isend writes to the socket in the calling thread before it returns
    (its TCP pair sends what the socket takes at once). Measured on the 2-core VM for a PP2
    step of 128 KiB activations (BENCHMARKS.md, MegaDPP): 0.25 ms median (0.41-0.43
    mean) per message for the header and payload isends, ~10 ms a step, all of it on the
    compute thread between one task and the next. With the thread the compute thread only
    checks the tensor (so a bad one still fails at once) and queues it (~28 us); the thread
    builds the header and issues the isends in queue order, which keeps each pair's
    messages FIFO as the receivers need. It pays only with a spare core per rank
    (config.resolve_send_thread); without one, `threaded=False` issues them inline.
    """

    def __init__(self, threaded: bool = True, channels=None, rank: int = 0, order=None):
        self.pending: list = []  # (works, tensors kept alive until completion)
        self.error: BaseException | None = None
        self.channels, self.rank = channels, rank  # which groups carry what (channels.py); None: the default
        self.order = order or HostOrder()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._issue_queued, name="dpp-send", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    def send(self, dst: int, task: Action, tensor: torch.Tensor) -> None:
        if self.error is not None:
            raise RuntimeError(f"an earlier send failed: {self.error}") from self.error
        tensor = tensor.detach().contiguous()
        check_sendable(tensor)
        if self._thread is None:  # --dpp-send-thread off (or auto without a spare core): inline
            self._issue(dst, task, tensor)  # on the compute stream, right behind the producer
        else:
            self._queue.put((dst, task, tensor, self.order.mark()))

    def _issue(self, dst: int, task: Action, tensor: torch.Tensor, ready=None) -> None:
        header = encode_header(task, tensor)
        header_group, payload_group = route(self.channels, self.rank, dst)
        self.order.after_mark(ready)  # the payload's send waits for its producer (streams.py)
        works = [dist.isend(header, dst=dst, tag=HEADER_TAG, group=header_group),
                 dist.isend(tensor, dst=dst, tag=PAYLOAD_TAG, group=payload_group)]
        self.pending.append((works, header, tensor))

    def _issue_queued(self) -> None:
        try:
            with self.order.side_stream():
                while (item := self._queue.get()) is not None:
                    self._issue(*item)
        except BaseException as exc:  # surfaced by the next send() or finish()
            self.error = exc

    def close(self) -> None:
        """Stop the sender thread once it has issued what is queued."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def finish(self) -> None:
        self.close()
        if self.error is not None:
            raise RuntimeError(f"sending failed: {self.error}") from self.error
        for works, _, _ in self.pending:
            for w in works:
                w.wait()
        self.pending.clear()


def start_receivers(counts: dict[int, int], device, before_wait=None,
                    specs: dict[int, tuple[torch.Size, torch.dtype]] | None = None, channels=None,
                    rank: int = 0, order=None) -> tuple[queue.SimpleQueue, list]:
    """One PeerReceiver per global source rank with messages to receive this step; `specs`:
    the one spec of every message from a source, where there is one (see PeerReceiver);
    `channels`: which groups carry the messages to `rank` (channels.py; None: the default group)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    specs = specs or {}
    threads = [PeerReceiver(src, n, inbox, device, before_wait, specs.get(src), route(channels, src, rank), order)
               for src, n in counts.items() if n]
    for t in threads:
        t.start()
    return inbox, threads


