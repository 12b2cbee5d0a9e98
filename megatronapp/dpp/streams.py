"""What the dynamic runtime does differently on a GPU: streams, events and host pacing.

On CPU a tensor is ready when the call that made it returns (`HostOrder`: nothing to do). On
CUDA kernels run behind the host, and three things need care (`CudaOrder`):

* **A send waits for its producer, and only for it.** NCCL's send waits on the calling
  thread's current stream. By the time the sender thread issues it, the compute stream's tail
  already holds the next task's kernels, so the send would wait for them too. The compute thread
  records an event when it hands a tensor over (`mark`), and the sender issues the send on a
  side stream that waits on that event (`after_mark`).
* **A message has arrived when its payload is on this GPU**, not when its receive was
  posted. A receiver thread posts its receives on a side stream. It then blocks on an event
  recorded after the receive's work, with the GIL released and a blocking-sync event, so no
  core spins (`complete`). Only then does the compute thread see the task as ready. The
  compute stream then reads a buffer allocated on the receiver's stream, and `adopt` tells
  the caching allocator so (record_stream).
* **The host stays close to the GPU.** Left alone, the compute thread would enqueue task
  after task long before the GPU runs them, so "which ready task next" would be decided on
  stale readiness, which is the point of deciding at run time lost. `after_task` lets at most
  `ahead` tasks wait in the stream behind the one the GPU is running.
"""

from __future__ import annotations

import collections
import contextlib

import torch

from megatronapp.p2p.outbox import HostSendOrder

PACE_AHEAD = 1  # tasks enqueued beyond the running one: enough to keep the GPU fed between decisions


class HostOrder(HostSendOrder):
    """CPU: work is done when its call returns (sends: the outbox's own order); receives
    complete on wait()."""

    def complete(self, work, before_wait, src: int) -> None:
        if before_wait is not None:  # CPU link delays live in the Work itself (injection/link_delay.py)
            before_wait(src, work)
        work.wait()

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def after_task(self) -> None:
        pass


class CudaOrder:
    """CUDA: see the module docstring. One instance per rank; `side_stream` per thread."""

    def __init__(self, device: torch.device, ahead: int = PACE_AHEAD):
        self.device, self.ahead = device, ahead
        self._enqueued: collections.deque = collections.deque()

    @contextlib.contextmanager
    def side_stream(self):
        """This thread's current device and stream for the block (threads start on device 0)."""
        with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
            yield

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()  # on the compute thread's current stream, right after the producer
        return event

    def after_mark(self, mark: torch.cuda.Event | None) -> None:
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def complete(self, work, before_wait, src: int) -> None:
        work.wait()  # NCCL: the current (side) stream waits for the receive; the host does not
        if before_wait is not None:
            before_wait(src, work)  # a GPU link delay spins on this stream after the data (injection/inject.py)
        arrived = torch.cuda.Event(blocking=True)
        arrived.record()
        arrived.synchronize()  # releases the GIL; blocking sync: the thread sleeps

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor

    def after_task(self) -> None:
        done = torch.cuda.Event(blocking=True)
        done.record()
        self._enqueued.append(done)
        while len(self._enqueued) > self.ahead:
            self._enqueued.popleft().synchronize()


def build_order(device: torch.device) -> HostOrder | CudaOrder:
    return CudaOrder(device) if device.type == "cuda" else HostOrder()
