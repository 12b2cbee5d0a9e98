"""Tensor-parallel layers: column/row-parallel linears and a vocab-parallel embedding.

Each parameter carries `tp_split_dim`: the dim along which the full tensor is sliced across
TP ranks, or None when it is replicated. Checkpoint conversion and gradient-norm
computation read that attribute instead of guessing from names.

Weights are initialised full-size from a generator seeded by (seed, parameter name) and
then sliced, so every layout starts from exactly the same full model.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.parallel.mappings import copy_to_tp, reduce_from_tp


def init_full_normal(name: str, shape: tuple[int, ...], std: float, seed: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic N(0, std) tensor for a named parameter, identical for every layout."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std


def _shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def mark_split(param: nn.Parameter, dim: int | None) -> nn.Parameter:
    param.tp_split_dim = dim
    return param


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split along its output dim; input replicated, output sharded."""

    def __init__(self, name: str, in_features: int, out_features: int, *, tp_group, tp_size: int,
                 tp_rank: int, std: float, seed: int, bias: bool = True, device="cpu"):
        super().__init__()
        self.tp_group = tp_group
        full = init_full_normal(f"{name}.weight", (out_features, in_features), std, seed, device)
        self.weight = mark_split(nn.Parameter(_shard(full, 0, tp_size, tp_rank)), 0)
        self.bias = (mark_split(nn.Parameter(torch.zeros(out_features // tp_size, device=device)), 0)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T with A split along its input dim; input sharded, output summed over TP."""

    def __init__(self, name: str, in_features: int, out_features: int, *, tp_group, tp_size: int,
                 tp_rank: int, std: float, seed: int, bias: bool = True, device="cpu"):
        super().__init__()
        self.tp_group = tp_group
        full = init_full_normal(f"{name}.weight", (out_features, in_features), std, seed, device)
        self.weight = mark_split(nn.Parameter(_shard(full, 1, tp_size, tp_rank)), 1)
        # The bias is replicated and added after the reduction, once.
        self.bias = mark_split(nn.Parameter(torch.zeros(out_features, device=device)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up its own id range."""

    def __init__(self, name: str, vocab_size: int, hidden: int, *, tp_group, tp_size: int,
                 tp_rank: int, std: float, seed: int, device="cpu"):
        super().__init__()
        self.tp_group = tp_group
        self.vocab_start = tp_rank * (vocab_size // tp_size)
        self.vocab_end = self.vocab_start + vocab_size // tp_size
        full = init_full_normal(f"{name}.weight", (vocab_size, hidden), std, seed, device)
        self.weight = mark_split(nn.Parameter(_shard(full, 0, tp_size, tp_rank)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(emb, self.tp_group)
