"""The held-out evaluation harness (benchmarks/scan_eval.py): scenarios, scoring, intervals,
tuning, and a resumable synthetic smoke run through its command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scan_eval  # noqa: E402
from scan_eval_core import (  # noqa: E402
    KINDS,
    Fault,
    Scenario,
    compute_scores,
    draw_scenario,
    plan_scenarios,
    select_thresholds,
    wilson,
)


def test_scenarios_are_reproducible_disjoint_between_splits_and_in_range():
    design = plan_scenarios("design", 0, runs_per_kind=20, clean_runs=25)
    assert design == plan_scenarios("design", 0, runs_per_kind=20, clean_runs=25)
    heldout = plan_scenarios("heldout", 0, runs_per_kind=20, clean_runs=25)
    assert {sc.seed for sc in design}.isdisjoint({sc.seed for sc in heldout})
    assert [sc.kind for sc in design[:5]] == list(KINDS)  # interleaved: a partial run covers every kind
    assert sum(sc.kind == "none" for sc in design) == 25 and len(design) == 25 + 4 * 20
    for sc in design:
        f = sc.fault
        if sc.kind in ("compute", "intermittent", "two_faults"):
            assert 1.2 <= f.factor <= 2.0 and 0 <= f.rank < sc.nproc
        if sc.kind in ("link", "two_faults"):
            assert sc.pp > 1 and 2.0 <= f.delay_ms <= 50.0 and f.link[0] != f.link[1]
        assert (f.every > 1) == (sc.kind == "intermittent")
    with pytest.raises(ValueError, match="split"):
        draw_scenario("test", 0, 0, "none")


def test_wilson_interval():
    assert wilson(0, 0) is None
    assert wilson(10, 10) == (0.722, 1.0)
    assert wilson(5, 10) == (0.237, 0.763)


def _suspect(cause, where):
    return {"cause": cause, "rank": where if cause == "slow_compute" else where[0],
            "link": list(where) if cause == "slow_link" else None, "confidence": 0.9}


def test_scores_separate_recall_precision_root_cause_and_false_alarms():
    two = Scenario("design", 0, "two_faults", "engine", 1, 2, 4, Fault(rank=1, factor=1.5, link=(0, 2), delay_ms=5))
    comp = Scenario("design", 1, "compute", "engine", 1, 2, 4, Fault(rank=3, factor=1.5))
    clean = Scenario("design", 2, "none", "engine", 1, 2, 4)
    results = [(two, [_suspect("slow_compute", 1), _suspect("slow_link", (0, 2))]),
               (comp, [_suspect("slow_compute", 3), _suspect("slow_compute", 2)]),  # a victim named too
               (clean, [_suspect("slow_compute", 0)])]
    s = compute_scores(results)
    assert s["two_faults"]["recall"]["k"] == 1 and s["two_faults"]["root_cause_accuracy"]["k"] == 1
    assert (s["compute"]["recall"]["k"], s["compute"]["precision"]["k"], s["compute"]["precision"]["n"]) == (1, 1, 2)
    assert s["compute"]["root_cause_accuracy"]["k"] == 0
    assert s["none"]["false_alarm_rate"] == {"value": 1.0, "k": 1, "n": 1, "ci95": wilson(1, 1)}


def test_tuning_prefers_no_false_alarms_over_recall():
    def scores(alarms, recall):
        return {"none": {"false_alarm_rate": {"k": alarms}},
                **{k: {"recall": {"value": recall, "n": 1}} for k in KINDS[1:]}}

    grid = [({"compute_min_ratio": 1.1}, scores(2, 1.0)), ({"compute_min_ratio": 1.2}, scores(0, 0.8)),
            ({"compute_min_ratio": 1.3}, scores(0, 0.8))]
    assert select_thresholds(grid) == {"compute_min_ratio": 1.3}


def test_synthetic_smoke_runs_resumes_tunes_and_scores(tmp_path, capsys, monkeypatch):
    out = str(tmp_path)
    grid = [{"compute_min_ratio": 1.2, "link_min_ratio": 2.0, "link_min_excess_ns": 2_000_000},
            {"compute_min_ratio": 1.3, "link_min_ratio": 3.0, "link_min_excess_ns": 4_000_000}]
    monkeypatch.setattr(scan_eval, "threshold_grid", lambda: grid)  # the full grid is for real evaluations
    assert scan_eval.main(["run", "--split", "design", "--runs-per-kind", "1", "--clean-runs", "1",
                           "--synthetic", "--out", out]) == 0
    assert "running 5" in capsys.readouterr().out
    assert scan_eval.main(["run", "--split", "design", "--runs-per-kind", "1", "--clean-runs", "1",
                           "--synthetic", "--out", out]) == 0
    assert "5 done already, running 0" in capsys.readouterr().out
    assert scan_eval.main(["tune", "--out", out]) == 0
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    assert tuned["design_runs"] == 5 and tuned["overrides"] in grid
    assert scan_eval.main(["run", "--split", "heldout", "--runs-per-kind", "1", "--clean-runs", "1",
                           "--synthetic", "--out", out]) == 0
    assert scan_eval.main(["score", "--split", "heldout", "--out", out]) == 0
    doc = json.loads((tmp_path / "scores-heldout.json").read_text())
    assert doc["runs"] == 5 and doc["thresholds"] == tuned["overrides"]
    assert doc["scores"]["link"]["recall"]["n"] == 1 and doc["scores"]["link"]["recall"]["ci95"] is not None
