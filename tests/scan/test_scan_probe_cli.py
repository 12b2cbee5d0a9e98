"""`megatronapp trace probe`, and the link probe at the end of traced jobs (`train --trace`, `trace run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatronapp.cli.main import build_checked_run, main
from megatronapp.scan.probe_config import PROBE_FILE
from megatronapp.scan.probe_job import probe_program_links

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "megatronapp.cli.main", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)


@pytest.mark.slow
def test_trace_probe_measures_both_directed_links_of_two_ranks(tmp_path):
    out = tmp_path / "probe.json"
    args = ["trace", "probe", "--nproc-per-node", "2", "--probe-payload-mb", "0.2", "--probe-repeats", "2"]
    res = _run([*args, "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    links = json.loads(out.read_text())["links"]
    assert sorted((m["src"], m["dst"]) for m in links) == [(0, 1), (1, 0)]
    assert all(m["mbytes_per_s"] > 0 and m["kind"] == "data" for m in links)
    rows = [line.split() for line in res.stdout.splitlines() if "->" in line]
    assert [r[:3] for r in rows] == [["0", "->", "1"], ["1", "->", "0"]]
    for row in rows:  # MB/s beside the other link's MB/s (its comparable links' median), and their ratio
        assert float(row[6]) == pytest.approx(float(row[4]) / float(row[5]), abs=0.01)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "2", "--probe-repeats", "0"], "--probe-repeats must be >= 1, got 0"),
        (["--nproc-per-node", "2", "--probe-payload-mb", "-1"], "--probe-payload-mb must be in (0, 1024] MB"),
        (["--nproc-per-node", "2", "--probe-payload-mb", "x"], "argument --probe-payload-mb: invalid float value"),
        (["--nproc-per-node", "1"], "trace probe needs at least 2 ranks"),
        (["--nproc-per-node", "4", "--pipeline-model-parallel-size", "3"], "world size 4 is not divisible"),
        (["--nproc-per-node", "2", "--out", "/no/such/folder/p.json"], "folder /no/such/folder does not exist"),
    ],
)
def test_trace_probe_refuses_bad_values_in_one_line(flags, message, monkeypatch, capsys):
    monkeypatch.setattr("megatronapp.scan.probe_run.run_local_ranks", lambda *a, **k: pytest.fail("ranks started"))
    try:
        with warnings.catch_warnings():  # main's @record wants a real stderr for faulthandler
            warnings.filterwarnings("ignore", "Unable to enable fault handler")
            code = main(["trace", "probe", *flags])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize(
    ("flags", "probes"),
    [
        (["--pipeline-model-parallel-size", "2"], True),
        ([], False),
        (["--pipeline-model-parallel-size", "2", "--trace-probe", "off"], False),
        (["--trace-probe", "on"], True),
    ],
    ids=["pp2-auto", "dp2-auto", "pp2-off", "dp2-on"],
)
def test_a_traced_job_probes_where_its_mode_and_layout_say(flags, probes, monkeypatch):
    from megatronapp.cli import train

    calls = []
    monkeypatch.setattr("megatronapp.scan.probe_job.probe_traced_job", lambda *args: calls.append(args))
    base = ["train", "--device", "cpu", "--model", "tiny", "--nproc-per-node", "2", "--trace"]
    run = build_checked_run([*base, *flags])
    train._probe_links(run, 0, "cpu")
    assert bool(calls) == probes
    if probes:
        assert {(a, b) for a, b, _ in calls[0][1]} == {(0, 1), (1, 0)}


def test_a_program_traced_with_the_probe_off_runs_no_collective():
    """No process group here: any collective would raise."""
    assert probe_program_links("runs/x", "off", {(0, 1)}, 0, 2, "cpu") == "skipped"


@pytest.mark.slow
def test_traced_pp2_training_writes_the_link_probe(tmp_path):
    args = ["train", "--device", "cpu", "--model", "tiny", "--seq-length", "32", "--hidden-size", "32"]
    args += ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    args += ["--global-batch-size", "2", "--micro-batch-size", "1", "--trace", "--trace-dir", "t"]
    res = _run(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    links = json.loads((tmp_path / "t" / PROBE_FILE).read_text())["links"]
    assert sorted((m["src"], m["dst"], m["kind"]) for m in links) == [(0, 1, "pipeline"), (1, 0, "pipeline")]
    assert "Links measured (link probe)" in res.stdout


@pytest.mark.slow
def test_a_traced_program_with_point_to_point_messages_writes_the_link_probe(tmp_path):
    script = ROOT / "tests" / "scan" / "scripts" / "two_stage_pipeline.py"
    res = _run(["trace", "run", "--nproc-per-node", "2", "--trace-dir", "t", "--json", "--", str(script)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    links = json.loads((tmp_path / "t" / PROBE_FILE).read_text())["links"]
    assert sorted((m["src"], m["dst"]) for m in links) == [(0, 1), (1, 0)]
    report = json.loads(res.stdout[res.stdout.index("{") :])
    assert [(r["src"], r["dst"]) for r in report["links_measured"]] == [(0, 1), (1, 0)]
