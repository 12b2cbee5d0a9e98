"""Where the ranks of a `train` job compute, checked before anything is launched.

The placement rule and the transport choice are pure (parallel/placement.py); this module
only reads the flags, the visible GPUs and torchrun's ranks per node.
"""

from __future__ import annotations

import argparse
import os

import torch

from megatronapp.config import ConfigError, JobConfig
from megatronapp.parallel.layout import LayoutError
from megatronapp.parallel.placement import (check_gpu_groups, compute_plain_placements, engine_group_ranks,
                                            resolve_device_kind)


def check_job_devices(args: argparse.Namespace, job: JobConfig, world: int, visible_gpus: int | None = None) -> None:
    """One-line ConfigError when a requested device is missing, or when the layout would put two
    ranks of one NCCL group on one GPU (e.g. PP2 on a one-GPU machine): NCCL refuses that at
    run time with 'invalid usage', after every process has started."""
    gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None  # under torchrun; else one node
    if args.forward_backward_disaggregating:
        from megatronapp.fbd.cli import fbd_placements_from_args, role_layout_from_args

        fbd_placements_from_args(args, role_layout_from_args(args, world), gpus, per_node)
        return
    try:
        placements = compute_plain_placements(world, resolve_device_kind(args.device, gpus), gpus, per_node)
        check_gpu_groups(engine_group_ranks(job.layout), placements, gpus)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
