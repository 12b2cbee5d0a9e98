"""Training jobs shared by the engine tests: run in one process or inside cluster workers."""

from __future__ import annotations

import torch

from megatronapp.config import JobConfig, build_layout, model_preset
from megatronapp.data.dataset import compute_replica_sample_range
from megatronapp.engine.trainer import Trainer
from megatronapp.job import build_job, validate_job
from megatronapp.model.gpt import compile_counts
from megatronapp.parallel.groups import build_process_groups, single_process_groups


class RandomTokenBatches:
    """Deterministic random global batches, sliced per DP rank like the real iterator."""

    def __init__(self, job: JobConfig, dp_rank: int, vocab: int = 257):
        self.job, self.dp_rank, self.vocab, self.step = job, dp_rank, vocab, 0

    def next_microbatches(self, replica_microbatches: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        t, m = self.job.train, self.job.model
        gen = torch.Generator().manual_seed(1000 + self.step)
        self.step += 1
        batch = torch.randint(0, self.vocab, (t.global_batch_size, m.seq_length + 1), generator=gen)
        split = replica_microbatches or (self.job.num_microbatches,) * self.job.layout.dp_size
        positions = compute_replica_sample_range(split, self.dp_rank, t.micro_batch_size)
        return list(batch[positions.start : positions.stop].split(t.micro_batch_size))

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def make_job(
    world: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    schedule: str = "1f1b",
    global_batch: int = 8,
    micro_batch: int = 1,
    iters: int = 3,
    num_layers: int = 4,
    model_kw: dict | None = None,
    stage_layers: tuple[int, ...] = (),
    preset: str = "tiny",
    **train_kw,
) -> JobConfig:
    model = model_preset(preset, num_layers=num_layers, seq_length=16, **(model_kw or {}))
    train_kw = {"lr_warmup_iters": 0, "min_lr": 0.0, **train_kw}
    job = build_job(
        model,
        build_layout(world, tp, pp, vpp, stage_layers),
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        train_iters=iters,
        lr=3e-3,
        schedule=schedule,
        grad_bucket_mb=0.01,
        **train_kw,
    )
    validate_job(job)
    return job


def full_grads(trainer: Trainer) -> dict[str, tuple[torch.Tensor, int | None, int]]:
    """name -> (DP-reduced fp32 main grad, tp split dim, tp rank) for this rank's parameters.

    Collective over DP (the distributed optimizer's shards are gathered)."""
    grads = trainer.optimizer.main_grads_by_param()
    return {
        name: (grads[p].detach().clone(), p.tp_split_dim, trainer.groups.tp_rank)
        for c in trainer.chunks
        for name, p in c.named_parameters()
    }


def train_and_report(rank: int, world: int, job: JobConfig) -> dict:
    """Train job.train.train_iters steps; report losses, grad norms and first-step grads."""
    groups = build_process_groups(job.layout, rank)
    trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank))
    losses, norms, grads = [], [], None
    for step in range(job.train.train_iters):
        m = trainer.train_step()
        losses.append(m.loss)
        norms.append(m.grad_norm)
        if step == 0:
            grads = full_grads(trainer)
            grads = grads if groups.dp_rank == 0 else {}
    trainer.optimizer.finish_param_sync()  # no all-gather left in flight (--overlap-param-gather)
    return {"losses": losses, "norms": norms, "grads": grads}


def assemble_full_grads(reports: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate TP shards of every parameter's gradient into the full tensor."""
    shards: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    for rep in reports:
        for name, (g, dim, tp_rank) in rep["grads"].items():
            shards.setdefault(name, {})[tp_rank] = (g, dim)
    full = {}
    for name, by_rank in shards.items():
        dim = by_rank[0][1]
        full[name] = by_rank[0][0] if dim is None else torch.cat([by_rank[r][0] for r in sorted(by_rank)], dim=dim)
    return full


def compiled_frames(job: JobConfig, device: str, steps: int = 3) -> dict:
    """Train `job` (compile=True, one process) for `steps` from a fresh dynamo cache and return
    what it compiled (model.gpt.compile_counts)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    Trainer(job, single_process_groups(), torch.device(device), RandomTokenBatches(job, 0)).train(steps)
    return compile_counts()
