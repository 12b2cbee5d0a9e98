"""Paired measurement (megatronapp/paired.py): paired rounds resolve a 1 % difference under drift
twenty times larger, in a seeded random order; adjacent-pair plans and the position effect a
control pass reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatronapp.paired import bootstrap_median_ci, compute_position_effect, pair_plan, run_rounds, summarize_rounds

VARIANTS = ("off", "base", "full")


def _drifting_measure(overhead: dict[str, float], seed: int):
    """A fake `measure`: step time drifts by +-20% over the run plus 0.3% noise per segment;
    each variant costs its overhead on top."""
    rng = np.random.default_rng(seed)
    calls = [0]

    def measure(variant: str) -> dict[str, float]:
        calls[0] += 1
        drift = 1.0 + 0.2 * math.sin(calls[0] / 25.0)  # +-20% over ~50 rounds, ~0.8% per segment
        t = 0.1 * drift * (1 + overhead[variant]) * (1 + 0.003 * rng.standard_normal())
        return {"steps_s": t, "with_close_s": t * 1.001}

    return measure


def test_paired_rounds_resolve_one_percent_under_twenty_percent_drift():
    truth = {"off": 0.0, "base": 0.01, "full": 0.03}
    results = run_rounds(_drifting_measure(truth, 0), VARIANTS, 30, seed=1)
    summary = summarize_rounds(results, steps=1)
    for variant in ("base", "full"):
        got = summary[variant]["overhead"]
        assert abs(got["median"] - truth[variant]) < 0.004
        assert got["ci95"][0] <= truth[variant] <= got["ci95"][1] and got["ci95"][1] - got["ci95"][0] < 0.01
    # The unpaired figure (median time / median off time) is off by far more than 1%:
    off = np.median([r["off"]["steps_s"] for r in results])
    unpaired = np.median([r["base"]["steps_s"] for r in results]) / off - 1
    spread = summary["off_step_ms_range"][1] / summary["off_step_ms_range"][0] - 1
    assert spread > 0.2 and abs(unpaired - 0.01) > abs(summary["base"]["overhead"]["median"] - 0.01)


def test_round_order_is_random_but_seeded():
    seen = []
    run_rounds(lambda v: seen.append(v) or {"steps_s": 1.0}, VARIANTS, 12, seed=3)
    rounds = [tuple(seen[k : k + 3]) for k in range(0, len(seen), 3)]
    assert all(sorted(r) == sorted(VARIANTS) for r in rounds) and len(set(rounds)) > 1
    again = []
    run_rounds(lambda v: again.append(v) or {"steps_s": 1.0}, VARIANTS, 12, seed=3)
    assert again == seen


def test_bootstrap_interval_brackets_the_median_and_rejects_nothing():
    median, lo, hi = bootstrap_median_ci([1.0, 1.02, 1.01, 0.99, 1.03])
    assert lo <= median == 1.01 <= hi
    assert bootstrap_median_ci([1.02] * 5) == (1.02, 1.02, 1.02)
    with pytest.raises(ValueError):
        bootstrap_median_ci([])


def test_pair_plan_is_adjacent_in_order_and_seeded():
    plan = pair_plan(200, 7, seed=4)
    assert [sorted(p) for p in plan] == [[7 + 2 * k, 8 + 2 * k] for k in range(200)]  # adjacent, in order
    first = sum(t < o for t, o in plan)
    assert 70 < first < 130  # both orders, about half each
    assert pair_plan(200, 7, seed=4) == plan and pair_plan(200, 7, seed=5) != plan


def test_the_control_pass_reads_a_position_effect_the_coin_cancels():
    """Every pair's second step 5 % slower, nothing treated: the treated / other ratios centre on
    1 (the coin), and the position effect reads +5 %, what a fixed order would have charged."""
    plan = pair_plan(40, 11, seed=2)
    seconds = {it: 0.1 * (1.05 if (it - 11) % 2 else 1.0) for pair in plan for it in pair}
    ratios = [seconds[t] / seconds[o] for t, o in plan]
    first = [t < o for t, o in plan]
    effect = compute_position_effect(ratios, first)
    assert all(abs(e - 1.05) < 1e-9 for e in effect)
    assert 10 < sum(first) < 30
    _, lo, hi = bootstrap_median_ci(ratios)
    assert lo <= 1.0 <= hi
