"""Shared by the inference and MegaScope tests: a tiny trained checkpoint and per-rank jobs."""

from __future__ import annotations

import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.config import build_layout
from megatronapp.engine.checkpoint import save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.parallel.groups import build_process_groups

PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101], [1, 2, 3, 4, 5, 6]]


def save_tiny_checkpoint(save_dir: str, iters: int = 3, preset: str = "tiny") -> None:
    """Train the tiny model (seq 16) a few steps in this process and save it."""
    job = make_job(1, iters=iters, preset=preset)
    groups = build_process_groups(job.layout, 0)
    data = RandomTokenBatches(job, 0)
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    trainer.train()
    save_checkpoint(save_dir, trainer, data)


def load_model(rank: int, world: int, tp: int, pp: int, load_dir: str):
    groups = build_process_groups(build_layout(world, tp, pp), rank)
    return build_inference_model(read_model_config(load_dir), groups, "cpu", load_dir=load_dir)
