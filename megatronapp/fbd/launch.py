"""The body of one MegaFBD process: pick the role by rank, build it, train, report waits.

The CLI hands in the parts it owns (data, tracer, the logged train loop) as a `CliParts`,
so this package never imports the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.config import JobConfig
from megatronapp.engine.checkpoint import has_checkpoint
from megatronapp.fbd.backward import BackwardWorker
from megatronapp.fbd.cli import fbd_config_from_args, fbd_placements_from_args, role_layout_from_args
from megatronapp.fbd.forward import ForwardWorker
from megatronapp.fbd.links import LinkDevices
from megatronapp.files import write_text_atomic
from megatronapp.fbd.groups import build_role_groups
from megatronapp.fbd.layout import RoleLayout
from megatronapp.parallel.placement import Placement, compute_default_backend


@dataclass(frozen=True)
class CliParts:
    build_data: Callable  # (args, tokenizer, job, groups: ParallelGroups) -> batch iterator
    build_tracer: Callable  # (args, job, groups, device, rank_meta_overrides) -> (tracer | None, instrumentation)
    train_loop: Callable  # (args, job, trainer, data, rank) -> metrics history (logs, saves, summary)
    build_injector: Callable  # (rank, device) -> engine fault injector or None
    maybe_load: Callable  # (job, trainer, data, rank): resume from --load when it holds a checkpoint


@dataclass(frozen=True)
class RankPlacement:
    """What one rank needs from the job's placements (parallel/placement.py): FBD ranks and the benchmark's."""

    device: torch.device  # where it computes (the current CUDA device is set to it)
    links: LinkDevices  # where each of its point-to-point links keeps its tensors
    backend: str  # of the default process group


def place_rank(placements: tuple[Placement, ...], rank: int) -> RankPlacement:
    p = placements[rank]
    device = torch.device("cuda", p.index) if p.is_cuda else torch.device("cpu")
    if p.is_cuda:
        torch.cuda.set_device(device)
    return RankPlacement(device, LinkDevices.from_placements(placements, rank, device),
                         compute_default_backend(placements))


def run_fbd_rank(args: argparse.Namespace, job: JobConfig, tokenizer, parts: CliParts) -> list[dict]:
    """Train as global rank RANK of an FBD job; backward rank 0 returns the metrics history."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    lay, fbd = role_layout_from_args(args, world), fbd_config_from_args(args)
    placements = fbd_placements_from_args(args, lay, torch.cuda.device_count(),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    placed = place_rank(placements, rank)
    device = placed.device
    if not dist.is_initialized():  # no device_id: NCCL communicators are made per group, lazily
        dist.init_process_group(placed.backend, rank=rank, world_size=world)
    tracer = instrumentation = None
    try:  # every exit path tears the process group down and flushes the trace
        groups = build_role_groups(lay, rank)
        data = parts.build_data(args, tokenizer, job, groups.parallel)
        role = "forward" if groups.is_forward else "backward"
        tracer, instrumentation = parts.build_tracer(args, job, groups.parallel, device,
                                                     {"rank": rank, "world_size": world, "role": role})
        kw = {"links": placed.links, **({"tracer": tracer} if tracer else {})}
        history: list[dict] = []
        if groups.is_forward:
            worker = ForwardWorker(job, fbd, groups, device, data, **kw)
            if job.train.load and has_checkpoint(job.train.load):
                worker.load(job.train.load)
            worker.train(job.train.train_iters)
        else:
            injector = parts.build_injector(rank, device)
            worker = BackwardWorker(job, fbd, groups, device, data, injector=injector, **kw)
            parts.maybe_load(job, worker.trainer, data, rank)
            history = parts.train_loop(args, job, worker.trainer, data, rank)
        stats = gather_role_waits(worker, lay, rank)
        if rank == 0 and args.summary_file:
            _add_summary_rows(Path(args.summary_file), stats)
        return history
    finally:
        if instrumentation is not None:
            instrumentation.uninstall()
        if tracer is not None:
            tracer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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
    return {"backward_waited_on_forward_s": max(waits[:b]), "forward_waited_on_backward_s": max(waits[b:]),
            "forward_vs_recomputed_loss_max_abs": float(gaps[0])}


def _add_summary_rows(path: Path, stats: dict) -> None:
    summary = json.loads(path.read_text()) if path.is_file() else {"history": []}
    summary["rows"] = summary.get("rows", []) + [
        ["backward waited on forward (max rank)", f"{stats['backward_waited_on_forward_s']:.3f} s"],
        ["forward waited on backward (max rank)", f"{stats['forward_waited_on_backward_s']:.3f} s"],
        ["forward vs recomputed loss, max |diff|", f"{stats['forward_vs_recomputed_loss_max_abs']:.2e}"]]
    summary["fbd"] = stats
    write_text_atomic(path, json.dumps(summary))
