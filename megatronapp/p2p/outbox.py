"""Asynchronous sends in flight: issued in post order, completed oldest first.

Each `post` is one entry: the sends of one message (MegaDPP: header then payload) or of one
microbatch to several peers (MegaFBD). Tensors are kept alive until their sends complete.

Options, each for a reason of its own:
* `window`: at most that many entries outstanding; a post first waits for the oldest beyond
  it (inside `waiting()`, so the wait can be traced): MegaFBD's run-ahead bound.
* `threaded`: a sender thread issues the entries, in post order (which keeps each pair's
  messages FIFO); the caller only queues them. gloo's isend writes to the socket in the calling
  thread before it returns: measured on a 2-core VM for a PP2 step of 128 KiB activations,
  0.25 ms per message for header and payload isends, ~10 ms a step on the compute thread; with
  the thread, ~28 us to queue. It pays only where each rank has a spare core.
* `order`: how a send waits for its producer on a GPU (dpp/streams.py: `mark()` on the posting
  thread, `after_mark()` before the isends, the thread inside `side_stream()`); default: none.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist


class Send(NamedTuple):
    tensor: torch.Tensor
    dst: int  # global rank
    tag: int = 0
    group: object = None  # None: the default group


def sends_to(tensor: torch.Tensor, peers) -> list[Send]:
    """The same tensor to each of `peers` on the default group."""
    return [Send(tensor, p) for p in peers]


def spare_core_per_rank(cores: int, local_ranks: int, threads_per_rank: int) -> bool:
    """Whether a sender thread per rank has a core of its own: cores >= local ranks x (compute
    threads + 1). Where it has none, the thread competes with the computing ranks for a core."""
    return cores >= local_ranks * (threads_per_rank + 1)


def host_has_spare_core_per_rank(world_size: int, threads_per_rank: int) -> bool:
    """spare_core_per_rank for this host: the cores this process may use, the ranks torchrun
    started on this host (LOCAL_WORLD_SIZE; else all `world_size` ranks on one host)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return spare_core_per_rank(cores, local_ranks, threads_per_rank)


class HostSendOrder:
    """No ordering to do: on the host a tensor is ready when the call that made it returns."""

    def side_stream(self):
        return contextlib.nullcontext()

    def mark(self):
        return None

    def after_mark(self, mark) -> None:
        pass


class Outbox:
    """Sends in flight (see the module docstring); `drain()` completes them and re-raises a
    sender thread's failure; `close()` stops the thread, e.g. on an error path."""

    def __init__(self, window: int | None = None, threaded: bool = False, order=None):
        if window is not None and (window < 1 or threaded):
            raise ValueError(f"an outbox window must be >= 1 and inline (not threaded), got {window}")
        self.window, self.order = window, order or HostSendOrder()
        self.error: BaseException | None = None
        self._inflight: deque = deque()  # [(sends, works)]: a send's tensor must outlive its work
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._issue_queued, name="p2p-send", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    def post(self, sends: list[Send], waiting=contextlib.nullcontext) -> None:
        if self.error is not None:
            raise RuntimeError(f"an earlier send failed: {self.error}") from self.error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("this outbox was closed: it takes no more sends")
        sends = [s._replace(tensor=s.tensor.detach().contiguous()) for s in sends]
        if self.window is not None and len(self._inflight) >= self.window:
            with waiting():
                self._wait_oldest()
        if self._thread is None:
            self._issue(sends)  # on the compute stream, right behind the producer
        else:
            self._queue.put((sends, self.order.mark()))

    def _issue(self, sends: list[Send], ready=None) -> None:
        self.order.after_mark(ready)  # a GPU send waits for its producer only (streams.py)
        self._inflight.append((sends, [dist.isend(s.tensor, dst=s.dst, tag=s.tag, group=s.group) for s in sends]))

    def _issue_queued(self) -> None:
        try:
            with self.order.side_stream():
                while (item := self._queue.get()) is not None:
                    self._issue(*item)
        except BaseException as exc:  # surfaced by the next post() or drain()
            self.error = exc

    def _wait_oldest(self) -> None:
        for work in self._inflight.popleft()[1]:
            work.wait()

    def close(self) -> None:
        """Stop the sender thread once it has issued what is queued (it takes no posts after)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def drain(self) -> None:
        """Complete every send posted; a threaded outbox is closed first."""
        self.close()
        if self.error is not None:
            raise RuntimeError(f"sending failed: {self.error}") from self.error
        while self._inflight:
            self._wait_oldest()
