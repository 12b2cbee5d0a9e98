"""FBD training jobs shared by the MegaFBD tests: run inside dist_harness cluster workers."""

from __future__ import annotations

import torch
from engine_jobs import RandomTokenBatches, full_grads

from megatronapp.fbd.backward import BackwardWorker
from megatronapp.fbd.config import FbdConfig, FbdInjection
from megatronapp.fbd.forward import ForwardWorker
from megatronapp.fbd.groups import build_role_groups
from megatronapp.fbd.layout import RoleLayout, compute_role_placements
from megatronapp.fbd.links import LinkDevices


def build_worker(rank: int, world: int, job, fbd: FbdConfig, injection: FbdInjection = FbdInjection()):
    """The role `rank` plays in an FBD job whose backward layout is job.layout."""
    lay = RoleLayout(world, job.layout.tp_size, job.layout.pp_size, fbd.forward_tp_size)
    assert lay.num_backward == job.layout.world_size
    groups = build_role_groups(lay, rank)
    data = RandomTokenBatches(job, groups.coords.dp)
    cpu = torch.device("cpu")
    links = LinkDevices.from_placements(compute_role_placements(lay, "cpu", "cpu"), rank, cpu)
    cls = ForwardWorker if groups.is_forward else BackwardWorker
    return cls(job, fbd, groups, cpu, data, links=links, injection=injection), data


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
            grads = full_grads(trainer)  # collective over DP (distributed optimizer)
            grads = grads if trainer.groups.dp_rank == 0 else {}
    return {
        "role": "backward",
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "loss_gap": worker.runtime.loss_gap,
        "waits": worker.waits.on_other_role_s,
    }


def fbd_losses(
    rank: int,
    world: int,
    job,
    fbd: FbdConfig,
    steps: int,
    save_dir: str | None = None,
    load_dir: str | None = None,
    injection: FbdInjection = FbdInjection(),
) -> list[float] | None:
    """Train `steps` more steps under FBD (optionally loading first and saving after);
    backward workers return their losses, forward workers None."""
    from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint

    worker, data = build_worker(rank, world, job, fbd, injection)
    if worker.role == "forward":
        if load_dir:
            worker.load(load_dir)
        worker.train(worker.iteration + steps)
        return None
    if load_dir:
        load_checkpoint(load_dir, worker.trainer, data)
    losses = [m.loss for m in worker.trainer.train(steps)]
    if save_dir:
        save_checkpoint(save_dir, worker.trainer, data)
    return losses


def plain_losses(rank: int, world: int, job, steps: int, load_dir: str | None = None) -> list[float]:
    """Train `steps` steps without FBD, optionally from a checkpoint."""
    from megatronapp.engine.checkpoint import load_checkpoint
    from megatronapp.engine.trainer import Trainer
    from megatronapp.parallel.groups import build_process_groups

    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    if load_dir:
        load_checkpoint(load_dir, trainer, data)
    return [m.loss for m in trainer.train(steps)]
