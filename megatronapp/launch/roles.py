"""The seam between the training-rank body and its variants: a `TrainingRole` per rank.

The body (cli/train.py:run_rank) is the same for every rank of every training job: join the
default group, build the groups, data, tracer and fault injection, run, report, tear down. What
differs by rank is its role, picked by rank before anything is built: a plain rank (one engine
Trainer, cli/train.py:PlainRole) or, under forward-backward disaggregation, a backward worker or
a forward worker (fbd/roles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatronapp.config import JobConfig
from megatronapp.data.dataset import DistributedBatchIterator
from megatronapp.engine.hooks import NullTracer
from megatronapp.engine.trainer import Trainer
from megatronapp.injection.inject import FaultInjector
from megatronapp.parallel.groups import ParallelGroups

# (engine Trainer) -> metrics history: resume from --load, then train with logging and saving
TrainLoop = Callable[[Trainer], list[dict]]


@dataclass(frozen=True)
class RankContext:
    """What the body has built for a role to run with."""

    job: JobConfig  # of the engine's layout (under FBD: the backward workers')
    data: DistributedBatchIterator  # this rank's data-parallel replica's batches
    injector: FaultInjector | None  # --inject-slowdown / --inject-link-delay on this rank
    # MegaScan's Tracer, which implements the engine's observer protocol (engine/hooks.py)
    tracer: NullTracer | None


class TrainingRole(Protocol):
    device: torch.device  # where this rank computes
    backend: str  # of the default process group
    device_id: torch.device | None  # bound to the default group (eager NCCL init), or None
    trace_meta: dict  # overrides of this rank's trace metadata (rank, world_size, role)

    def build_groups(self) -> ParallelGroups:
        """This rank's groups as the engine sees them; collective over the default group."""

    def run(self, ctx: RankContext, train_loop: TrainLoop) -> list[dict]:
        """Train; the metrics history (empty where this rank keeps none)."""

    def finish(self, summary_file: str | None) -> None:
        """After training, on every rank (may be collective): add this role's summary rows."""

    def close(self) -> None:
        """Release what the role built beyond the groups (a runtime's own groups)."""


def backend_for(device: torch.device) -> str:
    """The default group's backend for ranks computing on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_default_group(backend: str, world: int, rank: int, device_id: torch.device | None = None) -> None:
    """Initialise the default process group (every launched command's ranks: training roles and
    inference workers) unless alone or already initialised."""
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device_id)


def join_default_group(role: TrainingRole, world: int, rank: int) -> None:
    """Initialise the default process group for `role` unless alone or already initialised."""
    init_default_group(role.backend, world, rank, role.device_id)
