"""Gradient buffers, data-parallel reduction overlapped with backward, and global-norm clipping.

Each model chunk's gradients live in one flat fp32 buffer; `param.grad` is a view into it,
so autograd accumulates microbatches in place. The buffer is cut into buckets of about
`bucket_mb` MiB in reverse parameter order (roughly the order backward produces them).
During the *last* microbatch's backward of a chunk, a post-accumulate hook counts each
bucket's parameters; a full bucket is all-reduced asynchronously over the DP group while
backward continues (Megatron's DDP overlap). `finish()` waits for every bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, flat: torch.Tensor, params: list[nn.Parameter]):
        self.flat, self.params = flat, params
        self.ready = 0
        self.work = None


class ChunkGradBuffer:
    """Flat gradient storage of one model chunk, split into DP-reduction buckets."""

    def __init__(self, params: list[nn.Parameter], bucket_mb: float):
        total = sum(p.numel() for p in params)
        device = params[0].device if params else "cpu"
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        limit = max(1, int(bucket_mb * 2**20 / 4))
        offset, pending, start = total, [], total
        for p in reversed(params):  # backward produces the last layers' grads first
            offset -= p.numel()
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            pending.append(p)
            if start - offset >= limit:
                self._close_bucket(offset, start, pending)
                pending, start = [], offset
        if pending:
            self._close_bucket(offset, start, pending)

    def _close_bucket(self, lo: int, hi: int, params: list[nn.Parameter]) -> None:
        bucket = _Bucket(self.flat[lo:hi], list(params))
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket


class GradReducer:
    """Owns the grad buffers of all chunks and their DP all-reduce."""

    def __init__(self, chunks: list[nn.Module], dp_group, dp_size: int, *, overlap: bool, bucket_mb: float):
        self.dp_group, self.dp_size, self.overlap = dp_group, dp_size, overlap and dp_group is not None
        self.buffers = [ChunkGradBuffer([p for p in c.parameters() if p.requires_grad], bucket_mb) for c in chunks]
        self.final_microbatch = [False] * len(chunks)
        if self.overlap:
            for i, buf in enumerate(self.buffers):
                for p, bucket in buf.bucket_of.items():
                    p.register_post_accumulate_grad_hook(self._make_hook(i, bucket))

    def _make_hook(self, chunk: int, bucket: _Bucket):
        def hook(_param):
            if self.final_microbatch[chunk]:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._launch(bucket)
        return hook

    def _launch(self, bucket: _Bucket) -> None:
        bucket.flat.div_(self.dp_size)
        bucket.work = dist.all_reduce(bucket.flat, group=self.dp_group, async_op=True)

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.flat.zero_()
            for b in buf.buckets:
                b.ready, b.work = 0, None
        self.final_microbatch = [False] * len(self.buffers)

    def mark_final_microbatch(self, chunk: int) -> None:
        """Called before the last microbatch's backward of `chunk`: its buckets may now be reduced."""
        self.final_microbatch[chunk] = True

    def finish(self) -> None:
        """Complete the DP reduction of every bucket (launching any not yet launched)."""
        if self.dp_group is None:
            return
        for buf in self.buffers:
            for b in buf.buckets:
                if b.work is None:
                    self._launch(b)
        for buf in self.buffers:
            for b in buf.buckets:
                b.work.wait()


def compute_grad_norm(chunks: list[nn.Module], tp_rank: int, model_parallel_group) -> torch.Tensor:
    """Global L2 norm of all gradients of one model replica.

    Parameters replicated across TP (`tp_split_dim is None`) are counted on TP rank 0 only;
    the squared sums are then added over the model-parallel (TP x PP) group. DP replicas hold
    identical reduced gradients, so no DP reduction is needed.
    """
    grads = [p.grad for c in chunks for p in c.parameters()
             if p.grad is not None and (getattr(p, "tp_split_dim", None) is not None or tp_rank == 0)]
    device = next(p for c in chunks for p in c.parameters()).device
    if grads:
        norms = torch._foreach_norm(grads)
        sq = torch.stack([n.float() for n in norms]).square().sum()
    else:
        sq = torch.zeros((), device=device)
    if model_parallel_group is not None:
        dist.all_reduce(sq, group=model_parallel_group)
    return sq.sqrt()


def clip_grads(chunks: list[nn.Module], grad_norm: torch.Tensor, max_norm: float) -> None:
    """Scale all gradients by min(1, max_norm / norm); no host sync."""
    if max_norm <= 0:
        return
    coef = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, coef)
