"""Checkpoints: exact resume, and loading a TP2 x PP2 checkpoint into one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups


def _trainer(job, rank):
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    return Trainer(job, groups, torch.device("cpu"), data), data


def train_save_resume(rank: int, world: int, job, save_dir: str) -> dict:
    """Uninterrupted 4 steps vs 2 steps + save + fresh trainer load + 2 steps."""
    ref, _ = _trainer(job, rank)
    straight = [m.loss for m in ref.train(4)]
    first, data = _trainer(job, rank)
    head = [m.loss for m in first.train(2)]
    save_checkpoint(save_dir, first, data)
    resumed, data2 = _trainer(job, rank)
    load_checkpoint(save_dir, resumed, data2)
    tail = [m.loss for m in resumed.train(2)]
    params_equal = all(
        torch.equal(p, q)
        for c1, c2 in zip(ref.chunks, resumed.chunks)
        for p, q in zip(c1.parameters(), c2.parameters())
    )
    return {"straight": straight, "resumed": head + tail, "params_equal": params_equal}


def train_and_save(rank: int, world: int, job, save_dir: str) -> list[float]:
    trainer, data = _trainer(job, rank)
    losses = [m.loss for m in trainer.train(2)]
    save_checkpoint(save_dir, trainer, data)
    losses.append(trainer.train_step().loss)  # the step a converted load must reproduce
    return losses


@pytest.mark.parametrize("layout", [(1, 1, 1), (4, 2, 2)], ids=["single", "tp2_pp2"])
def test_resume_equals_uninterrupted(cluster, tmp_path, layout):
    world, tp, pp = layout
    job = make_job(world, tp, pp, iters=4)
    if world == 1:
        torch.set_num_threads(1)
        reports = [train_save_resume(0, 1, job, str(tmp_path))]
    else:
        reports = cluster.run(train_save_resume, world, job, str(tmp_path))
    for rep in reports:
        assert rep["resumed"] == rep["straight"]  # bit-exact: same data, same state, same order
        assert rep["params_equal"]


def test_tp2_pp2_checkpoint_loads_into_one_process(cluster, tmp_path):
    job = make_job(4, 2, 2, iters=3)
    losses = cluster.run(train_and_save, 4, job, str(tmp_path))[0]
    single = make_job(1, iters=3)
    torch.set_num_threads(1)
    trainer, data = _trainer(single, 0)
    assert load_checkpoint(str(tmp_path), trainer, data) == 2
    step3 = trainer.train_step().loss
    assert step3 == pytest.approx(losses[2], rel=1e-5)
    assert step3 != pytest.approx(losses[1], rel=1e-3)  # it really is the next step


def test_load_missing_checkpoint_is_clear(tmp_path):
    job = make_job(1)
    trainer, data = _trainer(job, 0)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(str(tmp_path), trainer, data)


def save_with_a_late_marker(rank: int, world: int, job, save_dir: str) -> bool:
    """Rank 0 writes the 'latest' marker late; whether this rank sees a complete checkpoint
    the moment save_checkpoint returns."""
    import time

    import megatronapp.engine.checkpoint as checkpoint

    write = checkpoint.write_text_atomic

    def late_write(path, text):
        time.sleep(0.5)  # the fault: a slow file system under rank 0's marker
        write(path, text)

    checkpoint.write_text_atomic = late_write
    try:
        trainer, data = _trainer(job, rank)
        trainer.train_step()
        save_checkpoint(save_dir, trainer, data)
        return (Path(save_dir) / "latest").is_file()
    finally:
        checkpoint.write_text_atomic = write


def test_save_returns_on_every_rank_only_once_the_checkpoint_is_complete(cluster, tmp_path):
    job = make_job(2, 1, 2)  # PP2
    assert cluster.run(save_with_a_late_marker, 2, job, str(tmp_path)) == [True, True]
