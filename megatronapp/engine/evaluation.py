"""Validation and test loss: forward-only passes of a trainer's model over held-out batches.

What an evaluation is (Megatron's `evaluate`): `eval_iters` global batches of a stream, each
through the pipeline forward only (pipeline/forward_only.py) with the model in eval mode
(dropout off), the loss averaged over microbatches, batches and DP ranks exactly as training
averages a step's loss, and perplexity exp(min(loss, 20)).

A stream is any `EvalBatches`: called with a number of batches, it yields this DP rank's
microbatches of that many global batches *from the start of the stream*. So every evaluation
sees the same samples (its curve moves only with the model), nothing about it needs to be
checkpointed, and a resumed run computes the same validation numbers, bit for bit.

Nothing the training step reads is touched: no grads, no timers or tracer spans of the step,
no random numbers (dropout is off, hidden-dropout keys are not drawn); in-flight parameter
updates are completed first, and delayed-FP8 amaxes recorded by the evaluation's forwards are
put back, so the next step casts with the scales it would have used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp.pipeline.forward_only import ForwardOnlyRuntime

# called with a number of global batches: this DP rank's microbatches of each, from the stream's start
EvalBatches = Callable[[int], Iterator[list[torch.Tensor]]]

PPL_LOSS_CAP = 20.0  # Megatron's: perplexity of min(loss, 20), so a diverged run still prints a number


@dataclass(frozen=True)
class EvalResult:
    name: str  # "valid" | "test"
    iteration: int  # optimizer steps completed when it ran
    loss: float  # mean over microbatches, batches and DP ranks
    ppl: float
    num_batches: int

    def as_row(self) -> dict:
        """The metrics file's row: {"iteration", "<name>_loss", "<name>_ppl"}."""
        return {"iteration": self.iteration, f"{self.name}_loss": self.loss, f"{self.name}_ppl": self.ppl}


def compute_ppl(loss: float) -> float:
    return math.exp(min(loss, PPL_LOSS_CAP))


class Evaluator:
    """Evaluates a Trainer's model; collective over the trainer's whole job (every rank calls it)."""

    def __init__(self, trainer, eval_iters: int):
        self.trainer, self.eval_iters = trainer, eval_iters
        lay = trainer.job.layout
        self.runtime = ForwardOnlyRuntime(
            trainer.model, trainer.groups, lay.virtual_pp_size, trainer.job.num_microbatches, device=trainer.device
        )

    def evaluate(self, name: str, batches: EvalBatches) -> EvalResult:
        """The loss of `eval_iters` global batches of `batches` for the model as it is now."""
        t = self.trainer
        t.optimizer.finish_param_sync()  # the forwards must read the updated parameters
        amaxes = [s.amax_step.clone() for s in t.fp8_states.values()]
        modes = [c.training for c in t.chunks]
        for c in t.chunks:
            c.eval()
        try:
            share = self._loss_share(batches)
        finally:
            for c, mode in zip(t.chunks, modes):
                c.train(mode)
            for s, saved in zip(t.fp8_states.values(), amaxes):
                s.amax_step.copy_(saved)
        loss = self._reduce(share) / (t.job.layout.dp_size * self.eval_iters)
        return EvalResult(name, t.iteration, loss, compute_ppl(loss), self.eval_iters)

    def _loss_share(self, batches: EvalBatches) -> torch.Tensor:
        """This rank's sum over batches of each batch's mean microbatch loss (zero off the last
        stage and off TP rank 0, as in training's metrics)."""
        t = self.trainer
        total = torch.zeros((), dtype=torch.float32, device=t.device)
        count = 0
        for microbatches in batches(self.eval_iters):
            loss = self.runtime.run([mb.to(t.device, non_blocking=True) for mb in microbatches], t.iteration)
            if loss is not None and t.groups.tp_rank == 0:
                total += loss.float()
            count += 1
        if count != self.eval_iters:
            raise ValueError(f"evaluation stream gave {count} global batches, expected {self.eval_iters}")
        return total

    def _reduce(self, share: torch.Tensor) -> float:
        if self.trainer.job.layout.world_size > 1:
            dist.all_reduce(share, group=self.trainer.groups.world)
        return share.item()
