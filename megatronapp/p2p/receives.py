"""Receives posted ahead, for a rank that knows in which order its messages will come.

A static pipeline schedule names every message a rank receives in a step, in order. Posting
a receive only when the schedule's RECV action comes (right before its consumer) puts the
whole transfer on the critical path: a gloo send moves no data until the receiver has posted
its receive (the receiver announces the buffer, then the sender's socket thread writes it),
so every message pays a round trip between two busy processes at the moment it is needed.

`PostedReceives` keeps up to `ahead` receives posted beyond those consumed, in the schedule's
order, so each message travels while the receiver computes:

* `start()` posts the first `ahead`;
* `ensure_posted(key)` posts every receive up to `key` now, whatever the window (the schedule
  placed its RECV there; posting at least that early keeps the schedule's deadlock freedom,
  which pipeline/validate.py checks assuming a send blocks until its receive is posted);
* `take(key)` waits for `key`'s message and posts the next receive, so the window stays full.

Receives from one peer are posted in the schedule's order, which is the order that peer
sends in (FIFO matching per pair, pipeline/actions.py), so posting them earlier changes no
pairing. What a receive is and how it is posted is the caller's `post(key)`, which returns
what `take(key)` hands back (a buffer and its work); this class only keeps the order and the window.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

RECV_AHEAD = 4  # messages posted beyond those consumed: each holds one receive buffer


class PostedReceives:
    """One step's receives, posted ahead in `order` (see the module docstring)."""

    def __init__(self, order: Sequence[Hashable], post: Callable, ahead: int = RECV_AHEAD):
        if ahead < 1:
            raise ValueError(f"receives posted ahead must be >= 1, got {ahead}")
        self.order, self.post, self.ahead = list(order), post, ahead
        self.position = {key: i for i, key in enumerate(self.order)}
        if len(self.position) != len(self.order):
            raise ValueError("every receive of a step must have its own key")
        self.posted: dict = {}  # key -> what post(key) returned: posted, not yet taken
        self.next = 0  # index in `order` of the next receive to post
        self.peak_posted = 0

    def start(self) -> None:
        self._fill()

    def ensure_posted(self, key) -> None:
        """Post every receive up to and including `key` (already posted ones stay)."""
        last = self.position[key]
        while self.next <= last:
            self._post_next()

    def take(self, key):
        """What `post(key)` returned, posting it first if needed; the window is refilled."""
        self.ensure_posted(key)
        posted = self.posted.pop(key)
        self._fill()
        return posted

    def close(self) -> None:
        """Post nothing more; drops `post`, whose owner (a bound method's object) would otherwise
        stay alive in a reference cycle, with its process groups, until a garbage collection."""
        self.post = None

    @property
    def pending(self) -> int:
        """Receives not yet taken (posted or not)."""
        return len(self.posted) + len(self.order) - self.next

    def _fill(self) -> None:
        while self.next < len(self.order) and len(self.posted) < self.ahead:
            self._post_next()

    def _post_next(self) -> None:
        key = self.order[self.next]
        self.posted[key] = self.post(key)
        self.next += 1
        self.peak_posted = max(self.peak_posted, len(self.posted))
