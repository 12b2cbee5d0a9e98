"""Point-to-point plumbing shared by both roles: link devices, posted receives, time spent
waiting on the other role, and the failure/delay injection of tests.

Every P2P message is posted asynchronously in action-list order (p2p.outbox.Outbox for sends,
with the run-ahead window; `PostedRecv` for receives) and waited for lazily; a rank only blocks
where the rendezvous model of fbd.validate allows. Activations, gradients and losses travel as
packed messages (p2p/message.py): their own dtype, ids (iteration, microbatch) checked on arrival.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch
import torch.distributed as dist

from megatronapp import spans
from megatronapp.p2p.message import empty_message, pack_message, unpack_expected
from megatronapp.p2p.outbox import Send
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
        return cls(
            {
                peer: device if compute_link_device_kind(placements[rank], p) == "cuda" else cpu
                for peer, p in enumerate(placements)
                if peer != rank
            },
            cpu,
        )

    def __call__(self, peer: int) -> torch.device:
        return self._by_peer.get(peer, self._default)

    def group_peers(self, peers) -> list[tuple[torch.device, tuple[int, ...]]]:
        """Peers grouped by link device, in first-seen order (one packed copy per device)."""
        out: dict[torch.device, list[int]] = {}
        for p in peers:
            out.setdefault(self(p), []).append(p)
        return [(d, tuple(ps)) for d, ps in out.items()]

    def packed_sends(self, x: torch.Tensor, ids: tuple[int, ...], peers) -> list[Send]:
        """x to every peer of `peers` as a packed message (p2p/message.py), packed once per link device."""
        return [
            Send(message, p)
            for device, group in self.group_peers(peers)
            for message in [pack_message(x, ids, device)]
            for p in group
        ]


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
    """A receive posted into `buffer` (a packed message, p2p/message.py, or a weight message)."""

    def __init__(self, buffer: torch.Tensor, source: int):
        self.source, self.buffer = source, buffer
        self.work = dist.irecv(self.buffer, source)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


def receive_expected(links, src: int, spec, tags: tuple[int, int], what: str, device) -> torch.Tensor:
    """Receive from `src` the packed message `spec` describes, checked to carry `tags` (iteration,
    microbatch), as a tensor on `device`."""
    message = PostedRecv(empty_message(spec.shape, spec.dtype, links(src)), src).wait()
    return unpack_expected(message, spec.shape, spec.dtype, tags, what, src).to(device)


class RoleFaults:
    """--inject-crash RANK:ITER and seeded random delays before compute actions (tests)."""

    def __init__(self, rank: int, role: str, crash: tuple[int, int] | None, max_delay_ms: float, seed: int):
        self.rank, self.role, self.crash, self.max_delay_ms = rank, role, crash, max_delay_ms
        self._rng = random.Random(seed * 1_000_003 + rank)

    def before_iteration(self, iteration: int) -> None:
        if self.crash == (self.rank, iteration):
            raise RuntimeError(
                f"injected crash: {self.role} worker rank {self.rank} at iteration {iteration} "
                f"(unix time {time.time():.3f})"
            )

    def before_compute(self) -> None:
        if self.max_delay_ms > 0:
            time.sleep(self._rng.uniform(0.0, self.max_delay_ms) / 1000.0)
