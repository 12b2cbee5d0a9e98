"""The training loop: one object that owns model chunks, optimizer, grads and the schedule.

One optimizer step = fetch this DP rank's microbatches, run the pipeline schedule
(forward/backward with DP reduction overlapped), reduce the gradients' global norm, clip,
AdamW step. Metrics are gathered with one scalar all-reduce per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp.config import JobConfig
from megatronapp.engine.grads import GradReducer, clip_grads, compute_grad_norm
from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.engine.optim import build_optimizer, compute_lr, set_lr
from megatronapp.model.gpt import ChunkOptions, TPContext, apply_compile, build_model_chunks
from megatronapp.model.gpt_step import GPTPipelineModel
from megatronapp.parallel.random import build_rng_tracker
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.pipeline.runtime import PipelineRuntime
from megatronapp.pipeline.schedules import build_schedule
from megatronapp.pipeline.validate import validate_schedule


@dataclass(frozen=True)
class StepMetrics:
    iteration: int  # 1-based count of completed optimizer steps
    loss: float  # mean over microbatches and DP ranks
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    # forward+backward compute seconds of every global rank (the previous step's on CUDA)
    rank_compute_s: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Trainer:
    def __init__(self, job: JobConfig, groups: ParallelGroups, device: torch.device, data, *,
                 tracer=NULL_TRACER, injector=None, schedule=None):
        self.job, self.groups, self.device, self.data = job, groups, device, data
        lay, t = job.layout, job.train
        tp = TPContext(groups.tp, lay.tp_size, groups.tp_rank, t.sequence_parallel)
        self.rng_tracker = build_rng_tracker(t.seed, groups.tp_rank, groups.pp_rank, device)
        options = ChunkOptions(recompute=t.recompute_config(), rng_tracker=self.rng_tracker)
        self.chunks = build_model_chunks(job.model, pp_rank=groups.pp_rank, pp_size=lay.pp_size,
                                         num_chunks=lay.virtual_pp_size, tp=tp, seed=t.seed, device=device,
                                         options=options)
        if job.train.compile:
            apply_compile(self.chunks)
        self.reducer = GradReducer(self.chunks, groups.dp, lay.dp_size, overlap=job.train.overlap_grad_reduce,
                                   bucket_mb=job.train.grad_bucket_mb)
        self.optimizer = build_optimizer(self.chunks, job.train)
        self.schedule = schedule or build_schedule(job.train.schedule, lay.pp_size, lay.virtual_pp_size,
                                                   job.num_microbatches)
        validate_schedule(self.schedule)
        self.model = GPTPipelineModel(self.chunks, job.model, seed=t.seed, dp_rank=groups.dp_rank,
                                      num_microbatches=job.num_microbatches, tp_size=lay.tp_size,
                                      tp_rank=groups.tp_rank, sequence_parallel=t.sequence_parallel,
                                      autocast_dtype=torch.bfloat16 if t.bf16 else None)
        self.runtime = PipelineRuntime(self.model, groups, self.schedule, device=device, tracer=tracer,
                                       reducer=self.reducer, injector=injector)
        self.iteration = 0  # optimizer steps completed
        self.set_tracer(tracer)

    def set_tracer(self, tracer) -> None:
        """Attach an observer (see engine.hooks) to the loop, the runtime and the model chunks."""
        self.tracer = self.runtime.tracer = tracer
        for c in self.chunks:
            c.tracer = None if tracer is NULL_TRACER else tracer

    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        it = self.iteration
        self.tracer.step_begin(it)
        lr = compute_lr(it, self.job.train)
        set_lr(self.optimizer, lr)
        self.reducer.zero_grad()
        microbatches = [mb.to(self.device, non_blocking=True) for mb in self.data.next_microbatches()]
        loss = self.runtime.run(microbatches, iteration=it)
        with self.tracer.span("grad_reduce", cat="comm"):
            self.reducer.finish()
        with self.tracer.span("optimizer"):
            grad_norm = compute_grad_norm(self.chunks, self.groups.tp_rank, self.groups.model_parallel)
            clip_grads(self.chunks, grad_norm, self.job.train.clip_grad)
            self.optimizer.step()
        loss_value, rank_compute = self._reduce_metrics(loss)
        self.tracer.step_end(it)
        self.iteration += 1
        dt = time.perf_counter() - t0
        tokens = self.job.train.global_batch_size * self.job.model.seq_length
        return StepMetrics(self.iteration, loss_value, lr, float(grad_norm), dt, tokens / dt, rank_compute)

    def _reduce_metrics(self, loss: torch.Tensor | None) -> tuple[float, tuple[float, ...]]:
        """Mean loss over DP ranks and every rank's compute seconds, known on every rank.

        One all-reduce of a (1 + world) vector: slot 0 sums the loss of the last stage's
        TP-rank-0 ranks, slot 1 + r carries rank r's compute time (zero elsewhere).
        """
        world = self.job.layout.world_size
        values = torch.zeros(1 + world, device=self.device)
        if loss is not None and self.groups.tp_rank == 0:
            values[0] = loss.detach().float()
        values[1 + self.groups.rank] = self.runtime.compute_timer.take()
        if world > 1:
            dist.all_reduce(values, group=self.groups.world)
        host = values.tolist()
        return host[0] / self.job.layout.dp_size, tuple(host[1:])

    def train(self, num_steps: int | None = None, on_step=None) -> list[StepMetrics]:
        """Run until train_iters (or num_steps more steps); on_step(metrics) after each."""
        end = self.job.train.train_iters if num_steps is None else self.iteration + num_steps
        history = []
        while self.iteration < end:
            m = self.train_step()
            history.append(m)
            if on_step is not None:
                on_step(m)
        return history
