"""Per-step compute time of one rank, cheap enough to leave on.

CPU: wall time inside forward/backward. Process CPU time would hide the commonest real
straggler: a rank whose CPU is taken away (a cgroup quota, a competing process) burns the same
CPU time per step, only later. Waits inside TP collectives count too, which is why the online
check compares DP replicas, whose waits are alike (detect_online.py). Nothing outside the
measured span feeds it: a fault injector only makes the span longer. CUDA: event
pairs around each forward/backward; `take()` hands the step's pairs over and `resolve()`
reads them once the caller has synchronised anyway (the trainer does so at log intervals),
so measuring never adds a synchronisation.
"""

from __future__ import annotations

import contextlib
import time

import torch


class ComputeTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu_s = 0.0
        self._pending: list = []  # this step's event pairs
        self._pool: list = []  # read pairs, reused: a new CUDA event costs a driver call

    @contextlib.contextmanager
    def measure(self):
        if self.cuda:
            start, end = (
                self._pool.pop()
                if self._pool
                else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            )
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu_s += time.perf_counter() - t0

    def take(self):
        """End of a step: a handle to this step's compute time (seconds on CPU, events on CUDA)."""
        if not self.cuda:
            value, self._cpu_s = self._cpu_s, 0.0
            return value
        pairs, self._pending = self._pending, []
        return pairs

    def resolve(self, handle) -> float:
        """Seconds of a handle from take(); on CUDA its events must have completed."""
        if not self.cuda:
            return float(handle)
        value = sum(s.elapsed_time(e) for s, e in handle) / 1e3
        self._pool.extend(handle)
        return value
