"""The transformer's MLP, tensor-parallel: fc2(gelu(fc1(x))), or with SwiGLU
fc2(silu(gate(x)) * fc1(x)). The gate is its own column-parallel linear rather than half of
a fused fc1, so every parameter is sliced over TP along one dim and a checkpoint re-shards
without knowing which half is which."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.model.layer_parts import TPContext, tp_linear_kwargs
from megatronapp.parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = dict(bias=cfg.add_bias_linear, **tp_linear_kwargs(tp, seed, device))
        h, f = cfg.hidden_size, cfg.ffn_size
        self.gate = ColumnParallelLinear(f"{name}.gate", h, f, std=cfg.init_method_std, **kw) if cfg.swiglu else None
        self.fc1 = ColumnParallelLinear(f"{name}.fc1", h, f, std=cfg.init_method_std, **kw)
        self.fc2 = RowParallelLinear(f"{name}.fc2", f, h, std=out_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return self.fc2(F.silu(self.gate(x)) * self.fc1(x))  # (B, S, F/TP) each
