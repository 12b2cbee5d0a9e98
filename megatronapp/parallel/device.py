"""The device of this rank and the pre-launch device check of a plain (one-role) job.

Both apply the one placement rule of parallel/placement.py (local rank -> GPU) to what this
machine has: the visible GPUs and torchrun's ranks per node. Training, generation, capture and
the UI server all start their ranks through these two functions.
"""

from __future__ import annotations

import os

import torch

from megatronapp.parallel.layout import LayoutError, ParallelLayout
from megatronapp.parallel.placement import (
    check_gpu_groups,
    compute_plain_placements,
    engine_group_ranks,
    local_gpu_index,
    resolve_device_kind,
)


def ranks_per_node() -> int | None:
    """torchrun's LOCAL_WORLD_SIZE when launched by it; None: every rank on this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None


def check_layout_devices(requested: str | None, layout: ParallelLayout, visible_gpus: int | None = None) -> str:
    """The device kind the ranks will use ("cpu" or "cuda"); LayoutError (one line) when the
    requested device is missing, or when the layout would put two ranks of one NCCL group on one
    GPU (NCCL refuses that only after every process started)."""
    gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    kind = resolve_device_kind(requested, gpus)
    placements = compute_plain_placements(layout.world_size, kind, gpus, ranks_per_node())
    check_gpu_groups(engine_group_ranks(layout), placements, gpus)
    return kind


def select_device(requested: str | None, local_rank: int) -> torch.device:
    """This rank's device (and the current CUDA device), by the placement rule."""
    try:
        kind = resolve_device_kind(requested, torch.cuda.device_count())
    except LayoutError as exc:
        raise SystemExit(f"megatronapp: {exc}") from None
    if kind == "cpu":
        return torch.device("cpu")
    index = local_gpu_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
