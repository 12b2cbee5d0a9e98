"""Distributed optimizer (ZeRO-1): parity with one process, and checkpoints across DP sizes.

fp32, CPU, gloo. The reference is one process with the plain (non-sharded) optimizer.
"""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, assemble_full_grads, make_job, train_and_report

from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.distrib_optimizer import ShardRange, compute_shard_ranges
from megatronapp.engine.grads import BucketSpan, compute_bucket_layout
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups

DISTOPT = {"use_distributed_optimizer": True}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return train_and_report(0, 1, make_job(1))


def test_bucket_layout_and_shards_cover_every_element_once():
    numels = [7, 300, 5, 64, 129]
    offsets, buckets, total = compute_bucket_layout(numels, bucket_numel=100, pad_multiple=3 * 4)
    assert all((b.end - b.start) % 12 == 0 for b in buckets) and buckets[-1].end == total
    assert sorted(i for b in buckets for i in b.params) == list(range(5))
    assert buckets[0].params[0] == 4  # the last parameter comes first (backward order)
    for dp in (1, 3, 4):
        owned = [0] * sum(numels)
        base = [sum(numels[:i]) for i in range(len(numels))]
        for rank in range(dp):
            for r in compute_shard_ranges(offsets, numels, buckets, dp, rank):
                for e in range(r.start, r.end):
                    owned[base[r.param] + e] += 1
        assert owned == [1] * sum(numels), dp


def test_shard_ranges_docstring_example():
    bucket = BucketSpan(0, 12, (1, 0))
    offsets, numels = [5, 0], [5, 5]  # b = param 0 at [5, 10), a = param 1 at [0, 5)
    assert compute_shard_ranges(offsets, numels, [bucket], 2, 0) == [ShardRange(1, 0, 5), ShardRange(0, 0, 1)]
    assert compute_shard_ranges(offsets, numels, [bucket], 2, 1) == [ShardRange(0, 1, 5)]


@pytest.mark.parametrize(
    "layout",
    [(2, 1, 1, False), (2, 1, 1, True), (4, 2, 1, False), (4, 1, 2, True)],
    ids=["dp2", "dp2_overlap_param_gather", "tp2_dp2", "pp2_dp2_overlap_param_gather"],
)
def test_distributed_optimizer_matches_single_process(cluster, reference, layout):
    world, tp, pp, overlap = layout
    reports = cluster.run(train_and_report, world, make_job(world, tp, pp, overlap_param_gather=overlap, **DISTOPT))
    for rep in reports:
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["norms"], reference["norms"], rtol=1e-5, atol=1e-6)
    assert abs(reference["losses"][-1] - reference["losses"][0]) > 1e-3
    assert reference["norms"][0] > 1.0  # clipping (max norm 1) is active, so the norm matters
    grads = assemble_full_grads(reports)
    assert grads.keys() == reference["grads"].keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, reference["grads"][key][0], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _trainer(job, rank):
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    return Trainer(job, groups, torch.device("cpu"), data), data


def train_save_continue(rank: int, world: int, job, save_dir: str) -> list[float]:
    """4 steps with a checkpoint after step 2; returns all 4 losses."""
    trainer, data = _trainer(job, rank)
    losses = [m.loss for m in trainer.train(2)]
    save_checkpoint(save_dir, trainer, data)
    return losses + [m.loss for m in trainer.train(2)]


def load_and_train(rank: int, world: int, job, save_dir: str) -> list[float]:
    trainer, data = _trainer(job, rank)
    assert load_checkpoint(save_dir, trainer, data) == 2
    return [m.loss for m in trainer.train(2)]


def test_dp4_checkpoint_resumes_under_dp2_dp1_and_without_distopt(cluster, tmp_path):
    straight = cluster.run(train_save_continue, 4, make_job(4, iters=4, **DISTOPT), str(tmp_path))[0]
    targets = {"dp2_distopt": (2, DISTOPT), "dp2": (2, {}), "dp4_distopt": (4, DISTOPT)}
    for name, (world, kw) in targets.items():
        tail = cluster.run(load_and_train, world, make_job(world, iters=4, **kw), str(tmp_path))[0]
        torch.testing.assert_close(tail, straight[2:], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.set_num_threads(1)
    single = load_and_train(0, 1, make_job(1, iters=4), str(tmp_path))
    torch.testing.assert_close(single, straight[2:], rtol=1e-6, atol=1e-6)
    fresh = train_and_report(0, 1, make_job(1, iters=2))["losses"]
    assert abs(single[0] - fresh[0]) > 1e-3  # it really continues from step 2


def test_dp2_distopt_resume_is_bit_exact(cluster, tmp_path):
    job = make_job(2, iters=4, **DISTOPT)
    straight = cluster.run(train_save_continue, 2, job, str(tmp_path))[0]
    assert cluster.run(load_and_train, 2, job, str(tmp_path))[0] == straight[2:]


def state_bytes_after_one_step(rank: int, world: int, job) -> dict:
    trainer, _ = _trainer(job, rank)
    trainer.train(1)
    numel = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    return {"numel": numel, **trainer.optimizer.state_bytes()}


def test_bf16_distopt_shards_master_weights_and_adam_state(cluster):
    """Per parameter: bf16 param 2 + fp32 main grad 4 bytes everywhere, fp32 master 4 + Adam 8 split over DP."""
    job = make_job(2, iters=1, bf16=True, **DISTOPT)
    for rep in cluster.run(state_bytes_after_one_step, 2, job):
        n = rep["numel"]
        assert rep["params"] == 2 * n
        assert 4 * n <= rep["main_grads"] < 4 * n * 1.1  # bucket padding only
        assert 0.4 * 4 * n < rep["main_params"] < 0.6 * 4 * n
        assert 0.4 * 8 * n < rep["adam"] < 0.6 * 8 * n
