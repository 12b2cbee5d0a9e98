"""CUDA-event timing shared by the kernel probes (gelu_epilogue_probe.py, attention_probe.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_event_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of fn, by CUDA events around it (device time of the
    work it queues, host launch gaps included), synchronised after each call."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def summary(times_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms),
            "n": len(times_ms)}


def add_timing_arguments(p, reps: int) -> None:
    """--reps, --rounds and --out, as every probe takes them."""
    p.add_argument("--reps", type=int, default=reps, help="timed calls per variant per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the variants interleaved in each")
    p.add_argument("--out", default=None, help="JSON report")
