"""`megatronapp train --forward-backward-disaggregating` end to end: bad input fails before
launch, a crashed rank of either role ends the job promptly, both roles are traced."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from test_cli import run_cli

FBD = ["--forward-backward-disaggregating"]
PP2 = ["--nproc-per-node", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]


@pytest.mark.parametrize(
    "args, message",
    [
        (FBD + ["--nproc-per-node", "5", "--pipeline-model-parallel-size", "2"], "world size 5 is not a multiple of 4"),
        (["--forward-tensor-model-parallel-size", "2"], "needs --forward-backward-disaggregating"),
        (["--inject-crash", "1:1"], "needs --forward-backward-disaggregating"),
        (FBD + PP2 + ["--inject-crash", "one"], "--inject-crash expects RANK:ITER"),
        (FBD + PP2 + ["--inject-crash", "4:1"], "--inject-crash rank 4 is outside world size 4"),
        (FBD + PP2 + ["--fbd-max-ahead", "0"], "--fbd-max-ahead must be >= 1"),
        (
            FBD + ["--nproc-per-node", "4", "--forward-tensor-model-parallel-size", "3"],
            "num attention heads 4 is not divisible by forward tensor-parallel size 3",
        ),
        (FBD + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], "does not support virtual pipeline stages"),
        (FBD + PP2 + ["--split-backward"], "runs the whole backward: --split-backward does not apply"),
    ],
)
def test_bad_fbd_input_fails_before_launch(args, message, train_before_launch):
    code, lines = train_before_launch(args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def _processes_with(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("rank, role", [(3, "forward"), (1, "backward")])
def test_a_crashed_rank_of_either_role_ends_the_job_promptly(monkeypatch, rank, role):
    """Rank 3 is stage 1's forward worker, rank 1 stage 1's backward worker (RoleLayout)."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("MEGATRONAPP_TEST_TAG", tag)  # inherited by every process of the job
    # the other ranks then wait on the crashed one (gloo's default timeout is 30 minutes): a job
    # that did not end on the crash would hang past the subprocess timeout and fail the test
    res = run_cli(FBD + PP2 + ["--train-iters", "500", "--inject-crash", f"{rank}:2"], timeout=240)
    assert res.returncode == 1, res.stderr[-2000:]
    line = next(x for x in res.stderr.splitlines() if x.startswith("megatronapp: rank"))
    assert f"megatronapp: rank {rank} failed" in line and f"{role} worker rank {rank} at iteration 2" in line, (
        res.stderr[-4000:]
    )  # every rank's error, to tell a misnamed root cause from a wrong crash
    assert _processes_with(f"MEGATRONAPP_TEST_TAG={tag}") == []


def test_fbd_run_traces_both_roles_and_reports_waits(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = run_cli(
        FBD
        + PP2
        + ["--train-iters", "3", "--metrics-file", str(metrics), "--trace", "--trace-dir", str(tmp_path / "t")],
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "backward waited on forward" in res.stdout and "forward waited on backward" in res.stdout
    assert [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
    timeline = json.loads((tmp_path / "t" / "timeline.json").read_text())
    events = timeline["traceEvents"] if isinstance(timeline, dict) else timeline
    names = sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
    assert names == [
        "rank 0 backward (pp0 dp0 tp0)",
        "rank 1 backward (pp1 dp0 tp0)",
        "rank 2 forward (pp0 dp0 tp0)",
        "rank 3 forward (pp1 dp0 tp0)",
    ]
    assert any(e.get("name") == "wait_forward" for e in events)
    assert any(e.get("cat") == "flow" for e in events)  # send -> recv arrows, including the hand-offs


def test_the_rank_body_picks_each_rank_its_role():
    """One training-rank body (cli/train.py): a plain job's ranks are PlainRole; an FBD job of
    world 4 at PP2 has backward workers 0, 1 (stages 0, 1) and forward workers 2, 3."""
    from megatronapp.cli.main import build_parser
    from megatronapp.cli.run import build_train_run
    from megatronapp.cli.train import PlainRole, pick_role
    from megatronapp.fbd.roles import BackwardRole, ForwardRole

    plain = build_train_run(build_parser().parse_args(["train", "--device", "cpu"]), 1)
    assert isinstance(pick_role(plain, 0), PlainRole)
    args = build_parser().parse_args(["train", "--device", "cpu", *FBD, "--pipeline-model-parallel-size", "2"])
    roles = [pick_role(build_train_run(args, 4), rank) for rank in range(4)]
    assert [type(r) for r in roles] == [BackwardRole, BackwardRole, ForwardRole, ForwardRole]
    assert [r.trace_meta["role"] for r in roles] == ["backward", "backward", "forward", "forward"]
    assert {r.backend for r in roles} == {"gloo"} and {r.device.type for r in roles} == {"cpu"}
