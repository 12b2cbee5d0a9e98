"""Tensor-parallel layers: column/row-parallel linears and a vocab-parallel embedding.

Each parameter carries `tp_split_dim`: the dim along which the full tensor is sliced across
TP ranks, or None when it is replicated. Checkpoint conversion and gradient-norm
computation read that attribute instead of guessing from names.

Weights are initialised full-size on the CPU from a generator seeded by (seed, parameter
name), sliced, and only the slice is moved to the device: every layout and device type
starts from exactly the same model, and a rank holds at most one full parameter at a time.

With `sequence_parallel`, activations outside the TP blocks are sequence shards (see
mappings.py): the column-parallel input is all-gathered instead of copied, the row-parallel
output reduce-scattered instead of all-reduced. Parameters applied to a sequence shard
(LayerNorm, the row-parallel bias) see only 1/TP of the tokens, so their gradient is
all-reduced over TP in backward (`sp_replicated`); they carry `sequence_parallel = True`.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.parallel.fp8 import DelayedScaling, FP8Spec, fp8_linear
from megatronapp.parallel.mappings import (
    copy_to_tp,
    gather_from_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)
from megatronapp.parallel.wgrad_defer import linear_with_deferred_weight_grad
from megatronapp.parallel.wgrad_fusion import linear_with_grad_accumulation


def init_full_normal(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """Deterministic N(0, std) CPU tensor for a named parameter, identical for every layout."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, device) -> torch.Tensor:
    return full.chunk(tp_size, dim=dim)[tp_rank].to(device, copy=True).contiguous()


def sp_replicated(param: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """A replicated parameter as used on a sequence shard: its grad is summed over TP."""
    return copy_to_tp(param, tp_group) if sequence_parallel else param


def mark_split(param: nn.Parameter, dim: int | None) -> nn.Parameter:
    param.tp_split_dim = dim
    return param


class _ParallelLinear(nn.Module):
    """Shared state of the TP linears: the weight's shard along `split_dim` (0: output rows,
    1: input columns), the bias `_make_bias` gives, and the flags the forward reads."""

    split_dim: int

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        tp_group,
        tp_size: int,
        tp_rank: int,
        std: float,
        seed: int,
        bias: bool = True,
        device="cpu",
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        full = init_full_normal(f"{name}.weight", (out_features, in_features), std, seed)
        dim = self.split_dim
        self.weight = mark_split(nn.Parameter(_shard(full, dim, tp_size, tp_rank, device)), dim)
        self.bias = self._make_bias(out_features, tp_size, device) if bias else None
        self.wgrad_fusion = False  # set by parallel.wgrad_fusion.enable_grad_accumulation_fusion
        self.split_backward = False  # set by parallel.wgrad_defer.apply_split_backward
        self.fp8_spec: FP8Spec | None = None  # set by parallel.fp8.enable_fp8
        self.fp8_state: DelayedScaling | None = None  # the delayed recipe's, set there too

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_spec is not None:
            return fp8_linear(
                x,
                self.weight,
                bias,
                self.fp8_spec,
                main_grad=self.weight.main_grad if self.wgrad_fusion else None,
                state=self.fp8_state,
                defer_weight_grad=self.split_backward,
            )
        if self.split_backward:
            return linear_with_deferred_weight_grad(x, self.weight, bias, fused=self.wgrad_fusion)
        if self.wgrad_fusion:
            return linear_with_grad_accumulation(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T with A split along its output dim; input replicated (or a sequence shard
    gathered here), output sharded."""

    split_dim = 0

    def _make_bias(self, out_features: int, tp_size: int, device) -> nn.Parameter:
        return mark_split(nn.Parameter(torch.zeros(out_features // tp_size, device=device)), 0)

    def fp8_spec_for(self, grad_dtype: torch.dtype) -> FP8Spec:
        # input whole (copied or gathered); weight rows and output-gradient columns sharded
        return FP8Spec(grad_dtype, input_group=None, weight_group=self.tp_group, grad_group=self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence_parallel(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group)
        return self._matmul(x, self.bias)


class RowParallelLinear(_ParallelLinear):
    """y = x A^T with A split along its input dim; input sharded, output summed over TP."""

    split_dim = 1

    def _make_bias(self, out_features: int, tp_size: int, device) -> nn.Parameter:
        # replicated and added after the reduction, once
        bias = mark_split(nn.Parameter(torch.zeros(out_features, device=device)), None)
        bias.sequence_parallel = self.sequence_parallel
        return bias

    def fp8_spec_for(self, grad_dtype: torch.dtype) -> FP8Spec:
        # input and weight columns sharded; the output gradient whole (after g's identity
        # backward, or the sequence-parallel all-gather)
        return FP8Spec(grad_dtype, input_group=self.tp_group, weight_group=self.tp_group, grad_group=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        y = (
            reduce_scatter_to_sequence_parallel(y, self.tp_group)
            if self.sequence_parallel
            else reduce_from_tp(y, self.tp_group)
        )
        return y if self.bias is None else y + sp_replicated(self.bias, self.tp_group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up its own id range."""

    def __init__(
        self,
        name: str,
        vocab_size: int,
        hidden: int,
        *,
        tp_group,
        tp_size: int,
        tp_rank: int,
        std: float,
        seed: int,
        device="cpu",
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.vocab_start = tp_rank * (vocab_size // tp_size)
        self.vocab_end = self.vocab_start + vocab_size // tp_size
        full = init_full_normal(f"{name}.weight", (vocab_size, hidden), std, seed)
        self.weight = mark_split(nn.Parameter(_shard(full, 0, tp_size, tp_rank, device)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, S) ids -> (B, S, H), or the (B, S/TP, H) shard with sequence parallelism."""
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(emb, self.tp_group)
        return reduce_from_tp(emb, self.tp_group)


class LayerNorm(nn.Module):
    """LayerNorm over the hidden dim; replicated over TP (and summed over TP in backward
    when applied to sequence shards)."""

    def __init__(self, hidden: int, eps: float, *, tp_group=None, sequence_parallel: bool = False, device="cpu"):
        super().__init__()
        self.eps, self.tp_group, self.sequence_parallel = eps, tp_group, sequence_parallel
        self.weight = mark_split(nn.Parameter(torch.ones(hidden, device=device)), None)
        self.bias = mark_split(nn.Parameter(torch.zeros(hidden, device=device)), None)
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sp_replicated(self.weight, self.tp_group, self.sequence_parallel)
        b = sp_replicated(self.bias, self.tp_group, self.sequence_parallel)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the hidden dim (no bias, no centring); replicated
    over TP as LayerNorm."""

    def __init__(self, hidden: int, eps: float, *, tp_group=None, sequence_parallel: bool = False, device="cpu"):
        super().__init__()
        self.eps, self.tp_group, self.sequence_parallel = eps, tp_group, sequence_parallel
        self.weight = mark_split(nn.Parameter(torch.ones(hidden, device=device)), None)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sp_replicated(self.weight, self.tp_group, self.sequence_parallel)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)
