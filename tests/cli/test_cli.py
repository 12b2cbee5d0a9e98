"""`megatronapp train` end to end: bad input fails fast, metrics file, failing rank stops the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BASE = [sys.executable, "-m", "megatronapp.cli.main", "train", "--device", "cpu", "--model", "tiny"]


def run_cli(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(BASE + args, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"], "world size 3 is not divisible"),
        (["--tensor-model-parallel-size", "3", "--nproc-per-node", "3"], "num attention heads 4 is not divisible"),
        (["--pipeline-model-parallel-size", "3", "--nproc-per-node", "3"], "num layers 4 is not divisible"),
        (["--global-batch-size", "10", "--micro-batch-size", "4"], "global batch size 10 is not divisible"),
        (
            [
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "6",
                "--micro-batch-size",
                "2",
            ],
            "multiple of pipeline-parallel size",
        ),
        (["--num-layers-per-virtual-pipeline-stage", "1"], "virtual pipeline stages need pipeline-parallel size"),
        (["--inject-slowdown", "5:2", "--nproc-per-node", "2"], "outside world size 2"),
        (["--inject-link-delay", "0-1-5"], "expects SRC:DST:MS"),
        (["--lr", "-1"], "lr must be > 0"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
        (["--fp16", "--min-loss-scale", "0"], "need 0 < min_loss_scale"),
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--sequence-parallel"], "--sequence-parallel needs tensor-parallel size > 1"),
        (["--overlap-param-update"], "--overlap-param-update needs --bf16 or --fp16"),
        (["--attention-backend", "fastest"], "argument --attention-backend: invalid choice: 'fastest'"),
        (["--overlap-param-update", "--bf16"], "--overlap-param-update needs CUDA"),
        (
            ["--overlap-param-update", "--bf16", "--use-distributed-optimizer", "--nproc-per-node", "2"],
            "--overlap-param-update with --use-distributed-optimizer needs DP 1",
        ),
        (
            ["--trace", "--trace-interval", "2", "--continuous-trace-iterations", "3"],
            "continuous_iterations must be in 1..interval (2), got 3",
        ),
        (["--recompute-method", "block"], "need --recompute-granularity full"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "recompute num layers must be >= 1"),
        (["--hidden-dropout", "1.5"], "hidden_dropout must be in [0, 1)"),
        (
            ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "2", "--pipeline-stage-layers", "3,5"],
            "add up to 8, not num layers 4",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--nproc-per-node",
                "2",
                "--decoder-first-pipeline-num-layers",
                "5",
            ],
            "do not fit 4 layers on 2 stages",
        ),
        (["--pipeline-stage-layers", "3,x"], "expected comma-separated integers"),
    ],
)
def test_bad_input_fails_before_launch(args, message, train_before_launch):
    code, lines = train_before_launch(args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_subcommand_usage_error_is_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "megatronapp.cli.main", "trace", "merge"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line]
    assert lines == ["megatronapp trace merge: error: the following arguments are required: dir, -o/--out"], lines


def test_print_config_shows_dataclass_defaults():
    from megatronapp.config import OptimizerConfig, TrainConfig

    res = run_cli(["--print-config", "--lr", "0.005"], timeout=60)
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert cfg["optimizer"]["lr"] == 0.005  # a given flag wins
    for name in ("min_lr", "lr_warmup_iters", "clip_grad"):
        assert cfg["optimizer"][name] == getattr(OptimizerConfig(), name), name  # the dataclass is the one default
    for name in ("global_batch_size", "recompute_granularity"):
        assert cfg["train"][name] == getattr(TrainConfig(), name), name
    assert cfg["model"]["hidden_dropout"] == 0.0 and cfg["derived"]["dp_size"] == 1


def test_load_empty_dir_warns_and_mismatch_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    res = run_cli(["--train-iters", "1", "--global-batch-size", "2", "--save", str(ckpt), "--load", str(ckpt)])
    assert res.returncode == 0, res.stderr
    assert "holds no checkpoint; starting from scratch" in res.stderr
    res = run_cli(["--train-iters", "2", "--global-batch-size", "2", "--load", str(ckpt), "--hidden-size", "64"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"megatronapp: error: --load {ckpt}: checkpoint model differs: hidden_size 32 -> 64"
    ]


def test_metrics_file_and_summary(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = run_cli(
        [
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "3",
            "--global-batch-size",
            "4",
            "--metrics-file",
            str(metrics),
        ]
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu"} <= r.keys()
        assert r["tflops_per_gpu"] > 0 and r["mfu"] is None  # no MFU without a known accelerator peak
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert "summary" in res.stdout


def test_failing_rank_stops_the_job_with_its_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    res = run_cli(["--nproc-per-node", "2", "--train-iters", "1", "--global-batch-size", "4", "--save", str(ckpt)])
    assert res.returncode == 0, res.stderr
    (ckpt / "iter_0000001" / "rank00001.pt").write_bytes(b"not a checkpoint")  # only rank 1 reads it
    meta = json.loads((ckpt / "iter_0000001" / "meta.json").read_text())
    del meta["files"]  # as an older checkpoint, unchecked before launch: the failure happens in rank 1
    (ckpt / "iter_0000001" / "meta.json").write_text(json.dumps(meta))
    # rank 0 loads its shard and waits for rank 1 in the first collective: a job that did not
    # stop on rank 1's error would hang there (the subprocess timeout fails the test then)
    res = run_cli(
        ["--nproc-per-node", "2", "--train-iters", "50", "--global-batch-size", "4", "--load", str(ckpt)], timeout=90
    )
    assert res.returncode == 1
    assert "rank 1 failed" in res.stderr
    assert "rank00001.pt is damaged" in res.stderr
    assert "[rank1]: Traceback" not in res.stderr  # a damaged file is a named error, not a crash


def test_trains_on_jsonl_with_hf_tokenizer(tmp_path):
    from test_data import _train_tiny_bpe

    tok = _train_tiny_bpe(tmp_path / "tokenizer.json", ["<unk>", "</s>"])
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"the cat {i} sat on the mat {i * 7}."}) for i in range(400)))
    metrics = tmp_path / "m.jsonl"
    res = run_cli(
        [
            "--nproc-per-node",
            "2",
            "--train-iters",
            "2",
            "--global-batch-size",
            "4",
            "--data-path",
            str(data),
            "--tokenizer-model",
            str(tok),
            "--metrics-file",
            str(metrics),
        ]
    )
    assert res.returncode == 0, res.stderr
    assert len(metrics.read_text().splitlines()) == 2


def test_online_detection_warns_about_injected_slow_rank():
    # the warning needs 4 lagging iterations in a row: 16 iterations at 4x, so that one iteration
    # of four ranks sharing two busy cores, in which the peers happen to be as slow, cannot hide it
    res = run_cli(
        [
            "--nproc-per-node",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "16",
            "--global-batch-size",
            "16",
            "--inject-slowdown",
            "1:4",
        ]
    )
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stdout.splitlines() if line.startswith("MegaScan online:")]
    assert warnings and "rank 1 " in warnings[0]


def test_an_uneven_partition_trains_and_its_stages_hold_the_layers_asked_for(tmp_path):
    res = run_cli(
        ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"]
        + ["--train-iters", "2", "--print-config"],
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["layout"]["stage_layers"] == [3, 1]
    res = run_cli(["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "1,3"])
    assert res.returncode == 0, res.stderr
