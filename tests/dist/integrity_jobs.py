"""Training jobs for the integrity tests (checks, reruns): one process or cluster workers."""

from __future__ import annotations

from dataclasses import replace

import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.config import IntegrityConfig
from megatronapp.engine.hooks import NullTracer
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups, single_process_groups


class Corruption:
    """A step hook: at `iteration`, on `ranks`, on the first execution only (transient) or on
    every one (reproducible), add `loss_add` to the loss, multiply the grads by `grad_scale`,
    or put a NaN in the first grad."""

    def __init__(
        self,
        iteration: int,
        ranks,
        every_attempt: bool = False,
        loss_add: float = 0.0,
        grad_scale: float = 1.0,
        nan: bool = False,
    ):
        self.iteration, self.ranks, self.every_attempt = iteration, set(ranks), every_attempt
        self.loss_add, self.grad_scale, self.nan, self.rank = loss_add, grad_scale, nan, 0
        self.only_params: set[int] | None = None  # ids of the model params whose grads are hit; None: all

    def __call__(self, iteration, attempt, loss, optimizer):
        if iteration != self.iteration or self.rank not in self.ranks or (attempt and not self.every_attempt):
            return loss
        grads = [
            m.main_param.grad
            for m in optimizer.mains
            if self.only_params is None or id(m.model_param) in self.only_params
        ]
        if self.grad_scale != 1.0:
            torch._foreach_mul_(grads, self.grad_scale)
        if self.nan:
            grads[0].view(-1)[0] = float("nan")
        return loss if loss is None or not self.loss_add else loss + self.loss_add


class MarkRecorder(NullTracer):
    def __init__(self):
        self.marks = []

    def mark_iteration(self, iteration, label, **attrs):
        self.marks.append((iteration, label, attrs))


def integrity_job(world: int = 1, tp: int = 1, pp: int = 1, iters: int = 10, **integrity_kw):
    job = make_job(world, tp, pp, iters=iters, num_layers=2, log_interval=iters)
    return replace(job, integrity=IntegrityConfig(**integrity_kw))


def train_with_hook(rank: int, world: int, job, hook: Corruption | None) -> dict:
    """Train job.train.train_iters steps; the metrics rows, the marks, and each step's params
    before and after (to see a skipped update)."""
    torch.set_num_threads(1)
    groups = build_process_groups(job.layout, rank) if world > 1 else single_process_groups()
    if hook is not None:
        hook.rank = rank
    tracer = MarkRecorder()
    trainer = Trainer(
        job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank), tracer=tracer, step_hook=hook
    )
    params = [[p.detach().clone() for c in trainer.chunks for p in c.parameters()]]
    rows = []
    for _ in range(job.train.train_iters):
        rows.extend(m.as_dict() for m in trainer.train(num_steps=1))
        params.append([p.detach().clone() for c in trainer.chunks for p in c.parameters()])
    return {"rows": rows, "marks": tracer.marks, "params": params}


def train_deterministic(rank: int, world: int, job) -> dict:
    """train_and_report under --deterministic, the process's switches restored afterwards
    (pool workers run other jobs next)."""
    import os

    from engine_jobs import train_and_report

    from megatronapp.engine.determinism import enable_deterministic_mode

    saved_env, saved_cudnn = dict(os.environ), torch.backends.cudnn.deterministic
    try:
        enable_deterministic_mode(os.environ)
        return train_and_report(rank, world, job)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = saved_cudnn
        os.environ.clear()
        os.environ.update(saved_env)
