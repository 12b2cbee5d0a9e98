"""Evaluation jobs: train a few steps, evaluating at an interval; run in one process or in cluster workers."""

from __future__ import annotations

import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.dpp.config import DppConfig
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.engine.trainer import Trainer
from megatronapp.job import replace_fields
from megatronapp.parallel.groups import build_process_groups, single_process_groups


class HeldOutTokenBatches:
    """An evaluation stream of random global batches (seeds of their own), sliced per DP rank like
    the real iterator; every call starts again from its first batch."""

    def __init__(self, job, dp_rank: int, first_seed: int = 50_000, vocab: int = 257):
        self.job, self.dp_rank, self.first_seed, self.vocab = job, dp_rank, first_seed, vocab

    def __call__(self, num_batches: int):
        t, m = self.job.train, self.job.model
        per_rank = t.global_batch_size // self.job.layout.dp_size
        for i in range(num_batches):
            gen = torch.Generator().manual_seed(self.first_seed + i)
            batch = torch.randint(0, self.vocab, (t.global_batch_size, m.seq_length + 1), generator=gen)
            yield list(batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank].split(t.micro_batch_size))


def make_eval_job(world: int, tp: int = 1, pp: int = 1, vpp: int = 1, schedule: str = "1f1b", **kw):
    job = make_job(world, tp, pp, vpp, schedule, iters=kw.pop("iters", 2), **kw)
    return replace_fields(job, eval_interval=1, eval_iters=2)


def build_trainer(rank: int, world: int, job, dynamic: bool = False) -> Trainer:
    groups = build_process_groups(job.layout, rank) if world > 1 else single_process_groups(job.layout)
    # dynamic: as `train` runs it on CPU (payloads on the default group, beside the evaluation's)
    factory = build_dynamic_runtime_factory(DppConfig(), job) if dynamic else None
    return Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank), runtime_factory=factory)


def train_and_evaluate(rank: int, world: int, job, dynamic: bool = False, evaluate: bool = True) -> dict:
    """Train job.train.train_iters steps, validating every eval_interval steps (when `evaluate`),
    then the test loss; the training losses, the validation and test losses and the final weights."""
    trainer = build_trainer(rank, world, job, dynamic)
    stream = HeldOutTokenBatches(job, trainer.groups.dp_rank)
    valid = []
    on_eval = (lambda it: valid.append(trainer.evaluate("valid", stream).loss)) if evaluate else None
    history = trainer.train(on_eval=on_eval)
    test = trainer.evaluate("test", HeldOutTokenBatches(job, trainer.groups.dp_rank, 60_000)).loss if evaluate else None
    if hasattr(trainer.runtime, "close"):
        trainer.runtime.close()
    return {
        "losses": [m.loss for m in history],
        "valid": valid,
        "test": test,
        "training_mode": [c.training for c in trainer.chunks],
        "params": {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()},
    }


def train_with_and_without_eval(rank: int, world: int, job, dynamic: bool = False) -> dict:
    """train_and_evaluate twice on the same ranks: with evaluation and without."""
    return {
        "with": train_and_evaluate(rank, world, job, dynamic, evaluate=True),
        "without": train_and_evaluate(rank, world, job, dynamic, evaluate=False),
    }
