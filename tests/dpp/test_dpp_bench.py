"""benchmarks/dpp_bench.py's bookkeeping: every cell on disk as soon as it is measured, the
time budget, failures recorded (the train jobs themselves are replaced by a stub)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dpp_bench  # noqa: E402


def test_each_cell_is_written_when_measured_and_failures_are_kept(tmp_path, monkeypatch):
    seen_on_disk = []
    log = tmp_path / "dpp_bench.jsonl"

    def fake_run_once(a, variant, scenario, repeat=0):
        seen_on_disk.append(len(log.read_text().splitlines()) if log.exists() else 0)
        if (scenario, variant) == ("link", "breadth-first"):
            raise subprocess.TimeoutExpired("train", 1)
        return [0.5, 0.4, 0.6] if variant == "interleaved" else [0.25]

    monkeypatch.setattr(dpp_bench, "run_once", fake_run_once)
    assert dpp_bench.main(["--isolated", "--out", str(tmp_path), "--repeats", "2"]) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    # 2 repeats x 4 scenarios x 5 default variants; cell k saw k cells on disk
    assert len(lines) == 2 * 4 * 5 and seen_on_disk == list(range(40))
    failed = [r for r in lines if "error" in r]
    assert {(r["scenario"], r["variant"]) for r in failed} == {("link", "breadth-first")} and len(failed) == 2
    summary = json.loads((tmp_path / "dpp_bench.json").read_text())["results"]
    assert summary["jitter1/dynamic-df"]["speed_vs_interleaved"] == 2.0  # 0.5 s median vs 0.25 s
    assert summary["balanced/interleaved"]["peak_inflight_sets"] == [11, 9, 7, 5]
    assert "link/breadth-first" not in summary


def test_budget_stops_starting_cells(tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 100))  # each call to time.time() advances 100 s
    monkeypatch.setattr(dpp_bench.time, "time", lambda: next(clock))
    monkeypatch.setattr(dpp_bench, "run_once", lambda a, v, s, r=0: [0.1])
    dpp_bench.main(["--isolated", "--out", str(tmp_path), "--budget-s", "1000"])
    lines = (tmp_path / "dpp_bench.jsonl").read_text().splitlines()
    assert 0 < len(lines) < 32


def test_persistent_ranks_run_every_cell_one_after_the_other(tmp_path):
    """The default mode: one launched set of ranks runs all cells (static and dynamic schedules,
    with and without jitter) with fresh groups per cell; every cell's record reaches the JSONL.
    --trace-cells adds a traced pass that the statistics leave out and dpp_trace_gap.py reads."""
    code = dpp_bench.main(["--smoke", "--out", str(tmp_path), "--variants", "interleaved", "dynamic-df",
                           "--timeout", "240", "--trace-cells"])
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "dpp_bench.jsonl").read_text().splitlines()]
    cells = [("balanced", "dynamic-df"), ("balanced", "interleaved"), ("jitter1", "dynamic-df"),
             ("jitter1", "interleaved")]
    measured = [r for r in lines if r["repeat"] == 0]
    assert sorted((r["scenario"], r["variant"]) for r in measured) == cells
    assert sorted((r["scenario"], r["variant"]) for r in lines if r["repeat"] == dpp_bench.TRACED_REPEAT) == cells
    for r in lines:
        assert "error" not in r and len(r["steps_s"]) == 3 and all(t > 0 for t in r["steps_s"])
    # a cell leaves no thread or connection behind (the first may start lazily made ones)
    state = [(r["process"]["threads"], r["process"]["fds"]) for r in measured]
    assert state[1] == state[2] == state[3], state
    summary = json.loads((tmp_path / "dpp_bench.json").read_text())["results"]
    assert all(len(summary[f"{s}/{v}"]["runs_s"]) == 1 for s, v in cells)  # the traced pass is not counted

    import dpp_trace_gap

    result = dpp_trace_gap.analyse(dpp_trace_gap.load_cells(tmp_path, warmup=2), seeds=2)
    assert set(result) == {"balanced", "jitter1"}
    for scenario, rows in result.items():
        assert set(rows) == {"interleaved", "dynamic-df"}
        for row in rows.values():
            assert row["iterations"] == 3 and row["measured_ms"] > 0 and row["predicted_ms"] > 0
            assert all(0 < b <= 1 for b in row["busy"])
        assert rows["dynamic-df"]["measured_speed"] > 0 and rows["dynamic-df"]["predicted_speed"] > 0
    # the jitter the cell ran with reaches the simulator, on the traced pipeline's pp ranks
    traced = dpp_trace_gap.load_cells(tmp_path, warmup=2)[("jitter1", "interleaved")]
    assert [(j.rank, j.max_factor) for j in dpp_trace_gap.injections(traced, 0)["jitter"]] == [(1, 1.5)]


def test_paired_speeds_divide_within_a_repeat_and_skip_unpaired_repeats():
    rec = lambda v, rep, t: {"scenario": "jitter1", "variant": v, "repeat": rep, "median_s": t}  # noqa: E731
    records = [rec("interleaved", 0, 0.6), rec("dynamic-inorder", 0, 0.5),  # 1.2
               rec("interleaved", 1, 0.9), rec("dynamic-inorder", 1, 1.0),  # 0.9: a slow repeat for both
               rec("dynamic-inorder", 2, 0.1),  # its interleaved cell failed: no pair
               {"scenario": "link", "variant": "interleaved", "repeat": 2, "median_s": 0.05}]
    assert dpp_bench.paired_speeds(records, "jitter1", "dynamic-inorder") == [1.2, 0.9]
    summary = dpp_bench._paired_summary(records, "jitter1", "dynamic-inorder")
    assert summary["n"] == 2 and summary["median"] == 1.05


def test_trace_gap_takes_the_jitter_out_of_a_jittered_ranks_task_times():
    """The simulator draws a cell's jitter again, so the jittered rank's traced mean is divided
    by the mean factor (1 + 1.5) / 2 first; other ranks' times are kept as traced."""
    import dpp_trace_gap

    from megatronapp.dpp.sim.simulator import Span
    from megatronapp.dpp.tasks import backward_task, forward_task
    from megatronapp.dpp.sim.trace_costs import TracedRun

    spans = [Span(0, forward_task(0, 0), 0.0, 0.010), Span(1, forward_task(0, 0), 0.011, 0.036),
             Span(1, backward_task(0, 0), 0.036, 0.086), Span(0, backward_task(0, 0), 0.087, 0.107)]
    run = TracedRun(2, 1, 1, "1f1b", {0: spans}, {"inject_jitter": ["1:1.5:3"]}, 1)
    cost = dpp_trace_gap.dejittered_costs(run)
    assert [round(x[0], 6) for x in cost.forward_s] == [0.010, 0.020]
    assert [round(x[0], 6) for x in cost.backward_s] == [0.020, 0.040]
    (jitter,) = dpp_trace_gap.injections(run, 2)["jitter"]
    assert (jitter.rank, jitter.max_factor, jitter.seed) == (1, 1.5, 2 * 1 + 3)  # another draw per seed


def test_gpu_cells_need_a_gpu_per_rank_and_pass_the_device_on(capsys, monkeypatch):
    import pytest
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(SystemExit):
        dpp_bench.parse_args(["--device", "cuda"])  # 8 ranks by default
    assert "--device cuda needs one GPU per rank: 8 ranks, 4 GPUs visible" in capsys.readouterr().err
    a = dpp_bench.parse_args(["--device", "cuda", "--smoke"])  # 2 ranks
    argv = dpp_bench._train_argv(a, "dynamic-inorder", "balanced", "m.jsonl")
    assert argv[argv.index("--device") + 1] == "cuda"
