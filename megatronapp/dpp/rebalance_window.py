"""What both rebalancing planners measure (dpp/rebalance.py for layers, rebalance_microbatches.py for
microbatches): one window of iterations and a memory of per-unit speeds.

  1. The job's first `warmup_iters` iterations are skipped: they time start-up, not speed.
  2. Each iteration, every part's time is its slowest rank's (its TP and other members wait for
     it); once `window` iterations are in, the window's medians per part and of the step time.
  3. A part's speed (seconds per layer or per microbatch) is the slowest it was measured at within
     `memory_iters` iterations: a part relieved of work can hide a throughput cap (a CPU quota)
     that comes back with the load.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class MeasurementWindow:
    warmup_iters: int
    window: int
    memory_iters: int
    iteration: int = 0  # iterations observed, warm-up included
    _parts: list[list[float]] = field(default_factory=list)
    _steps: list[float] = field(default_factory=list)
    _speeds: list[tuple[int, list[float]]] = field(default_factory=list)  # (iteration, seconds per unit)

    def add(self, rank_compute_s: tuple[float, ...], ranks_of_part: list[list[int]], step_s: float):
        """Steps 1-2: (median seconds of each part, median step seconds) once the window is full, else None."""
        self.iteration += 1
        if self.iteration <= self.warmup_iters:
            return None
        self._parts = [*self._parts, [max(rank_compute_s[r] for r in ranks) for ranks in ranks_of_part]][-self.window :]
        self._steps = [*self._steps, step_s][-self.window :]
        if len(self._parts) < self.window:
            return None
        return [statistics.median(col) for col in zip(*self._parts)], statistics.median(self._steps)

    def remember(self, now: list[float]) -> list[float]:
        """Step 3: each part's speed from `now` (seconds per unit) and those measured lately."""
        self._speeds = [(i, v) for i, v in self._speeds if self.iteration - i <= self.memory_iters]
        self._speeds.append((self.iteration, now))
        return [max(v[p] for _, v in self._speeds) for p in range(len(now))]

    def restart(self) -> None:
        """Measure afresh (the work moved); the speeds' memory stays."""
        self._parts, self._steps = [], []
