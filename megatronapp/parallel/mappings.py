"""Megatron's f/g conjugate mappings: the whole of tensor parallelism's communication.

    copy_to_tp      (f): forward identity,   backward all-reduce over TP
    reduce_from_tp  (g): forward all-reduce, backward identity

A column-parallel linear is preceded by f (its input is replicated, so the gradient w.r.t.
that input is a sum of the partial gradients of each TP rank); a row-parallel linear is
followed by g (each rank holds a partial sum of the output). With group None both are
identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronapp.parallel.eager_only import eager_only


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Communication stays outside torch.compile regions: compiled code between two mappings is
# purely local, and with no group (TP=1) a whole attention or MLP block compiles as one graph.
@eager_only
def _copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


@eager_only
def _reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _copy_to_tp(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _reduce_from_tp(x, group)


# -- sequence parallelism -----------------------------------------------------------------
# Activations outside the tensor-parallel blocks are (B, S/TP, H) shards along the sequence
# (dim 1). Entering a column-parallel block they are all-gathered (backward: reduce-scatter);
# leaving a row-parallel block the partial sums are reduce-scattered (backward: all-gather)
# instead of all-reduced: the same bytes as one all-reduce, and LayerNorm, dropout and the
# residual add run on 1/TP of the tokens.

# torch >= 2.13 renames the tensor collectives (the old names warn); the device runs 2.11.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    b = x.shape[0]
    parts = torch.empty((size * b,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)  # (TP*B, S/TP, ...)
    _all_gather_flat(parts, x.contiguous(), group=group)
    return torch.cat(parts.split(b, dim=0), dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor-parallel size {size}")
    stacked = torch.cat(x.chunk(size, dim=1), dim=0).contiguous()  # (TP*B, S/TP, ...)
    out = torch.empty((x.shape[0], x.shape[1] // size) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, stacked, group=group)
    return out


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


@eager_only
def gather_from_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S/TP, ...) shard -> full (B, S, ...); backward reduce-scatters."""
    return x if group is None else _GatherFromSP.apply(x, group)


@eager_only
def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums (B, S, ...) -> summed shard (B, S/TP, ...); backward all-gathers."""
    return x if group is None else _ReduceScatterToSP.apply(x, group)


@eager_only
def scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated (B, S, ...) -> this rank's shard (B, S/TP, ...); backward all-gathers."""
    return x if group is None else _ScatterToSP.apply(x, group)
