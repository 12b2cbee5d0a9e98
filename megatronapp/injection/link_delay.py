"""A slow link on CPU: messages arrive late, senders are not held up.

`install_link_delays(plan, rank)` wraps torch.distributed's receive functions (irecv, recv,
batch_isend_irecv) on the *receiving* rank. A recv Work from a delayed source is replaced by a
`LateArrivalWork`: one daemon thread per delayed link waits for the real Works in posting
order (messages on one link complete in order) and notes when each one's data really arrived;
the program's `wait()` then returns at arrival + delay, or at once if that moment has passed
(the receiver was busy elsewhere, as it would have been on a slow link too). The send side is
untouched, so a sender's send completes exactly as it would.

Install it before any tracing instrumentation: a tracer that wraps these functions afterwards
sees the late completion inside its recv span, just as for a real slow link. That is why this
is a layer of its own (distributed_patch.py) rather than part of MegaScan's wrappers (scan/record/instrument.py): the
tracer must measure a delayed link exactly as it measures a real one, untraced runs need the
delay too, and the recorder must not know which faults are injected.
"""

from __future__ import annotations

import functools
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatronapp.distributed_patch import DistributedPatch
from megatronapp.injection.inject import FaultPlan, LinkDelay

_WRAPPED = ("irecv", "recv", "batch_isend_irecv")


class LateArrivalWork:
    """A recv Work whose data counts as arrived `delay_s` after it really did."""

    __slots__ = ("_work", "_delay_s", "_arrived", "_arrival", "_error")

    def __init__(self, work: Any, delay_s: float) -> None:
        self._work, self._delay_s = work, delay_s
        self._arrived = threading.Event()
        self._arrival, self._error = 0.0, None

    def watch(self) -> None:
        """Runs on the link's thread: wait for the real transfer, note when it finished."""
        try:
            self._work.wait()
        except BaseException as exc:  # handed to the program's wait()
            self._error = exc
        self._arrival = time.monotonic()
        self._arrived.set()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._arrived.wait()
        if self._error is not None:
            raise self._error
        remaining = self._arrival + self._delay_s - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return True

    def is_completed(self) -> bool:
        return self._arrived.is_set() and time.monotonic() >= self._arrival + self._delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Link:
    """One delayed link on the receiver: its delay draws and its watcher thread."""

    def __init__(self, src: int, dst: int, delay: LinkDelay) -> None:
        self.delay = delay
        self._rng = random.Random(f"link-{src}-{dst}")  # reproducible jitter per link
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name=f"link-delay-{src}-{dst}", daemon=True).start()

    def draw_s(self) -> float:
        jitter = self._rng.uniform(-self.delay.jitter_ms, self.delay.jitter_ms) if self.delay.jitter_ms else 0.0
        return max(0.0, self.delay.ms + jitter) / 1000.0

    def late(self, work: Any) -> LateArrivalWork:
        late = LateArrivalWork(work, self.draw_s())
        self._queue.put(late)
        return late

    def _run(self) -> None:
        while True:
            self._queue.get().watch()


class LinkDelays(DistributedPatch):
    """The installed wrappers of one rank; `uninstall()` restores torch.distributed."""

    def __init__(self, plan: FaultPlan, rank: int) -> None:
        super().__init__()
        self.links = {src: _Link(src, dst, d) for (src, dst), d in plan.link_delays.items() if dst == rank}

    def _src(self, group: Any, src: Any, group_src: Any) -> int | None:
        if src is None and group_src is not None:
            return dist.get_global_rank(group if group is not None else c10d._get_default_group(), group_src)
        return src

    def wrap_irecv(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            work = self.call(original, tensor, src, group, tag, group_src=group_src)
            link = None if self.inside() else self.links.get(self._src(group, src, group_src))
            return link.late(work) if link is not None and work is not None else work

        return irecv

    def wrap_recv(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def recv(tensor, src=None, group=None, tag=0, group_src=None):
            sender = self.call(original, tensor, src, group, tag, group_src=group_src)
            link = None if self.inside() else self.links.get(sender)
            if link is not None:  # blocking recv: the data is here now; it "arrives" later
                time.sleep(link.draw_s())
            return sender

        return recv

    def wrap_batch(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def batch_isend_irecv(p2p_op_list):
            works = self.call(original, p2p_op_list)
            if self.inside():
                return works
            links = [
                self.links.get(op.peer) if getattr(op.op, "__name__", "") == "irecv" else None for op in p2p_op_list
            ]
            if len(works) == len(p2p_op_list):  # one Work per op (gloo)
                return [w if link is None else link.late(w) for w, link in zip(works, links)]
            slow = [link for link in links if link is not None]  # coalesced: the batch waits for the slowest
            return [slow[0].late(w) for w in works] if slow else works

        return batch_isend_irecv

    def install(self) -> LinkDelays:
        wrappers = {"irecv": self.wrap_irecv, "recv": self.wrap_recv, "batch_isend_irecv": self.wrap_batch}
        self.patch({name: wrappers[name](getattr(c10d, name)) for name in _WRAPPED})
        return self


def install_link_delays(plan: FaultPlan, rank: int) -> LinkDelays | None:
    """Delay arrivals on `rank` for every planned link into it; None (nothing touched) if none."""
    if not any(dst == rank for _, dst in plan.link_delays):
        return None
    return LinkDelays(plan, rank).install()
