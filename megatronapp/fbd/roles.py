"""The two roles of a MegaFBD job, picked by rank: a backward worker or a forward worker.

Both plug into the one training-rank body (cli/train.py:run_rank) as a
launch.roles.TrainingRole; the body builds data, tracer and fault injection, the role its
groups, placement and worker. Backward workers run the body's logged training loop on their
engine Trainer; forward workers run their own loop. After training every rank joins one
reduction of the seconds each role waited on the other (the summary's rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.engine.checkpoint import has_checkpoint
from megatronapp.fbd.backward import BackwardWorker
from megatronapp.fbd.cli import build_role_layout, compute_fbd_placements
from megatronapp.fbd.config import FbdConfig, FbdInjection
from megatronapp.fbd.forward import ForwardWorker
from megatronapp.fbd.groups import build_role_groups
from megatronapp.fbd.layout import RoleLayout
from megatronapp.fbd.links import LinkDevices
from megatronapp.files import write_text_atomic
from megatronapp.launch.roles import RankContext, TrainLoop
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.parallel.placement import Placement, compute_default_backend


@dataclass(frozen=True)
class RankPlacement:
    """What one rank needs from the job's placements (parallel/placement.py): FBD ranks and the benchmark's."""

    device: torch.device  # where it computes (the current CUDA device is set to it)
    links: LinkDevices  # where each of its point-to-point links keeps its tensors
    backend: str  # of the default process group


def place_rank(placements: tuple[Placement, ...], rank: int) -> RankPlacement:
    """Where `rank` computes and keeps each link's tensors; sets the current CUDA device."""
    p = placements[rank]
    device = torch.device("cuda", p.index) if p.is_cuda else torch.device("cpu")
    if p.is_cuda:
        torch.cuda.set_device(device)
    return RankPlacement(
        device, LinkDevices.from_placements(placements, rank, device), compute_default_backend(placements)
    )


class _FbdRole:
    """What both roles share: layout, placement, groups and the waits reported after training."""

    role = ""

    def __init__(
        self, fbd: FbdConfig, injection: FbdInjection, device: str | None, lay: RoleLayout, rank: int, local_world: int
    ):
        self.lay, self.rank, self.fbd, self.injection = lay, rank, fbd, injection
        placements = compute_fbd_placements(device, fbd.forward_device, lay, torch.cuda.device_count(), local_world)
        self.placed = place_rank(placements, rank)
        self.device, self.backend = self.placed.device, self.placed.backend
        self.device_id = None  # NCCL communicators are made per group, lazily
        self.trace_meta = {"rank": rank, "world_size": lay.world_size, "role": self.role}
        self.groups = self.worker = None

    def build_groups(self) -> ParallelGroups:
        self.groups = build_role_groups(self.lay, self.rank)
        return self.groups.parallel

    def _worker_kwargs(self, ctx: RankContext) -> dict:
        return {
            "links": self.placed.links,
            "injection": self.injection,
            **({"tracer": ctx.tracer} if ctx.tracer else {}),
        }

    def finish(self, summary_file: str | None) -> None:
        stats = gather_role_waits(self.worker, self.lay, self.rank)
        if self.rank == 0 and summary_file:
            _add_summary_rows(Path(summary_file), stats)

    def close(self) -> None:
        pass


class BackwardRole(_FbdRole):
    """Backward worker: an engine Trainer whose stage inputs come from forward workers."""

    role = "backward"

    def run(self, ctx: RankContext, train_loop: TrainLoop) -> list[dict]:
        self.worker = BackwardWorker(
            ctx.job, self.fbd, self.groups, self.device, ctx.data, injector=ctx.injector, **self._worker_kwargs(ctx)
        )
        return train_loop(self.worker.trainer)


class ForwardRole(_FbdRole):
    """Forward worker: runs the forward pass on weights published by its backward twins."""

    role = "forward"

    def run(self, ctx: RankContext, train_loop: TrainLoop) -> list[dict]:
        self.worker = ForwardWorker(ctx.job, self.fbd, self.groups, self.device, ctx.data, **self._worker_kwargs(ctx))
        load = ctx.job.checkpoint.load
        if load and has_checkpoint(load):
            self.worker.load(load)
        self.worker.train(ctx.job.train.train_iters)
        return []


def pick_fbd_role(
    job, fbd: FbdConfig, injection: FbdInjection, device: str | None, world: int, rank: int, local_world: int
) -> _FbdRole:
    """The role of global rank `rank` in an FBD job of `world` ranks (backward ranks first); `job`
    describes the backward workers' layout, `device` is --device (forward workers: fbd.forward_device)."""
    lay = build_role_layout(world, job.layout.tp_size, job.layout.pp_size, fbd)
    role = ForwardRole if lay.role_of(rank).is_forward else BackwardRole
    return role(fbd, injection, device, lay, rank, local_world)


def gather_role_waits(worker, lay: RoleLayout, rank: int) -> dict:
    """Once, after training, on every rank: seconds each role waited on the other, and the
    largest gap between forward-worker and recomputed losses. On the CPU (gloo): the default
    group may hold two ranks of one GPU, which NCCL refuses."""
    values = torch.zeros(lay.world_size + 1, dtype=torch.float64)
    values[rank] = worker.waits.on_other_role_s
    if worker.role == "backward":
        values[-1] = worker.runtime.loss_gap
    gaps = values[-1:].clone()
    dist.all_reduce(values[:-1])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    waits = values[:-1].tolist()
    b = lay.num_backward
    return {
        "backward_waited_on_forward_s": max(waits[:b]),
        "forward_waited_on_backward_s": max(waits[b:]),
        "forward_vs_recomputed_loss_max_abs": float(gaps[0]),
    }


def _add_summary_rows(path: Path, stats: dict) -> None:
    summary = json.loads(path.read_text()) if path.is_file() else {"history": []}
    summary["rows"] = summary.get("rows", []) + [
        ["backward waited on forward (max rank)", f"{stats['backward_waited_on_forward_s']:.3f} s"],
        ["forward waited on backward (max rank)", f"{stats['forward_waited_on_backward_s']:.3f} s"],
        ["forward vs recomputed loss, max |diff|", f"{stats['forward_vs_recomputed_loss_max_abs']:.2e}"],
    ]
    summary["fbd"] = stats
    write_text_atomic(path, json.dumps(summary))
