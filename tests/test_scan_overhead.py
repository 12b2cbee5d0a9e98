"""The tracing-overhead method (benchmarks/scan_overhead.py): paired rounds resolve a small
overhead under drift much larger than it; and one tiny CPU run of the real measurement."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scan_overhead  # noqa: E402


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
    results = scan_overhead.run_rounds(_drifting_measure(truth, 0), scan_overhead.VARIANTS, 30, seed=1)
    summary = scan_overhead.summarize(results, steps=1)
    for variant in ("base", "full"):
        got = summary[variant]["overhead"]
        assert abs(got["median"] - truth[variant]) < 0.004
        assert got["ci95"][0] <= truth[variant] <= got["ci95"][1] and got["ci95"][1] - got["ci95"][0] < 0.01
    # The unpaired figure (median time / median off time) is off by far more than 1%:
    off = np.median([r["off"]["steps_s"] for r in results])
    unpaired = np.median([r["base"]["steps_s"] for r in results]) / off - 1
    spread = summary["off_step_ms_range"][1] / summary["off_step_ms_range"][0] - 1
    assert spread > 0.2 and abs(unpaired - 0.01) > abs(summary["base"]["overhead"]["median"] - 0.01)
    line = scan_overhead.format_line("small", "base", summary)
    assert line.startswith("small base: +1.") and "95% CI" in line


def test_round_order_is_random_but_seeded():
    seen = []
    scan_overhead.run_rounds(lambda v: seen.append(v) or {"steps_s": 1.0}, scan_overhead.VARIANTS, 12, seed=3)
    rounds = [tuple(seen[k:k + 3]) for k in range(0, len(seen), 3)]
    assert all(sorted(r) == sorted(scan_overhead.VARIANTS) for r in rounds) and len(set(rounds)) > 1
    again = []
    scan_overhead.run_rounds(lambda v: again.append(v) or {"steps_s": 1.0}, scan_overhead.VARIANTS, 12, seed=3)
    assert again == seen


def test_bootstrap_interval_brackets_the_median_and_rejects_nothing():
    median, lo, hi = scan_overhead.bootstrap_median_ci([1.0, 1.02, 1.01, 0.99, 1.03])
    assert lo <= median == 1.01 <= hi
    assert scan_overhead.bootstrap_median_ci([1.02] * 5) == (1.02, 1.02, 1.02)
    with pytest.raises(ValueError):
        scan_overhead.bootstrap_median_ci([])


def test_tiny_model_on_cpu_measures_every_variant(tmp_path):
    torch.manual_seed(0)
    summary = scan_overhead.bench("tiny", 1, 1, torch.device("cpu"), steps=1, rounds=2, warmup=1,
                                  compile_model=False)
    assert summary["rounds"] == 2 and summary["off_step_ms"] > 0
    for variant in ("base", "full"):
        assert summary[variant]["events_per_step"] > 0 and summary[variant]["bytes_per_event"] > 0
        assert math.isfinite(summary[variant]["overhead_with_close"]["median"])
    assert summary["full"]["events_per_step"] > summary["base"]["events_per_step"]


def test_pair_plan_puts_the_traced_step_first_or_second_by_a_seeded_coin():
    plan = scan_overhead.pair_plan(200, 7, seed=4)
    assert [sorted(p) for p in plan] == [[7 + 2 * k, 8 + 2 * k] for k in range(200)]  # adjacent, in order
    first = sum(t < o for t, o in plan)
    assert 70 < first < 130  # both orders, about half each
    assert scan_overhead.pair_plan(200, 7, seed=4) == plan and scan_overhead.pair_plan(200, 7, seed=5) != plan


def test_alternating_on_cpu_traces_exactly_the_planned_steps(tmp_path):
    torch.manual_seed(0)
    summary = scan_overhead.bench("tiny", 1, 1, torch.device("cpu"), steps=1, rounds=2, warmup=1,
                                  compile_model=False, pairs=6)
    assert summary["pairs"] == 6 and set(summary) >= {"control", "base", "full"}
    assert "writer_cpu_share" not in summary["control"]  # nothing traced: no writer cost to bound
    base, full = summary["base"], summary["full"]
    # one traced step per pair: full adds the same whole number of layer spans to each of them
    extra = full["events_per_traced_step"] - base["events_per_traced_step"]
    assert base["events_per_traced_step"] > 0 and extra >= 1 and abs(extra - round(extra)) < 1e-9
    for v in ("control", "base", "full"):
        assert math.isfinite(summary[v]["overhead"]["median"]) and 0 <= summary[v]["treated_first"] <= 6
    assert scan_overhead.format_alternating("tiny", "control", summary).startswith("tiny control")
    assert math.isfinite(summary["control"]["position_effect"]["median"])


def test_the_control_pass_reads_a_position_effect_the_coin_cancels(monkeypatch):
    """Every pair's second step 5 % slower, nothing traced: the control's ratio stays ~0 (the
    coin), its position effect reads +5 %, what a fixed order would have charged the tracer."""
    times = iter(0.1 * (1.05 if k % 2 else 1.0) for k in range(10_000))

    class FakeTrainer:
        iteration = 10

        def train_step(self):
            self.iteration += 1

        def set_tracer(self, tracer):
            pass

    monkeypatch.setattr(scan_overhead, "timed_seconds", lambda fn, device, repeat=1: (fn(), next(times))[1])
    out = scan_overhead.measure_alternating(FakeTrainer(), torch.device("cpu"), 40, seed=2)
    control = out["control"]
    assert abs(control["position_effect"]["median"] - 0.05) < 1e-9
    assert 10 < control["treated_first"] < 30
    assert control["overhead"]["ci95"][0] <= 0 <= control["overhead"]["ci95"][1]
