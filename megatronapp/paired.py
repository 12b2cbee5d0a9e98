"""Paired measurement: how the benchmarks resolve a difference of about 1 % on a host whose speed
drifts by ±20 % between runs a few seconds apart.

Two designs, both pure here (the benchmarks supply the timing):

* **Paired rounds** (`run_rounds`, `summarize_rounds`): every round runs each variant once, back
  to back, in a fresh seeded random order, and the figure is the per-round ratio variant /
  baseline; drift slower than a round cancels. The median ratio over rounds comes with a
  percentile-bootstrap 95 % interval (`bootstrap_median_ci`).
* **Adjacent step pairs** (`pair_plan`, `compute_position_effect`): one step of each adjacent
  pair is treated (e.g. traced), the first or the second by a seeded coin, and divided by its
  untreated neighbour, so drift within a round cancels too, and so does any bias of a pair's
  second step against its first. A control pass that treats nothing measures that position
  effect directly.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

import numpy as np


def bootstrap_median_ci(
    ratios: Sequence[float], seed: int = 0, resamples: int = 4000, level: float = 0.95
) -> tuple[float, float, float]:
    """(median, low, high): the median of `ratios` and a percentile-bootstrap confidence
    interval of it (rounds resampled with replacement)."""
    values = np.asarray(ratios, dtype=np.float64)
    if len(values) == 0:
        raise ValueError("no rounds to summarise")
    rng = np.random.default_rng(seed)
    medians = np.median(values[rng.integers(0, len(values), (resamples, len(values)))], axis=1)
    tail = (1.0 - level) / 2 * 100
    return float(np.median(values)), float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def paired_ratios(times: dict[str, list[float]], baseline: str) -> dict[str, list[float]]:
    """Per round, each variant's time over the baseline's time of the same round."""
    base = times[baseline]
    return {k: [t / b for t, b in zip(v, base)] for k, v in times.items() if k != baseline}


def run_rounds(
    measure: Callable[[str], dict[str, float]], variants: Sequence[str], rounds: int, seed: int
) -> list[dict[str, dict[str, float]]]:
    """`rounds` rounds; each runs every variant once, in a fresh random order (seeded).
    `measure(variant)` returns named seconds, at least "steps_s"."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        out.append({v: measure(v) for v in order})
    return out


def summarize_rounds(
    results: list[dict[str, dict[str, float]]], steps: int, baseline: str = "off", seed: int = 0
) -> dict:
    """The baseline's median seconds per step (and range) and, per other variant, the paired
    ratios' median and 95 % interval as fractions (+0.012 = 1.2 % slower than the baseline): of
    "steps_s" as "overhead", and of "with_close_s" (where measured, else "steps_s") as
    "overhead_with_close"."""
    off = [r[baseline]["steps_s"] / steps for r in results]
    out: dict = {
        "rounds": len(results),
        "steps_per_round": steps,
        "off_step_ms": statistics.median(off) * 1e3,
        "off_step_ms_range": [min(off) * 1e3, max(off) * 1e3],
    }
    for key, label in (("steps_s", "overhead"), ("with_close_s", "overhead_with_close")):
        times = {v: [r[v].get(key, r[v]["steps_s"]) for r in results] for v in results[0]}
        for variant, ratios in paired_ratios(times, baseline).items():
            median, lo, hi = bootstrap_median_ci(ratios, seed)
            out.setdefault(variant, {})[label] = {
                "median": median - 1,
                "ci95": [lo - 1, hi - 1],
                "round_range": [min(ratios) - 1, max(ratios) - 1],
            }
    return out


def pair_plan(pairs: int, first_iteration: int, seed: int) -> list[tuple[int, int]]:
    """(treated, other) iterations of each adjacent pair, the treated one first or second by a
    seeded coin: a bias of the second step of a pair (or of the first) cancels out instead of
    landing on the treated step every time."""
    rng = random.Random(seed)
    plan = []
    for k in range(pairs):
        a = first_iteration + 2 * k
        plan.append((a, a + 1) if rng.random() < 0.5 else (a + 1, a))
    return plan


def compute_position_effect(ratios: Sequence[float], treated_first: Sequence[bool]) -> list[float]:
    """Per pair, its second step's time over its first's, from treated / other ratios and whether
    the treated step came first: in a control pass (nothing treated) this is the bias a fixed
    order would have charged the treatment."""
    return [1 / r if first else r for r, first in zip(ratios, treated_first)]
