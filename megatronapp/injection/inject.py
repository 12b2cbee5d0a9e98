"""Software fault injection, for validating slow-rank and slow-link detection.

--inject-slowdown RANK:FACTOR[:EVERY]
    that global rank's forward/backward compute takes FACTOR x as long, in every EVERY-th
    iteration (default 1: always; 4: iterations 0, 4, 8, ...). On CPU by sleeping (FACTOR-1) x
    the CPU time the calling thread burned in the span (waits inside TP collectives burn none, so only
    compute is stretched); on GPU by extra device work on the current stream
    (torch.cuda._sleep spin cycles), never by touching clocks.
--inject-link-delay SRC:DST:MS[:JITTER]
    messages from SRC to DST *arrive* MS (+- uniform JITTER) ms later than they really do; the
    sender is never blocked. On CPU through `link_delay.install_link_delays`, which wraps the
    receiver's torch.distributed recv Works (traced and untraced runs alike; install it before
    any tracing instrumentation so recv spans include the delay). On GPU (NCCL): MS of spin
    work on the stream before the receiver consumes the message.

Both flags repeat (two faults at once); the same specs come from the environment variables
MEGATRONAPP_INJECT_SLOWDOWN and MEGATRONAPP_INJECT_LINK_DELAY (comma-separated), which is how
`megatronapp trace run` hands them to an unmodified program.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch

ENV_SLOWDOWN = "MEGATRONAPP_INJECT_SLOWDOWN"
ENV_LINK_DELAY = "MEGATRONAPP_INJECT_LINK_DELAY"


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Slowdown:
    factor: float
    every: int = 1  # slow iterations i with i % every == 0

    def applies(self, iteration: int) -> bool:
        return iteration % self.every == 0


@dataclass(frozen=True)
class LinkDelay:
    ms: float
    jitter_ms: float = 0.0


@dataclass(frozen=True)
class FaultPlan:
    """Faults of one job. Plain numbers are accepted for convenience: {rank: factor} and
    {(src, dst): ms}."""

    slowdowns: dict[int, Slowdown] = field(default_factory=dict)
    link_delays: dict[tuple[int, int], LinkDelay] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "slowdowns",
            {r: s if isinstance(s, Slowdown) else Slowdown(float(s)) for r, s in self.slowdowns.items()},
        )
        object.__setattr__(
            self,
            "link_delays",
            {k: d if isinstance(d, LinkDelay) else LinkDelay(float(d)) for k, d in self.link_delays.items()},
        )

    @property
    def empty(self) -> bool:
        return not (self.slowdowns or self.link_delays)

    def check(self, world_size: int) -> None:
        for r, s in self.slowdowns.items():
            if not 0 <= r < world_size:
                raise FaultSpecError(f"--inject-slowdown rank {r} is outside world size {world_size}")
            if s.factor < 1.0:
                raise FaultSpecError(f"--inject-slowdown factor must be >= 1, got {s.factor}")
            if s.every < 1:
                raise FaultSpecError(f"--inject-slowdown EVERY must be >= 1 iteration, got {s.every}")
        for (s, d), delay in self.link_delays.items():
            if not (0 <= s < world_size and 0 <= d < world_size) or s == d:
                raise FaultSpecError(f"--inject-link-delay {s}:{d} is not a link between two ranks of {world_size}")
            if delay.ms < 0 or delay.jitter_ms < 0 or delay.jitter_ms > delay.ms:
                raise FaultSpecError(f"--inject-link-delay needs 0 <= JITTER <= MS, got {delay.ms}:{delay.jitter_ms}")


def _parse_slowdown(spec: str) -> tuple[int, Slowdown]:
    try:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError
        return int(parts[0]), Slowdown(float(parts[1]), int(parts[2]) if len(parts) == 3 else 1)
    except ValueError:
        raise FaultSpecError(f"--inject-slowdown expects RANK:FACTOR[:EVERY], got {spec!r}") from None


def _parse_link_delay(spec: str) -> tuple[tuple[int, int], LinkDelay]:
    try:
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise ValueError
        jitter = float(parts[3]) if len(parts) == 4 else 0.0
        return (int(parts[0]), int(parts[1])), LinkDelay(float(parts[2]), jitter)
    except ValueError:
        raise FaultSpecError(f"--inject-link-delay expects SRC:DST:MS[:JITTER], got {spec!r}") from None


def parse_fault_plan(slowdowns: list[str], link_delays: list[str]) -> FaultPlan:
    """Parse 'RANK:FACTOR[:EVERY]' and 'SRC:DST:MS[:JITTER]' strings; one-line FaultSpecError on bad input."""
    return FaultPlan(
        dict(_parse_slowdown(s) for s in slowdowns or []), dict(_parse_link_delay(s) for s in link_delays or [])
    )


def split_env_specs(value: str | None) -> list[str]:
    """'0:2,3:1.5:4' -> ['0:2', '3:1.5:4'] (empty or unset -> [])."""
    return [s.strip() for s in (value or "").split(",") if s.strip()]


def fault_plan_from_env(environ: dict | None = None) -> FaultPlan:
    """The plan in MEGATRONAPP_INJECT_SLOWDOWN / MEGATRONAPP_INJECT_LINK_DELAY."""
    env = os.environ if environ is None else environ
    return parse_fault_plan(split_env_specs(env.get(ENV_SLOWDOWN)), split_env_specs(env.get(ENV_LINK_DELAY)))


def fault_env(slowdowns: list[str], link_delays: list[str]) -> dict[str, str]:
    """Environment entries carrying flag specs to child processes (read by fault_plan_from_env)."""
    return {ENV_SLOWDOWN: ",".join(slowdowns or []), ENV_LINK_DELAY: ",".join(link_delays or [])}


class GpuTaskClock:
    """GPU time of recurring tasks, per key (e.g. forward of chunk 0), without stalling the host:
    a task's (start, end) events are read once they have completed, except the first of a key,
    which is waited for once. `spin(ms)` adds that much device work on the current stream
    (torch.cuda._sleep cycles, calibrated on first use), which is how a slowed GPU is imitated
    without touching clocks. Keys matter because one running mean over a forward and a backward
    (about twice as long) would slow the one too much and the other too little."""

    def __init__(self):
        self.estimates_ms: dict = {}
        self._pending: list = []
        self._cycles_per_ms = 0.0

    @contextlib.contextmanager
    def measure(self, key=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((key, start, end))
        self._resolve(block=key not in self.estimates_ms)  # one sync, a key's first time only

    def estimate_ms(self, key=None) -> float:
        return self.estimates_ms.get(key, 0.0)

    def calibrate(self) -> None:
        if not self._cycles_per_ms:
            self._cycles_per_ms = calibrate_spin()

    def spin(self, ms: float) -> None:
        if ms > 0:
            self.calibrate()
            torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def _resolve(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][2].query()):
            key, s, e = self._pending.pop(0)
            e.synchronize()
            ms, old = s.elapsed_time(e), self.estimates_ms.get(key)
            self.estimates_ms[key] = ms if old is None else 0.8 * old + 0.2 * ms


def calibrate_spin() -> float:
    """torch.cuda._sleep cycles per millisecond on the current GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


class FaultInjector:
    """The runtime's injection hooks for one rank (see pipeline.runtime.NullInjector).

    `set_iteration(i)` tells it which iteration runs next (for intermittent slowdowns);
    `compute(key)`: key names the kind of task (GPU: its duration is estimated per key)."""

    def __init__(self, plan: FaultPlan, rank: int, device: torch.device):
        self.slowdown = plan.slowdowns.get(rank, Slowdown(1.0))
        self.factor = self.slowdown.factor
        self.delays_ms = {src: d.ms for (src, dst), d in plan.link_delays.items() if dst == rank}
        self.device = device
        self.iteration = 0
        self.clock = GpuTaskClock() if device.type == "cuda" else None
        if self.clock is not None and (self.factor > 1 or self.delays_ms):
            self.clock.calibrate()  # before the run, not inside its first slowed task

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def compute(self, key=None):
        if self.factor <= 1.0 or not self.slowdown.applies(self.iteration):
            return contextlib.nullcontext()
        return self._slow_cuda(key) if self.clock is not None else self._slow_cpu()

    @contextlib.contextmanager
    def _slow_cpu(self):
        # This thread's CPU time only (CPU autograd runs in the calling thread): process time
        # would also count gloo's worker threads and the trace writer, inflating the factor
        # (measured: a DDP backward burns 1.5 ms of process time for 0.9 ms of its own).
        t0 = time.thread_time()
        yield
        stall = (self.factor - 1.0) * (time.thread_time() - t0)
        time.sleep(stall)

    @contextlib.contextmanager
    def _slow_cuda(self, key):
        with self.clock.measure(key):
            yield
        self.clock.spin((self.factor - 1.0) * self.clock.estimate_ms(key))

    def before_recv_wait(self, src_global: int, work) -> None:
        """GPU only: on CPU the delay lives in the recv Work itself (link_delay.py)."""
        ms = self.delays_ms.get(src_global)
        if ms and self.clock is not None:
            self.clock.spin(ms)
