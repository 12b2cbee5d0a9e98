"""Frozen evaluation (megatronapp/faultlab/evaluation/frozen*.py): the detector version is recorded before the
split's scenarios exist, a split runs once, its report carries both hashes, and a split is never
scored by a detector other than the one it was frozen with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megatronapp.faultlab.evaluation.cli as scan_eval
import megatronapp.faultlab.evaluation.frozen as frozen
import megatronapp.faultlab.evaluation.frozen_run as frozen_run
from megatronapp.faultlab.evaluation.injected_runner import append_record


def _frozen_split(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    thresholds = tmp_path / "thresholds.json"
    frozen.write_default_thresholds(thresholds)
    monkeypatch.setattr(
        frozen,
        "detector_version",
        lambda path: {
            "commit": "a" * 40,
            "dirty": False,
            "thresholds_sha256": frozen.hashlib.sha256(Path(path).read_bytes()).hexdigest(),
        },
    )
    split = tmp_path / "split"
    frozen.freeze_split(split, thresholds, runs_per_kind=2, clean_runs=4)
    return split, thresholds


def test_the_thresholds_file_holds_every_detector_threshold(tmp_path):
    path = tmp_path / "t.json"
    frozen.write_default_thresholds(path)
    values = json.loads(path.read_text())
    assert {"compute_min_ratio", "arrival_min_excess_share", "link_min_ratio", "intermittent_alpha"} <= set(values)
    del values["arrival_min_excess_share"]
    path.write_text(json.dumps(values))
    with pytest.raises(frozen.FrozenSplitError, match="missing \\['arrival_min_excess_share'\\]"):
        frozen.load_thresholds(path)


def test_a_split_records_the_detector_and_draws_every_kind_and_layout_family(tmp_path, monkeypatch):
    split, _ = _frozen_split(tmp_path, monkeypatch)
    doc = json.loads((split / "split.json").read_text())
    assert doc["detector"]["commit"] == "a" * 40 and len(doc["detector"]["thresholds_sha256"]) == 64
    kinds = [s["kind"] for s in doc["scenarios"]]
    assert {k: kinds.count(k) for k in frozen.KINDS} == {
        "none": 2,
        "noise": 2,
        "slow_rank": 2,
        "intermittent": 2,
        "user_straggler": 2,
        "slow_link": 2,
        "two_faults": 2,
    }
    for sc in doc["scenarios"]:
        if sc["kind"] in ("slow_link", "two_faults"):
            link = next(t[1] for t in sc["truth"] if t[0] == "slow_link")
            tp, pp, dp = (int(part[2:]) for part in sc["layout"].split()[1:])
            assert sc["nodes"] == tp * pp * dp and abs(link[0] - link[1]) == tp * dp  # pipeline neighbours
    with pytest.raises(frozen.FrozenSplitError, match="already frozen"):
        frozen.freeze_split(split, tmp_path / "thresholds.json", 1, 1)


def test_rescoring_a_split_with_a_different_detector_is_refused(tmp_path, monkeypatch):
    split, thresholds = _frozen_split(tmp_path, monkeypatch)
    append_record(
        split / "results.jsonl",
        {"index": 0, "kind": "none", "layout": "engine TP1 PP2 DP2", "truth": [], "error": "", "suspects": []},
    )
    scores = frozen_run.score_split(split)
    assert scores["detector"]["commit"] == "a" * 40 and scores["kind"]["none"]["false_alarm"]["n"] == 1
    values = json.loads(thresholds.read_text())
    values["compute_min_ratio"] = 1.25  # tuned after the split was drawn
    thresholds.write_text(json.dumps(values))
    with pytest.raises(frozen.FrozenSplitError, match="frozen with another detector .*thresholds_sha256"):
        frozen_run.score_split(split)
    assert scan_eval.main(["frozen", "score", str(split)]) == 2


def test_a_split_runs_once(tmp_path, monkeypatch):
    split, _ = _frozen_split(tmp_path, monkeypatch)
    (split / "results.jsonl").write_text("")
    with pytest.raises(frozen.FrozenSplitError, match="has run already"):
        frozen_run.run_split(split, tmp_path / "work")


def test_a_cut_split_resumes_with_the_runs_it_has_not_recorded(tmp_path, monkeypatch):
    split, _ = _frozen_split(tmp_path, monkeypatch)
    scenarios = json.loads((split / "split.json").read_text())["scenarios"]
    ran = []

    def fake_run(sc, thresholds, work_dir, timeout_s, keep_traces=False):
        ran.append(sc["index"])
        return {
            "index": sc["index"],
            "kind": sc["kind"],
            "layout": sc["layout"],
            "truth": sc["truth"],
            "error": "",
            "suspects": [],
        }

    monkeypatch.setattr(frozen_run, "run_scenario", fake_run)
    results = split / "results.jsonl"
    append_record(results, fake_run(scenarios[0], {}, None, 0))
    with results.open("a") as f:
        f.write('{"index": 1, "kind"')  # a run killed while its line was written
    ran.clear()
    frozen_run.run_split(split, tmp_path / "work", log=lambda _: None, resume=True)
    assert ran == [sc["index"] for sc in scenarios[1:]]
    assert [r["index"] for r in frozen_run.load_records(results)] == [sc["index"] for sc in scenarios]
    ran.clear()
    frozen_run.run_split(split, tmp_path / "work", log=lambda _: None, resume=True)
    assert ran == []  # nothing is ever run twice


def test_slow_links_of_a_split_run_either_way_at_degraded_rates():
    links = [sc for sc in frozen.plan_split(seed=5, runs_per_kind=40, clean_runs=0) if sc["kind"] == "slow_link"]
    faults = [next(f for f in sc["faults"] if f["type"] == "slow_link") for sc in links]
    assert {f["rate_mbit"] for f in faults} == set(frozen.LINK_RATES_MBIT)
    assert any(f["src"] < f["dst"] for f in faults) and any(f["src"] > f["dst"] for f in faults)
    assert "engine TP2 PP2 DP2" in {sc["layout"] for sc in links}


def test_scores_per_kind_and_layout_with_intervals():
    recs = [
        {
            "kind": "slow_rank",
            "layout": "L1",
            "truth": [["slow_compute", 1]],
            "error": "",
            "suspects": [{"cause": "slow_compute", "rank": 1, "link": None}],
        },
        {
            "kind": "slow_rank",
            "layout": "L2",
            "truth": [["slow_compute", 2]],
            "error": "",
            "suspects": [{"cause": "slow_compute", "rank": 0, "link": None}],
        },
        {
            "kind": "slow_link",
            "layout": "L1",
            "truth": [["slow_link", [0, 2]]],
            "error": "",
            "suspects": [{"cause": "slow_link", "rank": 0, "link": [0, 2]}],
        },
        {"kind": "noise", "layout": "L2", "truth": [], "error": "", "suspects": []},
        {"kind": "none", "layout": "L1", "truth": [], "error": "job exit 1", "suspects": []},
    ]
    s = frozen_run.score_records(recs)
    assert s["kind"]["slow_rank"]["recall"]["k"] == 1 and s["kind"]["slow_rank"]["recall"]["n"] == 2
    assert s["kind"]["slow_link"]["top1"]["value"] == 1.0
    assert s["layout"]["L2"]["false_alarm"] == {"value": 0.0, "k": 0, "n": 1, "ci95": (0.0, 0.793)}
    assert "none" not in s["kind"]  # a failed run is not scored


def test_intermittent_scenarios_run_long_enough_to_meet_several_bursts_and_clean_runs_cover_both_lengths():
    """300 ms of every 1-2 s against 20 iterations of ~16-150 ms: the fault could miss training
    altogether (design runs read 0.3 s of training, one burst at most)."""
    scenarios = frozen.plan_split(seed=11, runs_per_kind=6, clean_runs=40)
    iters = {}
    for sc in scenarios:
        if "iters" in sc["job"]:
            iters.setdefault(sc["kind"], set()).add(sc["job"]["iters"])
    assert iters["intermittent"] == {frozen.LONG_ITERATIONS} and iters["slow_rank"] == {frozen.SHORT_ITERATIONS}
    assert iters["none"] | iters["noise"] == {frozen.SHORT_ITERATIONS, frozen.LONG_ITERATIONS}
    plan = frozen_run.build_plan(next(s for s in scenarios if s["kind"] == "intermittent"))
    assert plan.job.iters == frozen.LONG_ITERATIONS


def test_a_split_can_hold_fewer_runs_of_one_fault_kind(tmp_path, monkeypatch):
    thresholds = tmp_path / "thresholds.json"
    frozen.write_default_thresholds(thresholds)
    monkeypatch.setattr(
        frozen, "detector_version", lambda path: {"commit": "a" * 40, "dirty": False, "thresholds_sha256": "b" * 64}
    )
    argv = [
        "frozen",
        "freeze",
        str(tmp_path / "s"),
        "--thresholds",
        str(thresholds),
        "--runs-per-kind",
        "3",
        "--clean-runs",
        "4",
        "--kind-runs",
        "two_faults=1",
    ]
    assert scan_eval.main(argv) == 0
    kinds = [s["kind"] for s in json.loads((tmp_path / "s" / "split.json").read_text())["scenarios"]]
    assert kinds.count("two_faults") == 1 and kinds.count("slow_link") == 3 and kinds.count("none") == 2
    assert scan_eval.main([*argv[:2], str(tmp_path / "t"), *argv[3:-1], "clean=2"]) == 2  # not a fault kind


def test_only_a_split_that_kept_every_trace_is_judged_again_and_its_verdicts_are_todays(tmp_path, monkeypatch):
    import types

    import megatronapp.scan.analyze.load_align_detect as lad

    split, _ = _frozen_split(tmp_path, monkeypatch)
    scenarios = json.loads((split / "split.json").read_text())["scenarios"][:3]
    for sc in scenarios:
        append_record(split / "results.jsonl", {**sc, "error": "", "suspects": []})
    work = tmp_path / "work"
    for sc in scenarios[:2]:
        (work / f"run{sc['index']}" / "trace").mkdir(parents=True)
    with pytest.raises(frozen.FrozenSplitError, match="kept no trace"):
        frozen_run.rejudge_split(split, work)  # a held-out split deletes the traces it judged right
    (work / f"run{scenarios[2]['index']}" / "trace").mkdir(parents=True)
    named = types.SimpleNamespace(rank=1, cause="slow_compute", link=None)
    detection = types.SimpleNamespace(suspects=(named,), below_impact=())
    monkeypatch.setattr(lad, "analyze_trace_dir", lambda path: types.SimpleNamespace(detection=detection))
    records = frozen_run.rejudge_split(split, work)
    assert [r["suspects"] for r in records] == [[{"cause": "slow_compute", "rank": 1, "link": None}]] * 3
    assert json.loads((split / "results.jsonl").read_text().splitlines()[0])["suspects"] == []  # the split untouched
