"""Where the ranks of a `train` job compute, checked before anything is launched.

The placement rule and the transport choice are pure (parallel/placement.py); this module
only reads the flags, the visible GPUs and torchrun's ranks per node.
"""

from __future__ import annotations

import argparse

import torch

from megatronapp.config import ConfigError, JobConfig
from megatronapp.parallel.device import check_layout_devices, ranks_per_node
from megatronapp.parallel.layout import LayoutError


def check_job_devices(args: argparse.Namespace, job: JobConfig, world: int, visible_gpus: int | None = None) -> None:
    """One-line ConfigError when a requested device is missing, or when the layout would put two
    ranks of one NCCL group on one GPU (e.g. PP2 on a one-GPU machine): NCCL refuses that at
    run time with 'invalid usage', after every process has started."""
    gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if args.forward_backward_disaggregating:
        if job.train.overlap_param_update:
            raise ConfigError("--overlap-param-update is not supported with --forward-backward-disaggregating")
        from megatronapp.fbd.cli import fbd_placements_from_args, role_layout_from_args

        fbd_placements_from_args(args, role_layout_from_args(args, world), gpus, ranks_per_node())
        return
    try:
        kind = check_layout_devices(args.device, job.layout, gpus)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if job.train.overlap_param_update and kind != "cuda":
        raise ConfigError("--overlap-param-update needs CUDA (the update runs on a side stream)")
