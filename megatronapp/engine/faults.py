"""Software fault injection, for validating slow-rank and slow-link detection.

--inject-slowdown RANK:FACTOR   that global rank's forward/backward compute takes FACTOR x as
                                long: on CPU by sleeping (FACTOR-1) x the CPU time the process
                                burned in the span (waits inside TP collectives burn none, so only
                                compute is stretched);
                                on GPU by extra device work on the current stream
                                (torch.cuda._sleep spin cycles), never by touching clocks.
--inject-link-delay SRC:DST:MS  every receive on DST from SRC takes MS longer. CPU, traced
                                iterations: DST sleeps MS after the data arrived, inside the
                                recv (through the traced Work's wait hook), so the message
                                completes MS late whatever the sender's timing. CPU, untraced
                                iterations: DST sleeps before waiting (gloo cannot poll a P2P
                                work for completion, and a second wait would hang). GPU: MS of
                                spin work on the stream before it waits for the message.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class FaultPlan:
    slowdowns: dict[int, float] = field(default_factory=dict)  # global rank -> factor
    link_delays_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # (src, dst) -> ms

    def check(self, world_size: int) -> None:
        for r, f in self.slowdowns.items():
            if not 0 <= r < world_size:
                raise FaultSpecError(f"--inject-slowdown rank {r} is outside world size {world_size}")
            if f < 1.0:
                raise FaultSpecError(f"--inject-slowdown factor must be >= 1, got {f}")
        for (s, d), ms in self.link_delays_ms.items():
            if not (0 <= s < world_size and 0 <= d < world_size) or s == d:
                raise FaultSpecError(f"--inject-link-delay {s}:{d} is not a link between two ranks of {world_size}")
            if ms < 0:
                raise FaultSpecError(f"--inject-link-delay must be >= 0 ms, got {ms}")


def parse_fault_plan(slowdowns: list[str], link_delays: list[str]) -> FaultPlan:
    """Parse 'RANK:FACTOR' and 'SRC:DST:MS' strings; one-line FaultSpecError on bad input."""
    slow, delays = {}, {}
    for spec in slowdowns or []:
        try:
            rank, factor = spec.split(":")
            slow[int(rank)] = float(factor)
        except ValueError:
            raise FaultSpecError(f"--inject-slowdown expects RANK:FACTOR, got {spec!r}") from None
    for spec in link_delays or []:
        try:
            src, dst, ms = spec.split(":")
            delays[(int(src), int(dst))] = float(ms)
        except ValueError:
            raise FaultSpecError(f"--inject-link-delay expects SRC:DST:MS, got {spec!r}") from None
    return FaultPlan(slow, delays)


class FaultInjector:
    """The runtime's injection hooks for one rank (see pipeline.runtime.NullInjector)."""

    def __init__(self, plan: FaultPlan, rank: int, device: torch.device):
        self.factor = plan.slowdowns.get(rank, 1.0)
        self.delays_ms = {src: ms for (src, dst), ms in plan.link_delays_ms.items() if dst == rank}
        self.device = device
        self._cycles_per_ms = self._calibrate_spin() if device.type == "cuda" and self.factor > 1 else 0.0
        self._estimate_ms: float | None = None
        self._pending: list = []
        self.on_stall = None  # the runtime's compute timer, told about CPU stalls

    @staticmethod
    def _calibrate_spin() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)

    def compute(self):
        if self.factor <= 1.0:
            return contextlib.nullcontext()
        return self._slow_cuda() if self.device.type == "cuda" else self._slow_cpu()

    @contextlib.contextmanager
    def _slow_cpu(self):
        t0 = time.process_time()
        yield
        stall = (self.factor - 1.0) * (time.process_time() - t0)
        time.sleep(stall)
        if self.on_stall is not None:
            self.on_stall(stall)

    @contextlib.contextmanager
    def _slow_cuda(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))
        self._resolve(block=self._estimate_ms is None)  # one sync, the first time only
        if self._estimate_ms:
            torch.cuda._sleep(int((self.factor - 1.0) * self._estimate_ms * self._cycles_per_ms))

    def _resolve(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][1].query()):
            s, e = self._pending.pop(0)
            e.synchronize()
            ms = s.elapsed_time(e)
            self._estimate_ms = ms if self._estimate_ms is None else 0.8 * self._estimate_ms + 0.2 * ms

    def before_recv_wait(self, src_global: int, work) -> None:
        ms = self.delays_ms.get(src_global)
        if not ms:
            return
        if self.device.type == "cuda":
            torch.cuda._sleep(int(ms * self._spin_rate()))
        elif hasattr(work, "add_wait_hook"):  # a traced Work: delay after arrival, inside the recv
            work.add_wait_hook(lambda: time.sleep(ms / 1000.0))
        else:
            time.sleep(ms / 1000.0)

    def _spin_rate(self) -> float:
        if not self._cycles_per_ms:
            self._cycles_per_ms = self._calibrate_spin()
        return self._cycles_per_ms
