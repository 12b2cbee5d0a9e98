"""AdamW with Megatron's parameter groups and a warm-up + cosine learning-rate schedule.

The optimizer step around it (main params, loss scaling, clipping, sharding) is in
engine.mixed_precision."""

from __future__ import annotations

import math

import torch

from megatronapp.config import OptimizerConfig


def build_adamw(params: list[tuple[torch.Tensor, bool]], cfg: OptimizerConfig, *, fused: bool) -> torch.optim.AdamW:
    """AdamW over (tensor, decays) pairs; Megatron gives biases and norm weights (1-D model
    params) no weight decay. fused: the single-kernel CUDA implementation."""
    decay = [t for t, d in params if d]
    no_decay = [t for t, d in params if not d]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]] or [{"params": []}],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused or None,
    )


def compute_lr(iteration: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """LR for optimizer step `iteration` (0-based): linear warm-up, then cosine decay to min_lr."""
    if cfg.lr_warmup_iters and iteration < cfg.lr_warmup_iters:
        return cfg.lr * (iteration + 1) / cfg.lr_warmup_iters
    decay_iters = (cfg.lr_decay_iters or train_iters) - cfg.lr_warmup_iters
    if decay_iters <= 0:
        return cfg.lr
    progress = min(1.0, (iteration - cfg.lr_warmup_iters) / decay_iters)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
