"""The held-out evaluation harness (megatronapp/faultlab/evaluation: injected*.py, cli.py): scenarios from fixed seeds, scores
and Wilson intervals, tuning, the JSONL results file, the summary, and a tiny synthetic run of the
whole command line (simulated traces: real jobs are for the benchmark, not CI)."""

from __future__ import annotations

import itertools
import json

import pytest

import megatronapp.faultlab.evaluation.cli as scan_eval
import megatronapp.faultlab.evaluation.injected as core
import megatronapp.faultlab.evaluation.injected_runner as runner
from megatronapp.faultlab.evaluation.injected import (
    HELDOUT_SPLITS,
    KINDS,
    Fault,
    Scenario,
    combine_grid_suspects,
    compute_layout_scores,
    compute_scores,
    draw_scenario,
    plan_scenarios,
    select_thresholds,
    tune_on_design,
    wilson,
)


def _coords(rank: int, sc: Scenario) -> tuple[int, int, int]:
    dp = sc.nproc // (sc.tp * sc.pp)
    return rank % sc.tp, (rank // sc.tp) % dp, rank // (sc.tp * dp)  # (tp, dp, pp), Megatron order


def test_scenarios_are_reproducible_disjoint_between_splits_and_in_range():
    design = plan_scenarios("design", runs_per_kind=30, clean_runs=50)
    assert design == plan_scenarios("design", runs_per_kind=30, clean_runs=50)
    heldout = plan_scenarios("heldout", runs_per_kind=30, clean_runs=50)
    splits = [design] + [plan_scenarios(s, runs_per_kind=30, clean_runs=50) for s in HELDOUT_SPLITS]
    for a, b in itertools.combinations(splits, 2):
        assert {sc.seed for sc in a}.isdisjoint({sc.seed for sc in b})
    assert [sc.kind for sc in design[:5]] == list(KINDS)  # interleaved: a partial run covers every kind
    assert sum(sc.kind == "none" for sc in design) == 50 and len(design) == 50 + 4 * 30
    assert len({sc.name for sc in design}) == len(design)
    assert {sc.layout for sc in heldout} == {
        "engine tp1 pp2 dp2",
        "engine tp2 pp1 dp2",
        "engine tp2 pp2 dp1",
        "engine tp1 pp4 dp1",
        "ddp dp4",
        "ddp dp2",
    }
    for sc in design + heldout:
        f = sc.fault
        assert sc.nproc <= 4 and sc.nproc % (sc.tp * sc.pp) == 0
        if sc.kind in ("compute", "intermittent", "two_faults"):
            assert 1.2 <= f.factor <= 2.0 and 0 <= f.rank < sc.nproc
        if sc.kind in ("link", "two_faults"):  # a directed link between neighbouring stages of one pipeline
            (t0, d0, p0), (t1, d1, p1) = _coords(f.link[0], sc), _coords(f.link[1], sc)
            assert sc.source == "engine" and 2.0 <= f.delay_ms <= 50.0
            assert (t0, d0) == (t1, d1) and abs(p0 - p1) == 1
        assert (2 <= f.every <= 4) if sc.kind == "intermittent" else f.every == 1
        assert sc.truth() == set() if sc.kind == "none" else sc.truth()


def test_a_larger_plan_extends_a_smaller_one():
    small = plan_scenarios("heldout", runs_per_kind=2, clean_runs=3)
    large = plan_scenarios("heldout", runs_per_kind=30, clean_runs=50)
    assert set(small) <= set(large)
    some = plan_scenarios("heldout2", runs_per_kind=30, clean_runs=50, kinds=("intermittent", "none"))
    assert {sc.kind for sc in some} == {"intermittent", "none"} and len(some) == 80
    assert set(some) <= set(plan_scenarios("heldout2", runs_per_kind=30, clean_runs=50))
    with pytest.raises(ValueError, match="kinds"):
        plan_scenarios("heldout2", 1, 1, kinds=("slow",))
    with pytest.raises(ValueError, match="split"):
        draw_scenario("test", 0, "none")
    with pytest.raises(ValueError, match="kind"):
        draw_scenario("design", 0, "slow")


def test_wilson_interval_matches_reference_values():
    assert wilson(0, 0) is None
    assert wilson(10, 10) == (0.722, 1.0)
    assert wilson(5, 10) == (0.237, 0.763)
    assert wilson(29, 30) == (0.833, 0.994)  # statsmodels proportion_confint(29, 30, method="wilson")
    assert wilson(0, 50) == (0.0, 0.071)  # zero false alarms in 50 clean runs: still up to 7 %
    lo_small, hi_small = wilson(9, 10)
    lo_big, hi_big = wilson(90, 100)
    assert lo_small < lo_big < 0.9 < hi_big < hi_small  # narrower with more runs, around p


def _suspect(cause, where):
    return {
        "cause": cause,
        "rank": where if cause == "slow_compute" else where[0],
        "link": list(where) if cause == "slow_link" else None,
        "confidence": 0.9,
    }


def test_scores_separate_recall_precision_root_cause_false_alarms_and_causes():
    two = Scenario("design", 0, "two_faults", "engine", 1, 2, 4, Fault(rank=1, factor=1.5, link=(0, 2), delay_ms=5))
    comp = Scenario("design", 1, "compute", "engine", 1, 2, 4, Fault(rank=3, factor=1.5))
    link = Scenario("design", 2, "link", "engine", 2, 2, 4, Fault(link=(0, 2), delay_ms=9))
    clean = Scenario("design", 3, "none", "ddp", 1, 1, 2)
    results = [
        (two, [_suspect("slow_compute", 1), _suspect("slow_link", (0, 2))]),
        (comp, [_suspect("slow_compute", 3), _suspect("slow_compute", 2)]),  # a victim named too
        (link, []),  # missed
        (clean, [_suspect("slow_compute", 0)]),
    ]
    s = compute_scores(results)
    assert s["two_faults"]["recall"]["k"] == 1 and s["two_faults"]["root_cause_accuracy"]["k"] == 1
    assert (s["compute"]["recall"]["k"], s["compute"]["precision"]["k"], s["compute"]["precision"]["n"]) == (1, 1, 2)
    assert s["compute"]["root_cause_accuracy"]["k"] == 0
    assert s["link"]["recall"] == {"value": 0.0, "k": 0, "n": 1, "ci95": wilson(0, 1)}
    assert s["none"]["false_alarm_rate"] == {"value": 1.0, "k": 1, "n": 1, "ci95": wilson(1, 1)}
    # per cause over all runs: compute verdicts 1, 2 (victim), 3, 0 (false alarm) -> 2 of 4 true
    assert (s["slow_compute"]["recall"]["k"], s["slow_compute"]["recall"]["n"]) == (2, 2)
    assert (s["slow_compute"]["precision"]["k"], s["slow_compute"]["precision"]["n"]) == (2, 4)
    assert (s["slow_link"]["recall"]["k"], s["slow_link"]["recall"]["n"]) == (1, 2)
    layouts = compute_layout_scores(results)
    assert layouts["engine tp1 pp2 dp2"]["root_cause_accuracy"]["k"] == 1
    assert layouts["engine tp1 pp2 dp2"]["root_cause_accuracy"]["n"] == 2
    assert layouts["ddp dp2"]["false_alarm_rate"]["k"] == 1


def test_tuning_prefers_no_false_alarms_then_root_cause_accuracy():
    def scores(alarms, accuracy):
        return {
            "none": {"false_alarm_rate": {"k": alarms}},
            **{k: {m: {"value": accuracy, "n": 1} for m in ("recall", "root_cause_accuracy")} for k in KINDS[1:]},
        }

    grid = [
        ({"compute_min_ratio": 1.1}, scores(2, 1.0)),
        ({"compute_min_ratio": 1.2}, scores(0, 0.8)),
        ({"compute_min_ratio": 1.3}, scores(0, 0.8)),
    ]
    assert select_thresholds(grid) == {"compute_min_ratio": 1.3}


def test_tuning_combines_compute_and_link_points_and_only_on_design():
    nc, nl = len(core.COMPUTE_GRID), len(core.LINK_GRID)
    comp = Scenario("design", 0, "compute", "engine", 1, 2, 4, Fault(rank=2, factor=1.3))
    link = Scenario("design", 1, "link", "engine", 1, 2, 4, Fault(link=(1, 3), delay_ms=4))
    clean = Scenario("design", 2, "none", "engine", 1, 2, 4)
    # rank 2 found only at compute point 3; clean run alarmed at points < 3; link found at link points 0-2
    runs = [
        (comp, [[2] if i == 3 else [] for i in range(nc)], [[] for _ in range(nl)]),
        (link, [[] for _ in range(nc)], [[[1, 3]] if j < 3 else [] for j in range(nl)]),
        (clean, [[0] if i < 3 else [] for i in range(nc)], [[] for _ in range(nl)]),
    ]
    best, scores = tune_on_design(runs)
    assert best == {**core.COMPUTE_GRID[3], **core.LINK_GRID[2]}  # most conservative link point that finds it
    assert scores["none"]["false_alarm_rate"]["k"] == 0 and scores["compute"]["recall"]["k"] == 1
    assert core.named_causes(combine_grid_suspects([2], [[1, 3]])) == {("slow_compute", 2), ("slow_link", (1, 3))}
    with pytest.raises(ValueError, match="design"):
        tune_on_design([(Scenario("heldout", 0, "none", "ddp", 1, 1, 2), [[]] * nc, [[]] * nl)])


def test_results_file_survives_a_kill_mid_line(tmp_path):
    path = tmp_path / "r.jsonl"
    runner.append_record(path, {"name": "a", "thresholds": {}})
    runner.append_record(path, {"name": "b", "thresholds": {}})
    with open(path, "a") as f:
        f.write('{"name": "c", "thre')  # killed while writing
    assert [r["name"] for r in runner.load_records(path)] == ["a", "b"]
    assert scan_eval._prepare_results(path, resume=True, overrides={}) == {"a", "b"}
    runner.append_record(path, {"name": "d", "thresholds": {}})  # the partial line was cut first
    assert [r["name"] for r in runner.load_records(path)] == ["a", "b", "d"]
    with pytest.raises(scan_eval.UsageError, match="--resume"):
        scan_eval._prepare_results(path, resume=False, overrides={})
    with pytest.raises(scan_eval.UsageError, match="other thresholds"):
        scan_eval._prepare_results(path, resume=True, overrides={"compute_min_ratio": 1.3})
    path.write_text('{"name": "a"}\nnot json\n{"name": "b"}\n')
    with pytest.raises(ValueError, match=":2:"):
        runner.load_records(path)


def test_bad_invocations_are_one_line_errors(tmp_path, capsys):
    bogus = tmp_path / "t.json"
    bogus.write_text('{"overrides": {}}')
    cases = [
        ["run", "--split", "heldout", "--results", str(tmp_path / "h.jsonl")],
        ["run", "--split", "heldout2", "--results", str(tmp_path / "h.jsonl")],
        ["run", "--split", "heldout", "--results", str(tmp_path / "h.jsonl"), "--thresholds", str(bogus)],
        ["run", "--split", "design", "--results", str(tmp_path / "d.jsonl"), "--jobs", "0"],
        ["summarize", str(tmp_path / "missing.jsonl")],
    ]
    for argv in cases:
        assert scan_eval.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("scan_eval: error:") and err.count("\n") == 1


def test_synthetic_design_tune_heldout_summarize(tmp_path, capsys, monkeypatch):
    compute_grid, link_grid = core.COMPUTE_GRID[4:6], core.LINK_GRID[3:5]  # the full grid is for real evaluations
    for module in (core, runner, scan_eval):
        monkeypatch.setattr(module, "COMPUTE_GRID", compute_grid)
        monkeypatch.setattr(module, "LINK_GRID", link_grid)
    design, heldout, thresholds = tmp_path / "d.jsonl", tmp_path / "h.jsonl", tmp_path / "t.json"
    common = ["--runs-per-kind", "1", "--clean-runs", "1", "--jobs", "1", "--synthetic"]
    assert scan_eval.main(["run", "--split", "design", "--results", str(design), *common]) == 0
    assert scan_eval.main(["tune", str(design), "--out", str(thresholds)]) == 0
    tuned = json.loads(thresholds.read_text())
    assert tuned["design_runs"] == 5 and tuned["tuned_on_split"] == "design"
    assert (
        scan_eval.main(
            ["run", "--split", "heldout", "--results", str(heldout), "--thresholds", str(thresholds), *common]
        )
        == 0
    )
    assert (
        scan_eval.main(
            [
                "run",
                "--split",
                "heldout",
                "--results",
                str(heldout),
                "--thresholds",
                str(thresholds),
                "--resume",
                *common,
            ]
        )
        == 0
    )
    assert "5 done already" in capsys.readouterr().out
    records = runner.load_records(heldout)
    assert len(records) == 5 and all(r["thresholds"] == tuned["overrides"] for r in records)
    assert scan_eval.main(["tune", str(heldout), "--out", str(tmp_path / "x.json")]) == 2  # never on heldout
    assert scan_eval.main(["summarize", str(heldout)]) == 0
    md = (tmp_path / "h.md").read_text()
    assert "slow link 2-50 ms | 1 |" in md and "(seed 917450311)" in md
    assert (tmp_path / "h.png").stat().st_size > 10_000
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["scores"]["none"]["false_alarm_rate"]["n"] == 1


def test_rejudge_compares_recorded_and_current_verdicts_on_kept_traces(tmp_path, capsys):
    results, work = tmp_path / "r.jsonl", tmp_path / "work"
    argv = [
        "run",
        "--split",
        "heldout2",
        "--kinds",
        "intermittent,none",
        "--runs-per-kind",
        "1",
        "--clean-runs",
        "1",
        "--jobs",
        "1",
        "--synthetic",
        "--default-thresholds",
        "--keep-traces",
        "--work-dir",
        str(work),
        "--results",
        str(results),
    ]
    assert scan_eval.main(argv) == 0
    assert {r["kind"] for r in runner.load_records(results)} == {"intermittent", "none"}
    capsys.readouterr()
    assert scan_eval.main(["rejudge", str(results), "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "heldout2-0002-intermittent" in out and ("none engine" in out or "none ddp" in out)
    assert "1 runs: exact verdicts recorded" in out
    assert scan_eval.main(["rejudge", str(results), "--work-dir", str(tmp_path / "empty")]) == 2
    # --out: today's verdicts as a results file that summarize scores (the recorded ones tampered with first)
    records = runner.load_records(results)
    tampered = tmp_path / "t.jsonl"
    tampered.write_text(
        "".join(
            json.dumps({**r, "default_suspects": [{"cause": "slow_link", "rank": 0, "link": [0, 1]}]}) + "\n"
            for r in records
        )
    )
    out_file = tmp_path / "now.jsonl"
    assert scan_eval.main(["rejudge", str(tampered), "--work-dir", str(work), "--out", str(out_file)]) == 0
    now = runner.load_records(out_file)
    assert [r["name"] for r in now] == [r["name"] for r in records] and all(r["rejudged"] for r in now)
    assert [r["default_suspects"] for r in now] == [r["default_suspects"] for r in records]
    assert scan_eval.main(["summarize", str(out_file), "--default-thresholds"]) == 0


def test_a_skipped_layout_is_left_out_of_the_plan_and_a_bad_one_refused(tmp_path, capsys):
    plan = core.plan_scenarios("heldout4", 10, 10, sources=core.sources_without(("ddp dp4",)))
    layouts = {sc.layout for sc in plan}
    assert "ddp dp4" not in layouts and "ddp dp2" in layouts
    assert (
        scan_eval.main(
            [
                "run",
                "--split",
                "heldout4",
                "--skip-layout",
                "ddp dp8",
                "--default-thresholds",
                "--synthetic",
                "--results",
                str(tmp_path / "r.jsonl"),
            ]
        )
        == 2
    )
    assert "unknown layouts ['ddp dp8']" in capsys.readouterr().err
