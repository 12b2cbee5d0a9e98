"""Uneven microbatch counts per data-parallel replica train the numbers one process trains on the
same global batch: losses, gradients and updated weights, whatever the split."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_jobs import RandomTokenBatches, full_grads, make_job

from megatronapp.data.dataset import compute_replica_sample_range
from megatronapp.dpp.config import DppConfig
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.dpp.rebalance import RebalanceConfig
from megatronapp.dpp.rebalance_hook import build_rebalance_hook
from megatronapp.engine.replica_split import check_replica_microbatches
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups

DROPOUT = {"hidden_dropout": 0.1}  # masks keyed by global sample: a sample moved to another replica keeps its own


def train_split(rank: int, world: int, job, split) -> dict:
    """Two steps with DP replica r running split[r] microbatches; losses, the first step's reduced
    grads and the weights after the second step, by parameter name (TP 1)."""
    groups = build_process_groups(job.layout, rank)
    factory = None
    if job.train.schedule == "dynamic":
        factory = functools.partial(build_dynamic_runtime_factory(DppConfig(), job), separate_channels=False)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, torch.device("cpu"), data, runtime_factory=factory)
    if split is not None:
        trainer.set_replica_microbatches(split)
    losses, grads = [trainer.train_step().loss], full_grads(trainer)
    losses.append(trainer.train_step().loss)
    trainer.optimizer.finish_param_sync()
    if factory is not None:
        trainer.runtime.close()
    weights = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    return {"losses": losses, "grads": {n: g for n, (g, _, _) in grads.items()}, "weights": weights}


def _merged(reports: list[dict], key: str) -> dict[str, torch.Tensor]:
    return {name: t for rep in reports for name, t in rep[key].items()}


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    return {batch: train_split(0, 1, make_job(1, global_batch=batch, model_kw=DROPOUT), None) for batch in (4, 8)}


CASES = {
    # name: (pp, vpp, schedule, global batch, microbatches of each DP replica)
    "dp2_3_1": (1, 1, "1f1b", 4, (3, 1)),
    "dp2_2_2": (1, 1, "1f1b", 4, (2, 2)),
    "dp2_1_3_distributed_optimizer": (1, 1, "1f1b", 4, (1, 3)),
    "dp2_pp2_3_1": (2, 1, "1f1b", 4, (3, 1)),
    "dp2_pp2_vpp2_interleaved_6_2": (2, 2, "interleaved", 8, (6, 2)),  # groups of PP microbatches
    "dp2_pp2_vpp2_dynamic_5_3": (2, 2, "dynamic", 8, (5, 3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_uneven_split_trains_what_one_process_trains(cluster, references, name):
    pp, vpp, schedule, batch, split = CASES[name]
    extra = {"use_distributed_optimizer": True} if "distributed_optimizer" in name else {}
    job = make_job(2 * pp, pp=pp, vpp=vpp, schedule=schedule, global_batch=batch, model_kw=DROPOUT, **extra)
    reference = references[batch]
    reports = cluster.run(train_split, 2 * pp, job, split)
    for rep in reports:
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-6, atol=0)
    # summation order only; Adam's m / sqrt(v) turns a 1e-9 grad difference on a near-zero grad into
    # ~1e-7 of a weight (an update is lr = 3e-3)
    for key, atol in (("grads", 1e-7), ("weights", 1e-6)):
        got, want = _merged(reports, key), reference[key]
        assert got.keys() == want.keys()
        for name, t in got.items():
            torch.testing.assert_close(t, want[name], rtol=1e-5, atol=atol, msg=lambda m: f"{key} {name}: {m}")


def test_the_replicas_take_the_global_batch_in_rank_order():
    assert [compute_replica_sample_range((3, 1), r, 2) for r in (0, 1)] == [range(0, 6), range(6, 8)]
    assert [compute_replica_sample_range((2, 2), r, 1) for r in (0, 1)] == [range(0, 2), range(2, 4)]


@pytest.mark.parametrize(
    "split, granule, message",
    [
        ((3,), 1, "one count per data-parallel replica"),
        ((3, 2), 1, "adds up to 5"),
        ((4, 0), 1, "at least 1"),
        ((3, 1), 2, "a multiple of 2"),
    ],
)
def test_a_split_that_does_not_fit_is_one_line(split, granule, message):
    with pytest.raises(ValueError, match=message) as err:
        check_replica_microbatches(split, 2, 2, granule)
    assert "\n" not in str(err.value)


def train_with_hook(rank: int, world: int, job, slow_replica: int | None) -> dict:
    """Four steps under `--dpp-rebalance microbatches` (window 2), the compute seconds of
    `slow_replica`'s ranks reported 3x: what moved, and the losses."""
    groups = build_process_groups(job.layout, rank)
    trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank))
    config = RebalanceConfig(mode="microbatches", window=2, first_move_cost_s=0.0)
    hook = build_rebalance_hook(config, job, trainer) if world > 1 else None
    rows = []

    def on_step(metrics) -> None:
        m = metrics.as_dict()
        split = trainer.replica_microbatches or (job.num_microbatches,) * job.layout.dp_size
        replica = [job.layout.coords(r).dp for r in range(world)]
        m["rank_compute_s"] = [split[d] * (3.0 if d == slow_replica else 1.0) for d in replica]  # s a microbatch
        if hook is not None:
            hook.after_step(m)
        rows.append(m)

    trainer.train(on_step=on_step)
    return {"losses": [r["loss"] for r in rows], "moves": [r["rebalance"] for r in rows if "rebalance" in r]}


def test_a_slow_replica_gets_fewer_microbatches_mid_run_and_the_losses_stay_one_process(cluster):
    job = make_job(2, global_batch=8, iters=4, model_kw=DROPOUT)
    reference = train_with_hook(0, 1, make_job(1, global_batch=8, iters=4, model_kw=DROPOUT), None)
    assert reference["moves"] == []  # one replica: nothing to move
    reports = cluster.run(train_with_hook, 2, job, 1)
    for rep in reports:
        assert [m["to"] for m in rep["moves"]] == [[6, 2]], rep["moves"]  # 6 x 1 s vs 2 x 3 s, after step 2
        assert rep["moves"][0]["moved"] == "microbatches" and "replica 1 runs 3.00x" in rep["moves"][0]["reason"]
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-6, atol=0)
    clean = cluster.run(train_with_hook, 2, job, None)
    assert all(rep["moves"] == [] for rep in clean)
