"""`megatronapp train` with validation / test loss and TensorBoard logs, end to end: the metrics
rows, the summary, the event files' scalars, and a resumed run that reproduces the validation
numbers and writes no step twice. Bad flags fail before launch with one line."""

from __future__ import annotations

import json

import pytest
from test_cli import run_cli

from megatronapp.cli.metric_logs import check_metric_logs
from megatronapp.config import ConfigError, LoggingConfig

RUN = ["--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr-decay-iters", "6"]
EVAL = ["--eval-interval", "2", "--eval-iters", "2"]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_evaluation_and_tensorboard_survive_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    common = RUN + EVAL + ["--save", str(ckpt), "--save-interval", "2", "--tensorboard-dir", str(tb)]
    first = run_cli([*common, "--metrics-file", str(tmp_path / "a.jsonl")], timeout=300)
    assert first.returncode == 0, first.stderr
    assert "validation loss at iteration 2 | lm loss value:" in first.stdout
    assert "validation loss (ppl)" in first.stdout and "test loss (ppl)" in first.stdout
    rows = _rows(tmp_path / "a.jsonl")
    valid = {r["iteration"]: r["valid_loss"] for r in rows if "valid_loss" in r}
    assert sorted(valid) == [2, 4, 6] and len(set(valid.values())) == 3
    assert [r["iteration"] for r in rows if "test_loss" in r] == [6]
    assert all("valid_ppl" in r for r in rows if "valid_loss" in r)
    losses = {r["iteration"]: r["loss"] for r in rows if "loss" in r}

    scalars = _scalars(tb)
    for tag in ("lm loss", "learning-rate", "grad-norm", "throughput/tokens-per-s", "step-checks/nan"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4, 5, 6], tag
    assert [s for s, _ in scalars["lm loss validation"]] == [2, 4, 6]
    assert [s for s, _ in scalars["lm loss test"]] == [6]
    assert [v for _, v in scalars["lm loss"]] == pytest.approx([losses[i] for i in range(1, 7)])

    # a run that died after its checkpoint at iteration 4 (having logged 5 and 6) is resumed there
    (ckpt / "latest").write_text("4")
    second = run_cli([*common, "--load", str(ckpt), "--metrics-file", str(tmp_path / "b.jsonl")], timeout=300)
    assert second.returncode == 0, second.stderr
    resumed = _rows(tmp_path / "b.jsonl")
    assert {r["iteration"]: r["valid_loss"] for r in resumed if "valid_loss" in r} == {6: valid[6]}  # bit for bit
    assert {r["iteration"]: r["loss"] for r in resumed if "loss" in r} == {5: losses[5], 6: losses[6]}
    scalars = _scalars(tb)
    assert [s for s, _ in scalars["lm loss"]] == [1, 2, 3, 4, 5, 6]  # no step twice
    assert [s for s, _ in scalars["lm loss validation"]] == [2, 4, 6]


def test_without_eval_flags_no_evaluation_rows(tmp_path):
    res = run_cli([*RUN, "--train-iters", "2", "--metrics-file", str(tmp_path / "m.jsonl")])
    assert res.returncode == 0, res.stderr
    assert all("loss" in r and "valid_loss" not in r for r in _rows(tmp_path / "m.jsonl"))
    assert "validation loss" not in res.stdout


def _bad_inputs(tmp) -> list[tuple[list[str], str]]:
    text, a_file = tmp / "a.txt", tmp / "file"
    text.write_text("some text " * 100)
    a_file.write_text("x")
    cases = [
        (["--eval-interval", "0"], "eval_interval must be >= 1, got 0"),
        (["--eval-interval", "2", "--eval-iters", "0"], "eval_iters must be >= 1, got 0"),
        (["--valid-data-path", str(text)], "--valid-data-path needs --eval-interval"),
        (
            ["--eval-interval", "2", "--data-path", str(text)],
            "--eval-interval with --data-path needs --valid-data-path",
        ),
        (["--eval-interval", "2", "--valid-data-path", str(tmp / "missing.txt")], "missing.txt does not exist"),
        (["--tensorboard-dir", str(a_file)], f"--tensorboard-dir {a_file} is not a folder"),
        (["--tensorboard-dir", str(a_file / "tb")], "is not writable"),
        (["--wandb-exp-name", "x"], "--wandb-exp-name / --wandb-save-dir need --wandb-project"),
    ]
    return cases


def test_bad_evaluation_and_log_flags_fail_before_launch(tmp_path, train_before_launch):
    for args, message in _bad_inputs(tmp_path):
        code, lines = train_before_launch(args)
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, lines)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tensorboard_dir="tb"), "--tensorboard-dir needs the tensorboard package"),
        (dict(wandb_project="p"), "--wandb-project needs the wandb package"),
    ],
)
def test_logs_need_their_package(monkeypatch, fields, message):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=message):
        check_metric_logs(LoggingConfig(**fields))


def test_wandb_offline_run_is_continued_on_resume(tmp_path):
    pytest.importorskip("wandb")
    ckpt, wb = tmp_path / "ckpt", tmp_path / "wb"
    common = [*RUN, "--train-iters", "2", "--save", str(ckpt), "--wandb-project", "p", "--wandb-save-dir", str(wb)]
    assert run_cli(common, timeout=300, cwd=tmp_path).returncode == 0
    run_id = (wb / "megatronapp-wandb-run-id").read_text().strip()
    res = run_cli([*common, "--train-iters", "3", "--load", str(ckpt)], timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    runs = sorted(p.name for p in (wb / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs), runs


def test_a_folder_this_user_cannot_write_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("os.access", lambda path, mode: False)  # as a non-root user on a read-only folder
    with pytest.raises(ConfigError, match=f"--tensorboard-dir {tmp_path}/tb is not writable .*does not let this user"):
        check_metric_logs(LoggingConfig(tensorboard_dir=str(tmp_path / "tb")))


def test_evaluation_is_refused_with_forward_backward_disaggregation():
    from dataclasses import replace

    from test_validate import train_run

    from megatronapp.cli.validate import validate
    from megatronapp.fbd.config import FbdConfig
    from megatronapp.job import replace_fields

    run = train_run(world=4, layout_world=2, fbd=FbdConfig())
    validate(run)
    with pytest.raises(ConfigError, match="--eval-interval is not built for --forward-backward-disaggregating"):
        validate(replace(run, job=replace_fields(run.job, eval_interval=2)))


def test_one_rank_writes_the_logs_the_last_stages_first():
    from megatronapp.cli.metric_logs import writer_rank
    from megatronapp.parallel.layout import ParallelLayout

    # Megatron's order, TP fastest, then DP, then PP: (tp 0, dp 0, pp 1) of TP2 x PP2 x DP2 is rank 4
    assert writer_rank(ParallelLayout(8, 2, 2)) == 4
    assert writer_rank(ParallelLayout(1)) == 0


def test_a_pipeline_writes_one_event_file_with_validation(tmp_path):
    pytest.importorskip("tensorboard")
    args = [*RUN, "--train-iters", "2", *EVAL, "--tensorboard-dir", str(tmp_path / "tb")]
    res = run_cli(["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", *args], timeout=300)
    assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "tb").iterdir())) == 1
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["lm loss"]] == [1, 2] and [s for s, _ in scalars["lm loss validation"]] == [2]


def test_validation_files_beside_training_files(tmp_path):
    train, valid = tmp_path / "train.txt", tmp_path / "valid.jsonl"
    train.write_text("The cat sat on the mat. " * 200)
    valid.write_text("\n".join(json.dumps({"text": f"A dog ran to the park {i} times."}) for i in range(60)))
    args = [*RUN, "--train-iters", "2", *EVAL, "--data-path", str(train), "--valid-data-path", str(valid)]
    res = run_cli([*args, "--metrics-file", str(tmp_path / "m.jsonl")])
    assert res.returncode == 0, res.stderr
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in rows if "valid_loss" in r] == [2]
    assert not any("test_loss" in r for r in rows)  # no --test-data-path: no test loss
