"""Local launch (launch/local.py) and naming the rank whose failure ended a job (launch/failures.py).

The torchrun call itself is replaced by a stand-in that fails the way the elastic agent does
(ChildFailedError over error files in torch's own format), so the report is checked without
spawning ranks; tests/cli/test_cli.py checks it end to end with a real failing rank.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatronapp.launch.failures import pick_root_failure
from megatronapp.launch.local import rank_argv, remove_stale_rank_traces, run_local_ranks, torchrun_argv


def test_rank_argv_drops_only_the_launch_flag():
    argv = ["train", "--nproc-per-node", "4", "--tensor-model-parallel-size", "2", "--nproc-per-node=8", "--bf16"]
    assert rank_argv(argv) == ["train", "--tensor-model-parallel-size", "2", "--bf16"]
    assert rank_argv(["generate", "--nproc-per-node", "2"], ["--result-file", "r.json"]) == [
        "generate",
        "--result-file",
        "r.json",
    ]


def test_torchrun_reads_the_launch_command_as_meant():
    parsed = torchrun.get_args_parser().parse_args(
        torchrun_argv("megatronapp.scan.record.run", ["s.py", "--x", "1"], 3)
    )
    assert (parsed.standalone, parsed.nproc_per_node, parsed.module) == (True, "3", True)
    assert (parsed.training_script, parsed.training_script_args) == (
        "megatronapp.scan.record.run",
        ["s.py", "--x", "1"],
    )


def test_stale_rank_traces_are_removed_and_others_kept(tmp_path):
    (tmp_path / "rank00003.mscan").write_text("old")
    (tmp_path / "timeline.json").write_text("{}")
    remove_stale_rank_traces(tmp_path / "sub")  # created when missing
    remove_stale_rank_traces(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub", "timeline.json"]


def _failure(tmp_path, rank: int, message: str | None, timestamp: int, exitcode: int = 1) -> ProcessFailure:
    """A rank's failure as torchrun collects it: from the error file its @record wrote, if any."""
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(timestamp)}}}))
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
    failure.timestamp = timestamp  # ranks without an error file get the collection time
    return failure


def _launch_failing(monkeypatch, failures: dict) -> list:
    calls = []

    def fake_run(parsed):
        calls.append(parsed)
        raise ChildFailedError("megatronapp.cli.main", failures)

    monkeypatch.setattr(torchrun, "run", fake_run)
    return calls


def test_the_report_names_the_crashed_rank_not_its_victims(tmp_path, monkeypatch, capsys):
    failures = {
        0: _failure(tmp_path, 0, "RuntimeError: [gloo/pair.cc:553] Connection closed by peer", 100),
        1: _failure(tmp_path, 1, "RuntimeError: injected crash", 100),
        2: _failure(tmp_path, 2, None, 100, exitcode=-15),
    }  # stopped by the agent, no error of its own
    calls = _launch_failing(monkeypatch, failures)
    assert run_local_ranks("megatronapp.scan.record.run", ["s.py"], 3, prog="megatronapp trace run") == 1
    assert calls[0].nproc_per_node == "3"
    assert capsys.readouterr().err.strip() == (
        "megatronapp trace run: rank 1 failed (exit code 1): RuntimeError: injected crash"
    )


def test_a_launch_without_ranks_is_refused_before_torchrun(monkeypatch):
    calls = _launch_failing(monkeypatch, {0: SimpleNamespace()})
    with pytest.raises(ValueError, match="--nproc-per-node must be >= 1"):
        run_local_ranks("megatronapp.cli.main", ["train"], 0)
    assert not calls


def test_the_launcher_names_the_rank_that_caused_the_failure():
    """Error files carry whole-second timestamps: a victim of the crash may tie with it."""
    lost = {"message": "RuntimeError: [gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:45743"}
    failures = {
        0: SimpleNamespace(message=lost, timestamp=100, exitcode=1),
        1: SimpleNamespace(message={"message": "RuntimeError: injected crash"}, timestamp=100, exitcode=1),
        2: SimpleNamespace(message="<N/A>", timestamp=101, exitcode=-9),
    }
    rank, _, message = pick_root_failure(failures)
    assert (rank, message) == (1, "RuntimeError: injected crash")
    assert pick_root_failure({0: failures[0], 3: failures[0]})[0] == 0  # only victims: the earliest, lowest
    # The launcher stops the survivors with SIGTERM; collected in the crash's second, they tie with it.
    stopped = SimpleNamespace(message="Signal 15 (SIGTERM) received by PID 7", timestamp=100, exitcode=-15)
    assert pick_root_failure({0: stopped, 2: stopped, 3: failures[1]})[0] == 3
    # The crashed rank may itself be stopped by SIGTERM while it exits, after recording its error.
    crashed_then_stopped = SimpleNamespace(message=failures[1].message, timestamp=100, exitcode=-15)
    hung = {
        "message": "RuntimeError: [gloo/pair.cc:534] Read error [127.0.0.1]:5173: Connection timed out"
        ". This is typically caused by a remote worker hanging or bugs in the application."
    }
    assert (
        pick_root_failure({0: SimpleNamespace(message=hung, timestamp=100, exitcode=-15), 1: crashed_then_stopped})[0]
        == 1
    )


def test_command_lines_of_a_traced_script_and_of_torchrun_ranks():
    """The one way launch.local writes `trace run` and torchrun command lines (the fault lab's too)."""
    import sys

    from megatronapp.launch.local import torchrun_command, trace_run_command

    assert trace_run_command(2, "t", ["x.py", "--a"], ["--inject-slowdown", "1:2"]) == [
        *(sys.executable, "-m", "megatronapp.cli.main", "trace", "run", "--nproc-per-node", "2"),
        *("--trace-dir", "t", "--inject-slowdown", "1:2", "--", "x.py", "--a"),
    ]
    assert torchrun_command(["m", "train"], 4) == [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        *("--monitor-interval", "0.1", "--module", "m", "train"),
    ]


def test_of_ranks_failing_alike_the_report_names_one_that_exited_by_itself(tmp_path, monkeypatch, capsys):
    """Every rank reads the same bad file: the one the launcher stopped after it recorded the same
    error is not the one named (its exit code says it was killed)."""
    error = "ValueError: data.txt: not valid UTF-8 at byte 2"
    failures = {
        0: _failure(tmp_path, 0, error, 100, exitcode=-15),
        1: _failure(tmp_path, 1, error, 100, exitcode=1),
    }
    _launch_failing(monkeypatch, failures)
    assert run_local_ranks("megatronapp.cli.main", ["train"], 2) == 1
    assert capsys.readouterr().err.strip() == f"megatronapp: rank 1 failed (exit code 1): {error}"
