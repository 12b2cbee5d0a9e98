"""The runtime executes every schedule for many (PP, virtual stages, microbatches) without
deadlock, and every schedule yields the gradients of a single process on the same batch."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups

NUM_LAYERS = 8


def _combos(pp: int) -> list[tuple[str, int, int]]:
    combos = []
    for m in (1, 2, 3, 5, 8):
        combos += [("gpipe", 1, m), ("1f1b", 1, m)]
    for v in (2, 4):
        if NUM_LAYERS % (pp * v) == 0:
            combos += [("interleaved", v, m) for m in (pp, 2 * pp, 3 * pp)]
    return combos


def grads_for_combos(rank: int, world: int, combos) -> list[dict]:
    out = []
    for schedule, vpp, m in combos:
        job = make_job(world, 1, world, vpp, schedule, global_batch=m, iters=1, num_layers=NUM_LAYERS)
        groups = build_process_groups(job.layout, rank)
        trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, 0))
        trainer.train_step()
        out.append({n: p.grad.clone() for c in trainer.chunks for n, p in c.named_parameters()})
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_single_process(cluster, pp):
    assert_schedules_match_single_process(cluster, pp, _combos(pp))


def assert_schedules_match_single_process(cluster, pp: int, combos) -> None:
    """Every (schedule, V, M) of `combos` on `pp` ranks gives one process's 1F1B gradients."""
    per_rank = cluster.run(grads_for_combos, pp, combos)
    torch.set_num_threads(1)
    refs = {m: grads_for_combos(0, 1, [("1f1b", 1, m)])[0] for m in {m for _, _, m in combos}}
    for i, (schedule, vpp, m) in enumerate(combos):
        full = {}
        for rank_grads in per_rank:
            full.update(rank_grads[i])
        assert full.keys() == refs[m].keys()
        for name, g in full.items():
            torch.testing.assert_close(
                g, refs[m][name], rtol=1e-4, atol=1e-6, msg=lambda msg: f"{schedule} V={vpp} M={m} {name}: {msg}"
            )
