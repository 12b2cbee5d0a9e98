"""FBD training jobs shared by the MegaFBD tests: run inside dist_harness cluster workers."""

from __future__ import annotations

import torch

from engine_jobs import RandomTokenBatches, full_grads
from megatronapp.fbd.backward import BackwardWorker
from megatronapp.fbd.config import FbdConfig
from megatronapp.fbd.forward import ForwardWorker
from megatronapp.parallel.groups import build_role_groups
from megatronapp.parallel.layout import RoleLayout


def build_worker(rank: int, world: int, job, fbd: FbdConfig):
    """The role `rank` plays in an FBD job whose backward layout is job.layout."""
    lay = RoleLayout(world, job.layout.tp_size, job.layout.pp_size, fbd.forward_tp_size)
    assert lay.num_backward == job.layout.world_size
    groups = build_role_groups(lay, rank)
    data = RandomTokenBatches(job, groups.coords.dp)
    cpu = torch.device("cpu")
    cls = ForwardWorker if groups.is_forward else BackwardWorker
    return cls(job, fbd, groups, cpu, data, link_device=cpu), data


def fbd_train_and_report(rank: int, world: int, job, fbd: FbdConfig) -> dict:
    """Like engine_jobs.train_and_report, under FBD; forward workers report only their role."""
    worker, _ = build_worker(rank, world, job, fbd)
    if worker.role == "forward":
        worker.train(job.train.train_iters)
        return {"role": "forward", "waits": worker.waits.on_other_role_s}
    trainer = worker.trainer
    losses, norms, grads = [], [], None
    for step in range(job.train.train_iters):
        m = trainer.train_step()
        losses.append(m.loss)
        norms.append(m.grad_norm)
        if step == 0:
            grads = full_grads(trainer) if trainer.groups.dp_rank == 0 else {}
    return {"role": "backward", "losses": losses, "norms": norms, "grads": grads,
            "loss_gap": worker.runtime.loss_gap, "waits": worker.waits.on_other_role_s}
