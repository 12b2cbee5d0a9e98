"""--inject-jitter: each compute task on one rank takes a random factor in [1, MAXFACTOR] longer.

Factors come from random.Random(f"{seed}:{rank}") in the order the rank runs its tasks, the
same rule the simulator uses (simulator.py), so a run and its simulation see the same
draws. On CPU the extra time is slept after the task, proportional to the CPU time it
burned (as --inject-slowdown does, engine/faults.py). CPU only (refused before launch on CUDA).
Wraps any other injector (slowdown, link delay), so the flags combine.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch

from megatronapp.dpp.config import JitterSpec
from megatronapp.pipeline.runtime import NullInjector


class JitterInjector:
    """The runtime's injector hooks (pipeline.runtime.NullInjector) with jitter added on top of `inner`."""

    def __init__(self, spec: JitterSpec, device: torch.device, inner=None):
        self.inner = inner or NullInjector()
        self.max_factor = spec.max_factor
        self.rng = random.Random(f"{spec.seed}:{spec.rank}")
        self.factors: list[float] = []  # every factor drawn, for tests and reports
        self._stall = None

    @property
    def on_stall(self):
        return self._stall

    @on_stall.setter
    def on_stall(self, fn) -> None:
        self._stall = fn
        self.inner.on_stall = fn

    def before_recv_wait(self, src_global: int, work) -> None:
        self.inner.before_recv_wait(src_global, work)

    def set_iteration(self, iteration: int) -> None:
        """The training loop's per-step hook (iteration-scoped faults of the inner injector)."""
        if hasattr(self.inner, "set_iteration"):
            self.inner.set_iteration(iteration)

    @contextlib.contextmanager
    def compute(self):
        factor = self.rng.uniform(1.0, self.max_factor)
        self.factors.append(factor)
        with self.inner.compute():
            t0 = time.thread_time()  # this thread's CPU only, as engine.faults (gloo threads excluded)
            yield
            stall = (factor - 1.0) * (time.thread_time() - t0)
        time.sleep(stall)
        if self._stall is not None:
            self._stall(stall)


def apply_jitter(injector, specs: tuple[JitterSpec, ...], rank: int, device: torch.device):
    """`injector` wrapped with the jitter spec for global `rank`, or unchanged when none applies."""
    mine = [s for s in specs if s.rank == rank]
    if mine and device.type == "cuda":
        raise ValueError("--inject-jitter is implemented for CPU runs only")
    return JitterInjector(mine[-1], device, injector) if mine else injector
