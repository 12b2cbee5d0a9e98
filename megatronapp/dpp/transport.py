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
CPU/gloo only: NCCL's recv wait() does not block the host, so this thread design does not
apply there (the runtime refuses a CUDA device).
"""

from __future__ import annotations

import collections
import queue
import threading

import torch
import torch.distributed as dist

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


class PeerReceiver(threading.Thread):
    """Receives `count` messages from global rank `src` and puts (task, tensor, src) on `inbox`.

    `spec` (shape, dtype): every message from `src` has it, so receives are posted ahead
    (see the module docstring); None: header first, then a payload sized by it.
    An exception is put on the inbox too, so the compute thread re-raises it instead of
    waiting forever. `before_wait(src, work)` is the fault injector's link-delay hook.
    """

    def __init__(self, src: int, count: int, inbox: queue.SimpleQueue, device, before_wait=None,
                 spec: tuple[torch.Size, torch.dtype] | None = None):
        super().__init__(name=f"dpp-recv-{src}", daemon=True)
        self.src, self.count, self.inbox, self.device = src, count, inbox, device
        self.before_wait, self.spec = before_wait, spec

    def run(self) -> None:
        try:
            if self.spec is None:
                for _ in range(self.count):
                    header, header_work = self._post_header()
                    header_work.wait()
                    task, shape, dtype = decode_header(header)
                    self._deliver(task, self._post_payload(shape, dtype))
            else:
                self._run_ahead(*self.spec)
        except BaseException as exc:  # surfaced on the compute thread
            self.inbox.put((None, exc, self.src))

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
        return header, dist.irecv(header, src=self.src, tag=HEADER_TAG)

    def _post_payload(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        return payload, dist.irecv(payload, src=self.src, tag=PAYLOAD_TAG)

    def _deliver(self, task: Action, payload: tuple[torch.Tensor, object]) -> None:
        tensor, work = payload
        if self.before_wait is not None:
            self.before_wait(self.src, work)
        work.wait()
        self.inbox.put((task, tensor, self.src))


class Outbox:
    """Asynchronous sends of one step, issued by a sender thread (or inline, `threaded=False`);
    `finish()` completes them (end of step), `close()` stops the thread on an error path.

    Why a thread: gloo's isend writes to the socket in the calling thread before it returns
    (its TCP pair sends what the socket takes at once). Measured on the 2-core VM for a PP2
    step of 128 KiB activations (benchmarks/dpp_send_cost.py): 0.25 ms median (0.41-0.43
    mean) per message for the header and payload isends, ~10 ms a step, all of it on the
    compute thread between one task and the next. With the thread the compute thread only
    checks the tensor (so a bad one still fails at once) and queues it (~28 us); the thread
    builds the header and issues the isends in queue order, which keeps each pair's
    messages FIFO as the receivers need. It pays only with a spare core per rank
    (config.resolve_send_thread); without one, `threaded=False` issues them inline.
    """

    def __init__(self, threaded: bool = True):
        self.pending: list = []  # (works, tensors kept alive until completion)
        self.error: BaseException | None = None
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
            self._issue(dst, task, tensor)
        else:
            self._queue.put((dst, task, tensor))

    def _issue(self, dst: int, task: Action, tensor: torch.Tensor) -> None:
        header = encode_header(task, tensor)
        works = [dist.isend(header, dst=dst, tag=HEADER_TAG), dist.isend(tensor, dst=dst, tag=PAYLOAD_TAG)]
        self.pending.append((works, header, tensor))

    def _issue_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._issue(*item)
            except BaseException as exc:  # surfaced by the next send() or finish()
                self.error = exc
                return

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
                    specs: dict[int, tuple[torch.Size, torch.dtype]] | None = None) -> tuple[queue.SimpleQueue, list]:
    """One PeerReceiver per global source rank with messages to receive this step; `specs`:
    the one spec of every message from a source, where there is one (see PeerReceiver)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    specs = specs or {}
    threads = [PeerReceiver(src, n, inbox, device, before_wait, specs.get(src)) for src, n in counts.items() if n]
    for t in threads:
        t.start()
    return inbox, threads


