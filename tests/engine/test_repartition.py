"""Moving layers between pipeline stages mid-run: the run continues exactly as one started in the
new partition from the same state (a checkpoint saved before the move and loaded after it)."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.repartition import compute_layer_owners, compute_moves, repartition
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups


def test_layer_owners_and_moves_follow_the_partition():
    assert compute_layer_owners((3, 1), 2) == [0, 0, 0, 1]
    assert compute_moves((3, 1), (1, 3), 2) == {(0, 1): [1, 2]}
    # virtual stages: layers 0 | 1 2 | 3 4 | 5 on ranks 0 1 0 1 -> 0 0 | 1 | 2 3 | 4 5
    assert compute_layer_owners((1, 2, 2, 1), 2) == [0, 1, 1, 0, 0, 1]
    assert compute_moves((1, 2, 2, 1), (2, 1, 2, 1), 2) == {(1, 0): [1]}


def _trainer(job, rank, data=None):
    groups = build_process_groups(job.layout, rank)
    data = data or RandomTokenBatches(job, groups.dp_rank)
    return Trainer(job, groups, torch.device("cpu"), data), data


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}


def move_mid_run(rank: int, world: int, job, target, save_dir: str) -> dict:
    """2 steps, move to `target`, 2 steps; and 2 steps, save, load in `target`, 2 steps."""
    moved, _ = _trainer(job, rank)
    head = [m.loss for m in moved.train(2)]
    seconds = repartition(moved, target)
    tail = [m.loss for m in moved.train(2)]
    first, data = _trainer(job, rank)
    first.train(2)
    save_checkpoint(save_dir, first, data)
    from dataclasses import replace

    target_job = replace(job, layout=replace(job.layout, stage_layers=target))
    loaded, data2 = _trainer(target_job, rank)
    load_checkpoint(save_dir, loaded, data2)
    reference = [m.loss for m in loaded.train(2)]
    mine, theirs = _params(moved), _params(loaded)
    return {
        "head": head,
        "tail": tail,
        "reference": reference,
        "names": sorted(mine),
        "params_equal": mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine),
        "seconds": seconds,
    }


CASES = {
    # name: (world, tp, pp, vpp, schedule, layers, from, to, extra job fields)
    "pp2_3_1_to_1_3": (2, 1, 2, 1, "1f1b", 4, (3, 1), (1, 3), {}),
    "dp2_pp2_distributed_optimizer": (4, 1, 2, 1, "1f1b", 4, (2, 2), (3, 1), {"use_distributed_optimizer": True}),
    "pp2_bf16_fp8_delayed": (
        2,
        1,
        2,
        1,
        "1f1b",
        4,
        (2, 2),
        (1, 3),
        {"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "delayed", "num_layers_at_start_in_bf16": 0}
        | {"num_layers_at_end_in_bf16": 0},
    ),
    "pp2_vpp2_interleaved": (2, 1, 2, 2, "interleaved", 6, (1, 2, 2, 1), (2, 1, 2, 1), {}),
    "tp2_pp2": (4, 2, 2, 1, "1f1b", 4, (2, 2), (1, 3), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_move_mid_run_equals_a_run_started_in_the_new_partition(cluster, tmp_path, name):
    world, tp, pp, vpp, schedule, layers, start, target, extra = CASES[name]
    job = make_job(world, tp, pp, vpp, schedule, iters=4, num_layers=layers, stage_layers=start, **extra)
    reports = cluster.run(move_mid_run, world, job, target, str(tmp_path))
    for rep in reports:
        assert rep["tail"] == rep["reference"]  # bit for bit
        assert rep["params_equal"]
        assert abs(rep["tail"][-1] - rep["head"][0]) > 1e-4  # training moved: the comparison means something
    last_stage = reports[-1]["names"]
    expected_last = {f"layers.{i}" for i, owner in enumerate(compute_layer_owners(target, pp)) if owner == pp - 1}
    assert {".".join(n.split(".")[:2]) for n in last_stage if n.startswith("layers.")} == expected_last
