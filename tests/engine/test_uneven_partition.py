"""Uneven pipeline partitions train the same numbers as one process in every schedule, and a
checkpoint saved in one partition resumes exactly in another."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_jobs import RandomTokenBatches, assemble_full_grads, full_grads, make_job, train_and_report

from megatronapp.dpp.config import DppConfig
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups

CASES = {
    # name: (world, tp, pp, vpp, schedule, num_layers, layers of each virtual stage)
    "pp2_1f1b_3_1": (2, 1, 2, 1, "1f1b", 4, (3, 1)),
    "pp2_zb_h1_1_3": (2, 1, 2, 1, "zb-h1", 4, (1, 3)),
    "pp2_vpp2_interleaved": (2, 1, 2, 2, "interleaved", 6, (1, 2, 2, 1)),
    "pp2_vpp2_interleaved_zb": (2, 1, 2, 2, "interleaved-zb", 6, (2, 1, 1, 2)),
    "pp2_vpp2_dynamic": (2, 1, 2, 2, "dynamic", 6, (1, 2, 2, 1)),
    "tp2_pp2_3_1": (4, 2, 2, 1, "1f1b", 4, (3, 1)),
    "dp2_pp2_1_3_distributed_optimizer": (4, 1, 2, 1, "1f1b", 4, (1, 3)),
}


def train_partitioned(rank: int, world: int, job) -> dict:
    if job.train.schedule != "dynamic":
        return train_and_report(rank, world, job)
    groups = build_process_groups(job.layout, rank)
    factory = functools.partial(build_dynamic_runtime_factory(DppConfig(), job), separate_channels=False)
    trainer = Trainer(
        job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank), runtime_factory=factory
    )
    losses, norms, grads = [], [], None
    for step in range(job.train.train_iters):
        m = trainer.train_step()
        losses.append(m.loss)
        norms.append(m.grad_norm)
        if step == 0:
            grads = full_grads(trainer) if groups.dp_rank == 0 else {}
    trainer.runtime.close()
    return {"losses": losses, "norms": norms, "grads": grads}


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    return {layers: train_and_report(0, 1, make_job(1, num_layers=layers)) for layers in (4, 6)}


@pytest.mark.parametrize("name", list(CASES))
def test_uneven_partition_matches_single_process(cluster, references, name):
    world, tp, pp, vpp, schedule, layers, stage_layers = CASES[name]
    extra = {"use_distributed_optimizer": True} if "distributed_optimizer" in name else {}
    job = make_job(world, tp, pp, vpp, schedule, num_layers=layers, stage_layers=stage_layers, **extra)
    reference = references[layers]
    reports = cluster.run(train_partitioned, world, job)
    for rep in reports:
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["norms"], reference["norms"], rtol=1e-5, atol=1e-6)
    grads = assemble_full_grads(reports)
    assert grads.keys() == reference["grads"].keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, reference["grads"][key][0], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_the_partition_decides_which_layers_a_stage_builds(cluster):
    job = make_job(2, 1, 2, num_layers=4, stage_layers=(3, 1))
    names = cluster.run(_layer_names, 2, job)
    assert names[0] == ["layers.0", "layers.1", "layers.2"]
    assert names[1] == ["layers.3"]


def _layer_names(rank: int, world: int, job) -> list[str]:
    trainer = Trainer(job, build_process_groups(job.layout, rank), torch.device("cpu"), None)
    found = {name.split(".")[0] + "." + name.split(".")[1] for c in trainer.chunks for name, _ in c.named_parameters()}
    return sorted(n for n in found if n.startswith("layers."))


def save_in_one_partition(rank: int, world: int, job, save_dir: str) -> list[float]:
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    losses = [m.loss for m in trainer.train(4)]
    trainer.optimizer.finish_param_sync()
    fresh_data = RandomTokenBatches(job, groups.dp_rank)
    head = Trainer(job, groups, torch.device("cpu"), fresh_data)
    head.train(2)
    save_checkpoint(save_dir, head, fresh_data)
    return losses


def resume_in_another(rank: int, world: int, job, save_dir: str) -> list[float]:
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    load_checkpoint(save_dir, trainer, data)
    return [m.loss for m in trainer.train(2)]


def test_a_checkpoint_saved_in_one_partition_resumes_exactly_in_another(cluster, tmp_path):
    saved = make_job(2, 1, 2, num_layers=4, iters=4, stage_layers=(3, 1))
    straight = cluster.run(save_in_one_partition, 2, saved, str(tmp_path))[0]
    moved = make_job(2, 1, 2, num_layers=4, iters=4, stage_layers=(1, 3))
    resumed = cluster.run(resume_in_another, 2, moved, str(tmp_path))[0]
    assert resumed == straight[2:]  # bit-exact: same state, same data, same order of reductions per layer
