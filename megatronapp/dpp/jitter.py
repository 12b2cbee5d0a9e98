"""--inject-jitter: each compute task on one rank takes a random factor in [1, MAXFACTOR] longer.

Factors come from random.Random(f"{seed}:{rank}") in the order the rank runs its tasks, the
same rule the simulator uses (sim/simulator.py), so a run and its simulation see the same
draws. On CPU the extra time is slept after the task, proportional to the CPU time it
burned (as --inject-slowdown does, injection/inject.py). On GPU it is device work (spin
cycles) right after the task on its stream, (factor - 1) x that kind of task's GPU time,
measured per (forward/backward, chunk) without stalling the host (injection.inject.GpuTaskClock):
the task then holds the GPU factor x as long, as a clock dip would make it.
Wraps any other injector (slowdown, link delay), so the flags combine.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch

from megatronapp.dpp.config import JitterSpec
from megatronapp.injection.inject import GpuTaskClock
from megatronapp.pipeline.runtime import NullInjector


class JitterInjector:
    """The runtime's injector hooks (pipeline.runtime.NullInjector) with jitter added on top of `inner`."""

    def __init__(self, spec: JitterSpec, device: torch.device, inner=None):
        self.inner = inner or NullInjector()
        self.max_factor = spec.max_factor
        self.rng = random.Random(f"{spec.seed}:{spec.rank}")
        self.factors: list[float] = []  # every factor drawn, for tests and reports
        self.clock = GpuTaskClock() if device.type == "cuda" else None
        if self.clock is not None:
            self.clock.calibrate()

    def before_recv_wait(self, src_global: int, work) -> None:
        self.inner.before_recv_wait(src_global, work)

    def set_iteration(self, iteration: int) -> None:
        """The training loop's per-step hook (iteration-scoped faults of the inner injector)."""
        if hasattr(self.inner, "set_iteration"):
            self.inner.set_iteration(iteration)

    def compute(self, key=None):
        factor = self.rng.uniform(1.0, self.max_factor)
        self.factors.append(factor)
        return self._on_gpu(factor, key) if self.clock is not None else self._on_cpu(factor, key)

    @contextlib.contextmanager
    def _on_cpu(self, factor: float, key):
        with self.inner.compute(key):
            t0 = time.thread_time()  # this thread's CPU only, as injection.inject (gloo threads excluded)
            yield
            stall = (factor - 1.0) * (time.thread_time() - t0)
        time.sleep(stall)

    @contextlib.contextmanager
    def _on_gpu(self, factor: float, key):
        with self.inner.compute(key):
            with self.clock.measure(key):
                yield
            self.clock.spin((factor - 1.0) * self.clock.estimate_ms(key))


def apply_jitter(injector, specs: tuple[JitterSpec, ...], rank: int, device: torch.device):
    """`injector` wrapped with the jitter spec for global `rank`, or unchanged when none applies."""
    mine = [s for s in specs if s.rank == rank]
    return JitterInjector(mine[-1], device, injector) if mine else injector
