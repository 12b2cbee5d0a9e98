"""What one process of a `fbd_bench.py` job runs: place the rank (parallel/placement.py, the
same rule as `megatronapp train`), then train one or more micro-batch sizes ("probes") in turn
with the same process groups, reporting each probe's step time and peak GPU memory.

Kept apart from the orchestration so that a spawned child imports only what it runs.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch
from common import FixedBatches, make_job

from megatronapp.config import JobConfig, build_layout
from megatronapp.job import validate_job

FBD_VARIANTS = ("fbd", "fbd_cpu_forward", "free_forward")


def forward_kind(variant: str, device: str) -> str:
    """Where a variant's forward workers compute: fbd on the backward device (on a GPU: their
    twin's GPU, a separate process); fbd_cpu_forward and free_forward on CPUs (free_forward's
    send zeros, so the GPU holds exactly what fbd_cpu_forward's backward workers hold)."""
    return device if variant == "fbd" else "cpu"


def world_of(variant: str, cfg) -> int:
    backward = cfg.tp * cfg.pp * cfg.dp
    return backward + (cfg.tf * cfg.pp * cfg.dp if variant in FBD_VARIANTS else 0)


def compute_placements(variant: str, cfg, gpus: int):
    """Every rank's Placement; LayoutError (one line) for a layout NCCL cannot run."""
    from megatronapp.fbd.layout import RoleLayout, compute_role_placements, role_group_ranks
    from megatronapp.parallel.placement import check_gpu_groups, compute_plain_placements, engine_group_ranks

    world = world_of(variant, cfg)
    if variant not in FBD_VARIANTS:
        placements = compute_plain_placements(world, cfg.device, gpus)
        check_gpu_groups(engine_group_ranks(build_layout(world, cfg.tp, cfg.pp)), placements, gpus)
        return placements
    lay = RoleLayout(world, cfg.tp, cfg.pp, cfg.tf)
    placements = compute_role_placements(lay, cfg.device, forward_kind(variant, cfg.device), gpus)
    check_gpu_groups(role_group_ranks(lay), placements, gpus)
    return placements


def build_bench_job(cfg, micro_batch: int, microbatches: int, variant: str) -> JobConfig:
    job = make_job(
        cfg.model,
        micro_batch,
        microbatches,
        tp=cfg.tp,
        pp=cfg.pp,
        dp=cfg.dp,
        model_overrides={"seq_length": cfg.seq_length} if cfg.seq_length else None,
        bf16=cfg.device == "cuda",
        log_interval=1,
        recompute_granularity="full" if variant == "recompute" else "none",
    )
    validate_job(job)
    return job


@dataclass
class RankSetup:
    rank: int
    variant: str
    device: torch.device
    groups: object  # ParallelGroups (plain) or RoleGroups (FBD)
    links: object = None  # LinkDevices (FBD)

    @property
    def is_forward(self) -> bool:
        return self.variant in FBD_VARIANTS and self.groups.is_forward


def setup_rank(rank: int, world: int, variant: str, cfg, store_path: str) -> RankSetup:
    """Place this rank, set its threads, start torch.distributed and build its groups."""
    import torch.distributed as dist

    from megatronapp.fbd.groups import build_role_groups
    from megatronapp.fbd.layout import RoleLayout
    from megatronapp.fbd.roles import place_rank
    from megatronapp.parallel.groups import build_process_groups
    from megatronapp.parallel.placement import compute_default_backend

    placements = compute_placements(variant, cfg, torch.cuda.device_count() if cfg.device == "cuda" else 0)
    placed = place_rank(placements, rank)  # device, per-link devices, default backend
    torch.set_num_threads(
        cfg.threads if placed.device.type == "cuda" or cfg.device == "cpu" else cfg.cpu_forward_threads
    )
    if world > 1:
        dist.init_process_group(
            compute_default_backend(placements), store=dist.FileStore(store_path, world), rank=rank, world_size=world
        )
    if variant not in FBD_VARIANTS:
        return RankSetup(rank, variant, placed.device, build_process_groups(build_layout(world, cfg.tp, cfg.pp), rank))
    groups = build_role_groups(RoleLayout(world, cfg.tp, cfg.pp, cfg.tf), rank)
    return RankSetup(rank, variant, placed.device, groups, placed.links)


def run_probe(s: RankSetup, cfg, micro_batch: int, microbatches: int, steps: int, warmup: int) -> dict:
    """Train `warmup + steps` steps at this micro batch; the median step time after warm-up
    (backward side) and this process's peak GPU memory."""
    from megatronapp.engine.trainer import Trainer
    from megatronapp.fbd.backward import BackwardWorker
    from megatronapp.fbd.config import FbdConfig, FbdInjection
    from megatronapp.fbd.forward import ForwardWorker

    job = build_bench_job(cfg, micro_batch, microbatches, s.variant)
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    out: dict = {"role": "forward" if s.is_forward else "backward"}
    if s.variant not in FBD_VARIANTS:
        worker = Trainer(job, s.groups, s.device, FixedBatches(job, dp_rank=s.groups.dp_rank))
        out["step_s"] = _timed(worker, warmup + steps, warmup)
    else:
        fbd = FbdConfig(forward_tp_size=cfg.tf, max_ahead=cfg.max_ahead)
        injection = FbdInjection(free_forward=s.variant == "free_forward")
        data = FixedBatches(job, dp_rank=s.groups.coords.dp)
        cls = ForwardWorker if s.is_forward else BackwardWorker
        worker = cls(job, fbd, s.groups, s.device, data, links=s.links, injection=injection)
        if s.is_forward:
            worker.train(warmup + steps)
        else:
            out["step_s"] = _timed(worker.trainer, warmup + steps, warmup)
    if s.device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(s.device) / 2**30
    del worker
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _timed(trainer, steps: int, warmup: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()  # resolves its metrics: one host sync per step
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:] or times)


def child(rank: int, world: int, variant: str, cfg, store_path: str, probes: list[tuple], results) -> None:
    """Spawned entry: one message per finished probe, (rank, micro_batch, result, error)."""
    micro_batch = None
    try:
        setup = setup_rank(rank, world, variant, cfg, store_path)
        for micro_batch, microbatches, steps, warmup in probes:
            results.put((rank, micro_batch, run_probe(setup, cfg, micro_batch, microbatches, steps, warmup), None))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        results.put((rank, micro_batch, None, f"{type(e).__name__}: {first}"[:300]))
