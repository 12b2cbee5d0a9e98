"""Per-rank setup of inference ranks (started by launch.local or torchrun)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatronapp.launch.roles import backend_for, init_default_group
from megatronapp.parallel.device import select_device


def start_worker(run):
    """Join the process group (when launched), build groups and load this rank's model of `run`
    (inference.cli.InferenceRun: checkpoint, TP x PP, device, dtype)."""
    from megatronapp.config import build_layout
    from megatronapp.inference.model import build_inference_model, read_model_config
    from megatronapp.parallel.groups import build_process_groups

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = select_device(run.device, int(os.environ.get("LOCAL_RANK", "0")))
    init_default_group(backend_for(device), world, rank)
    layout = build_layout(world, run.tp_size, run.pp_size)
    groups = build_process_groups(layout, rank)
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    return build_inference_model(read_model_config(run.load), groups, device, load_dir=run.load, dtype=dtype)


def finish_worker() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
