"""Cross-entropy over logits sharded along the vocabulary (Megatron's algorithm).

Each TP rank holds logits for vocab ids [start, start + V/TP). Three all-reduces over TP
(max, target logit, sum of exponentials) give the exact loss without gathering the full
logits; the backward is local: softmax - one_hot on each shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronapp.parallel.eager_only import eager_only


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()  # (N, V/TP)
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_vocab = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


@eager_only
def _vocab_parallel_ce(logits, target, group, vocab_start):
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token loss (N,) for logits (N, V/TP) sharded over `group`; plain CE when group is None."""
    if group is None:
        return F.cross_entropy(logits.float(), target, reduction="none")
    return _vocab_parallel_ce(logits, target, group, vocab_start)
