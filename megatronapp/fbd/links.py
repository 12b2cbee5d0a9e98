"""Point-to-point plumbing shared by both roles: posted messages, the run-ahead window,
time spent waiting on the other role, and the failure/delay injection of tests.

Every P2P message is posted asynchronously (dist.isend / dist.irecv) in action-list order
and waited for lazily; a rank only blocks where the rendezvous model of fbd.validate allows.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque

import torch
import torch.distributed as dist

from megatronapp import spans
from megatronapp.parallel.placement import Placement, compute_link_device_kind


class LinkDevices:
    """Device of the tensors of each point-to-point link of this rank, so of its transport on a
    "cpu:gloo,cuda:nccl" default group: the compute device where the link may use NCCL (both
    ends on distinct GPUs), host memory (gloo) where the ends share a GPU or one is a CPU."""

    def __init__(self, by_peer: dict[int, torch.device], default: torch.device):
        self._by_peer, self._default = dict(by_peer), default

    @classmethod
    def uniform(cls, device: torch.device) -> LinkDevices:
        return cls({}, device)

    @classmethod
    def from_placements(cls, placements: tuple[Placement, ...], rank: int, device: torch.device) -> LinkDevices:
        """Both ends of every link compute the same choice from the same placements."""
        cpu = torch.device("cpu")
        return cls({peer: device if compute_link_device_kind(placements[rank], p) == "cuda" else cpu
                    for peer, p in enumerate(placements) if peer != rank}, cpu)

    def __call__(self, peer: int) -> torch.device:
        return self._by_peer.get(peer, self._default)

    def group_peers(self, peers) -> list[tuple[torch.device, tuple[int, ...]]]:
        """Peers grouped by link device, in first-seen order (one framed copy per device)."""
        out: dict[torch.device, list[int]] = {}
        for p in peers:
            out.setdefault(self(p), []).append(p)
        return [(d, tuple(ps)) for d, ps in out.items()]


class RoleWaits:
    """Seconds this rank spent blocked on the other role (backward on forward or vice versa)."""

    def __init__(self):
        self.on_other_role_s = 0.0

    @contextlib.contextmanager
    def on_other_role(self, tracer, name: str):
        t0 = time.perf_counter()
        with tracer.span(name, cat=spans.CAT_COMM):
            yield
        self.on_other_role_s += time.perf_counter() - t0


class PostedRecv:
    def __init__(self, numel: int, source: int, device, dtype: torch.dtype = torch.float32):
        self.source = source
        self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self.work = dist.irecv(self.buffer, source)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


class Outbox:
    """Sends in flight, oldest first. Each `post` is one entry (one microbatch's messages);
    with a `window`, at most that many entries stay outstanding (the run-ahead bound): a
    post first waits for the oldest entry beyond the window."""

    def __init__(self, window: int | None = None):
        self.window = window
        self._inflight: deque = deque()  # [(tensor, works)]: tensors must outlive their sends

    def post(self, messages: list[tuple[torch.Tensor, tuple[int, ...]]], waiting=contextlib.nullcontext) -> None:
        if self.window is not None and len(self._inflight) >= self.window:
            with waiting():
                self._wait_oldest()
        entry = []
        for tensor, peers in messages:
            tensor = tensor.contiguous()
            entry.append((tensor, [dist.isend(tensor, p) for p in peers]))
        self._inflight.append(entry)

    def _wait_oldest(self) -> None:
        for _, works in self._inflight.popleft():
            for w in works:
                w.wait()

    def drain(self) -> None:
        while self._inflight:
            self._wait_oldest()


class RoleFaults:
    """--inject-crash RANK:ITER and seeded random delays before compute actions (tests)."""

    def __init__(self, rank: int, role: str, crash: tuple[int, int] | None, max_delay_ms: float, seed: int):
        self.rank, self.role, self.crash, self.max_delay_ms = rank, role, crash, max_delay_ms
        self._rng = random.Random(seed * 1_000_003 + rank)

    def before_iteration(self, iteration: int) -> None:
        if self.crash == (self.rank, iteration):
            raise RuntimeError(f"injected crash: {self.role} worker rank {self.rank} at iteration {iteration} "
                               f"(unix time {time.time():.3f})")

    def before_compute(self) -> None:
        if self.max_delay_ms > 0:
            time.sleep(self._rng.uniform(0.0, self.max_delay_ms) / 1000.0)
