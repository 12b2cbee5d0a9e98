"""AdamW with Megatron's parameter groups and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatronapp.config import TrainConfig


def build_optimizer(chunks: list[nn.Module], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; biases and norm weights (1-D tensors) get no weight decay."""
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None,
    )


def compute_lr(iteration: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `iteration` (0-based): linear warm-up, then cosine decay to min_lr."""
    if cfg.lr_warmup_iters and iteration < cfg.lr_warmup_iters:
        return cfg.lr * (iteration + 1) / cfg.lr_warmup_iters
    decay_iters = (cfg.lr_decay_iters or cfg.train_iters) - cfg.lr_warmup_iters
    if decay_iters <= 0:
        return cfg.lr
    progress = min(1.0, (iteration - cfg.lr_warmup_iters) / decay_iters)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
