"""MegaDPP through the command line: a traced dynamic run (flags wired into the trainer), the
in-flight cap checked from the merged trace, `schedule simulate|show` on that trace, bad
flags refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megatronapp.cli.main import main

CLI = [sys.executable, "-m", "megatronapp.cli.main"]


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpp")
    res = _run(
        [
            "train",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--pipeline-schedule",
            "dynamic",
            "--dpp-traversal",
            "adaptive",
            "--dpp-max-inflight",
            "3",
            "--inject-jitter",
            "1:2.0:5",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "3",
            "--trace",
            "--trace-dir",
            str(d / "t"),
            "--metrics-file",
            str(d / "m.jsonl"),
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return d


def test_merged_trace_shows_decisions_within_the_cap(traced_run):
    out = traced_run / "timeline.json"
    res = _run(["trace", "merge", str(traced_run / "t"), "-o", str(out)])
    assert res.returncode == 0, res.stderr
    events = json.loads(out.read_text())["traceEvents"]
    decided = [
        e
        for e in events
        if e.get("ph") == "X"
        and e["name"] in ("forward", "backward")
        and "inflight=" in e.get("args", {}).get("op", "")
    ]
    assert len(decided) >= 2 * 2 * 4  # every task of a traced iteration, on both ranks
    for e in decided:
        op = e["args"]["op"]
        assert re.match(r"(depth-first|breadth-first|tp-follow) inflight=\d+ ready=\[", op), op
        assert int(re.search(r"inflight=(\d+)", op).group(1)) <= 3  # held before the task ran
        assert "chunk" in e["args"] and "microbatch" in e["args"]
    losses = [json.loads(line)["loss"] for line in (traced_run / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_schedule_tools_read_the_trace(traced_run):
    res = _run(["schedule", "simulate", "--from-trace", str(traced_run / "t"), "--json"])
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["schedule"].startswith("dynamic") and report["iteration_s"] > 0
    png, chrome = traced_run / "real.png", traced_run / "real.json"
    res = _run(["schedule", "show", "--from-trace", str(traced_run / "t"), "--out", str(png), "--chrome", str(chrome)])
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tasks = [e for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(tasks) == 2 * 2 * 2 * 4  # F and B of 2 chunks x 4 microbatches on 2 ranks


_NO_FAULT_HANDLER = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # main() under capsys


@_NO_FAULT_HANDLER
@pytest.mark.parametrize(
    "args,message",
    [
        (["--dpp-max-inflight", "1"], "below the 2 activation sets"),
        (["--inject-jitter", "1:0.5"], "MAXFACTOR must be >= 1"),
        (["--inject-jitter", "9:1.5"], "outside world size"),
        (["--dpp-traversal", "in-order", "--dpp-max-inflight", "2"], "in-order traversal holds on pipeline rank 0"),
    ],
)
def test_bad_dpp_flags_fail_in_one_line_before_launch(args, message, capsys):
    code = main(
        [
            "train",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--pipeline-schedule",
            "dynamic",
            "--global-batch-size",
            "8",
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


@_NO_FAULT_HANDLER
@pytest.mark.parametrize(
    "args",
    [
        ["--pipeline-model-parallel-size", "0"],
        ["--forward-ms", "a"],
        ["--dpp-max-inflight", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
        ["--inject-jitter", "7:1.5", "--pipeline-model-parallel-size", "2"],
        ["--from-trace", "/nonexistent/dir"],
        ["--dpp-traversal", "in-order", "--dpp-max-inflight", "2"],
    ],
)
def test_schedule_simulate_refuses_bad_input_in_one_line(args, capsys):
    code = main(["schedule", "simulate", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("megatronapp: error:"), err


def test_dynamic_and_jitter_are_accepted_for_gpus():
    """Both used to be refused on CUDA; the checks before launch now let them through."""
    from engine_jobs import make_job

    from megatronapp.cli.injection import build_injection_config, check_injection
    from megatronapp.cli.main import build_parser
    from megatronapp.dpp.config import DPP_FLAGS, DppConfig
    from megatronapp.dpp.job_hooks import check_dpp_job
    from megatronapp.flags import read_flags

    job = make_job(2, 1, 2, 2, "dynamic", global_batch=8)
    args = build_parser().parse_args(
        ["train", "--model", "tiny", "--pipeline-schedule", "dynamic", "--device", "cuda", "--inject-jitter", "1:1.5"]
    )
    check_dpp_job(DppConfig(**read_flags(args, DPP_FLAGS)), job)
    injection = build_injection_config(args)
    check_injection(injection, 2, job.layout.world_size)
    assert injection.jitter[0].max_factor == 1.5


def test_jitter_names_a_global_rank_mapped_onto_the_simulated_pipeline():
    """As in `train`: with TP 2 x DP 2 x PP 2 the simulated pipeline (tp 0, dp 0) is global
    ranks 0 and 4; rank 4 is pipeline rank 1 there, rank 1 (tp 1) is not on it."""
    from megatronapp.dpp.cli import compute_pipeline_jitter
    from megatronapp.dpp.config import JitterSpec

    assert [j.rank for j in compute_pipeline_jitter((JitterSpec(4, 1.5), JitterSpec(0, 2.0)), 2, 2, 2)] == [1, 0]
    assert [j.rank for j in compute_pipeline_jitter((JitterSpec(3, 1.5),), 1, 1, 4)] == [3]
    with pytest.raises(ValueError, match=r"rank 1 is not on the simulated pipeline \(global ranks 0, 4\)"):
        compute_pipeline_jitter((JitterSpec(1, 1.5),), 2, 2, 2)


@_NO_FAULT_HANDLER
@pytest.mark.parametrize(
    "args,message",
    [
        (["--pipeline-model-parallel-size", "2"], "--dpp-rebalance microbatches needs data-parallel size >= 2"),
        (["--global-batch-size", "4"], "needs at least 2 microbatches per data-parallel replica to move any"),
        (
            ["--nproc-per-node", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"]
            + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
            "at least 4 microbatches per data-parallel replica to move any (the interleaved schedule moves them "
            "in groups of 2)",
        ),
    ],
)
def test_bad_microbatch_rebalancing_fails_in_one_line_before_launch(args, message, capsys):
    argv = ["train", "--device", "cpu", "--model", "tiny", "--nproc-per-node", "2", "--global-batch-size", "8"]
    code = main([*argv, "--dpp-rebalance", "microbatches", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
