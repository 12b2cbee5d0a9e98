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
@torch.compiler.disable
def _copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


@torch.compiler.disable
def _reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _copy_to_tp(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _reduce_from_tp(x, group)
