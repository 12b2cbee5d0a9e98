"""A damaged checkpoint file is named in one line, exit code 2, before any rank starts, by every
command that loads checkpoints; nothing in the checkpoint is modified."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.cli.validate import VERIFIED_CHECKPOINT_ENV
from megatronapp.engine.checkpoint import load_model_params, save_checkpoint
from megatronapp.engine.checkpoint_files import compute_file_digest, read_checkpoint_meta, verify_checkpoint_files
from megatronapp.engine.trainer import Trainer
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.parallel.groups import build_process_groups, single_process_groups

ITER = "iter_0000001"


def save_after_one_step(rank: int, world: int, job, save_dir: str) -> None:
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    trainer.train(1)
    save_checkpoint(save_dir, trainer, data)


@pytest.fixture(scope="module")
def saved_dp2(cluster, tmp_path_factory) -> Path:
    """A checkpoint of two DP ranks: one model shard, two rank files (one process reads only rank 0's)."""
    path = tmp_path_factory.mktemp("dp2_ckpt")
    cluster.run(save_after_one_step, 2, make_job(2, iters=1, global_batch=4), str(path))
    return path


@pytest.fixture
def ckpt(saved_dp2, tmp_path, monkeypatch) -> Path:
    """A private copy of the saved checkpoint, and no note of an earlier verification."""
    monkeypatch.delenv(VERIFIED_CHECKPOINT_ENV, raising=False)
    return Path(shutil.copytree(saved_dp2, tmp_path / "ckpt"))


def _snapshot(folder: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    from megatronapp.cli.main import main

    with warnings.catch_warnings():  # main's @record wants a real stderr for faulthandler
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        code = main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line]


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_save_records_the_size_and_checksum_of_every_file(ckpt):
    folder = ckpt / ITER
    files = read_checkpoint_meta(folder)["files"]
    assert sorted(files) == ["model_tp0_pp0.pt", "rank00000.pt", "rank00001.pt"]
    for name, digest in files.items():
        assert digest == compute_file_digest(folder / name)
    verify_checkpoint_files(folder)


def _refused_by_train(ckpt: Path, train_before_launch) -> tuple[int, list[str]]:
    return train_before_launch(["--train-iters", "2", "--global-batch-size", "4", "--load", str(ckpt)])


@pytest.mark.parametrize(
    "damage, name, expected",
    [
        (_truncate, "model_tp0_pp0.pt", "is damaged (expected {size} bytes, found 100)"),
        (_flip_middle_byte, "model_tp0_pp0.pt", "is damaged (checksum xxh3 "),
        (_truncate, "rank00001.pt", "is damaged (expected {size} bytes, found 100)"),  # not read by 1 process
        (lambda p: p.unlink(), "rank00000.pt", "is missing"),
    ],
    ids=["truncated-shard", "corrupted-shard", "truncated-unread-rank-file", "missing-rank-file"],
)
def test_train_names_the_damaged_file_before_launch(ckpt, train_before_launch, damage, name, expected):
    folder = ckpt / ITER
    size = (folder / name).stat().st_size
    damage(folder / name)
    before = _snapshot(ckpt)
    code, err = _refused_by_train(ckpt, train_before_launch)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"megatronapp: error: checkpoint {folder.resolve()}: {name} {expected.format(size=size)}")
    assert _snapshot(ckpt) == before


@pytest.mark.parametrize(
    "text", ['{"iteration": 1, "lay', "", '{"iteration": 1}'], ids=["truncated", "empty", "partial"]
)
def test_a_damaged_meta_json_is_named(ckpt, train_before_launch, text):
    meta = ckpt / ITER / "meta.json"
    meta.write_text(text)
    before = _snapshot(ckpt)
    code, err = _refused_by_train(ckpt, train_before_launch)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"megatronapp: error: checkpoint {ckpt / ITER}: meta.json is damaged (")
    assert _snapshot(ckpt) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2", "--load"],
        ["scope", "capture", "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2", "--out", "x", "--load"],
        ["scope", "serve", "--device", "cpu", "--port", "0", "--load"],
        ["export", "hf", "--out", "hf-out", "--load"],
    ],
    ids=["generate", "scope-capture", "scope-serve", "export-hf"],
)
def test_every_loading_command_names_the_damaged_file(ckpt, capsys, monkeypatch, tmp_path, argv):
    monkeypatch.chdir(tmp_path)
    folder = ckpt / ITER
    size = (folder / "model_tp0_pp0.pt").stat().st_size
    _truncate(folder / "model_tp0_pp0.pt")
    before = _snapshot(ckpt)
    code, err = _run_main([*argv, str(ckpt)], capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("megatronapp: error: checkpoint "), err
    assert err[0].endswith(f"model_tp0_pp0.pt is damaged (expected {size} bytes, found 100)")
    assert _snapshot(ckpt) == before
    assert not (tmp_path / "hf-out").exists() and not (tmp_path / "x").exists()


def test_a_checkpoint_without_checksums_still_loads(ckpt):
    meta_path = ckpt / ITER / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["files"]
    meta_path.write_text(json.dumps(meta))
    verify_checkpoint_files(ckpt / ITER)
    model = build_inference_model(read_model_config(ckpt), single_process_groups(), "cpu")
    load_model_params(ckpt, [model.chunk], 1, 0)


def test_a_file_that_fails_to_load_names_itself(ckpt):
    """Inside a rank (files changed after the check, or an old checkpoint): one line, not a traceback."""
    _truncate(ckpt / ITER / "model_tp0_pp0.pt")
    model = build_inference_model(read_model_config(ckpt), single_process_groups(), "cpu")
    with pytest.raises(ValueError, match=r"model_tp0_pp0.pt is damaged \(torch.load: "):
        load_model_params(ckpt, [model.chunk], 1, 0)


@pytest.mark.parametrize(
    "argv",
    [["generate", "--device", "cpu", "--prompt", "Hi", "--load"], ["export", "hf", "--out", "hf-out", "--load"]],
    ids=["generate", "export-hf"],
)
def test_every_loading_command_names_a_damaged_meta_json(ckpt, capsys, monkeypatch, tmp_path, argv):
    monkeypatch.chdir(tmp_path)
    _truncate(ckpt / ITER / "meta.json", keep=40)
    before = _snapshot(ckpt)
    code, err = _run_main([*argv, str(ckpt)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("megatronapp: error: checkpoint ") and "meta.json is damaged (not valid JSON" in err[0]
    assert _snapshot(ckpt) == before


def test_one_process_names_a_damaged_file_of_an_unchecked_checkpoint(ckpt, capsys, monkeypatch, tmp_path):
    """An older checkpoint (no checksums) fails when a file is read: still one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    meta_path = ckpt / ITER / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["files"]
    meta_path.write_text(json.dumps(meta))
    _truncate(ckpt / ITER / "model_tp0_pp0.pt")
    before = _snapshot(ckpt)
    argv = ["generate", "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2", "--load", str(ckpt)]
    code, err = _run_main(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"megatronapp: error: checkpoint {ckpt / ITER}: model_tp0_pp0.pt is damaged (torch.load")
    assert _snapshot(ckpt) == before


def test_a_damaged_latest_marker_is_named(ckpt, train_before_launch):
    (ckpt / "latest").write_bytes(b"\x00\x01")
    before = _snapshot(ckpt)
    code, err = _refused_by_train(ckpt, train_before_launch)
    assert code == 2
    assert err == [
        f"megatronapp: error: checkpoint {ckpt}: latest is damaged (an iteration number, found '\\x00\\x01')"
    ]
    assert _snapshot(ckpt) == before
