"""dpp_bench's `torch-zb` cell: the same model chunks under PyTorch's own zero-bubble schedule.

Each rank builds exactly the chunks `megatronapp train` builds for the cell (same flags, so the
same model config, layout, seed and virtual stages), wraps each in a
torch.distributed.pipelining `PipelineStage` (stage index = chunk * P + pp rank, as ours) on
the pipeline group and runs `ScheduleInterleavedZeroBubble` over the same number of
microbatches of the same shape; the DP replicas all-reduce the gradients, then plain AdamW.
fp32, gloo, eager. Task times are not jittered: the scenarios' jitter and link delays are
injected by our runtimes' injector, which torch's schedule never calls, so this cell runs
`balanced` only (dpp_bench records the others as not measured, with the reason).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

UNSUPPORTED = "torch-zb runs only the balanced scenario (jitter/link delays live in our runtimes' injector)"


class _Stage(nn.Module):
    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):  # tokens or hidden (1, S, H) -> hidden, or logits on the last stage
        return self.chunk(x)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def run_torch_zb_cell(argv: list[str], warmup: int) -> list[float]:
    """Train the cell `argv` (`megatronapp train` flags) under torch's schedule; per-step seconds
    after `warmup` steps (each rank its own clock; a barrier ends every step)."""
    from megatronapp.cli.args import build_job_config
    from megatronapp.cli.main import build_parser
    from megatronapp.parallel.groups import build_process_groups, destroy_subgroups

    args = build_parser().parse_args(argv)
    world, rank = dist.get_world_size(), dist.get_rank()
    job = build_job_config(args, world, None)
    lay = job.layout
    groups = build_process_groups(lay, rank)
    try:
        return _train(job, groups, warmup)
    finally:
        destroy_subgroups(groups)


def _train(job, groups, warmup: int) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    from megatronapp.model.gpt import ChunkOptions, TPContext, build_model_chunks

    lay, device = job.layout, torch.device("cpu")
    chunks = build_model_chunks(
        job.model,
        pp_rank=groups.pp_rank,
        pp_size=lay.pp_size,
        num_chunks=lay.virtual_pp_size,
        tp=TPContext(None, 1, 0, False),
        seed=job.train.seed,
        device=device,
        options=ChunkOptions(),
    )
    stages = [
        PipelineStage(
            _Stage(c), i * lay.pp_size + groups.pp_rank, lay.pp_size * lay.virtual_pp_size, device, group=groups.pp
        )
        for i, c in enumerate(chunks)
    ]
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=job.num_microbatches, loss_fn=_loss)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=job.optimizer.lr)
    gen = torch.Generator().manual_seed(1000 + groups.dp_rank)
    steps = []
    for _ in range(job.train.train_iters):
        tokens = torch.randint(
            0, job.model.padded_vocab_size, (job.num_microbatches, job.model.seq_length + 1), generator=gen
        )
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        if groups.pp_rank == 0:
            schedule.step(tokens[:, :-1])
        elif groups.pp_rank == lay.pp_size - 1:
            schedule.step(target=tokens[:, 1:])
        else:
            schedule.step()
        if groups.dp is not None:
            for p in params:
                dist.all_reduce(p.grad, group=groups.dp)
        optimizer.step()
        dist.barrier()
        steps.append(time.perf_counter() - t0)
    return steps[warmup:]


if __name__ == "__main__":  # under torchrun: one cell, for trying the peer alone
    import sys

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = run_torch_zb_cell(sys.argv[1:], warmup=1)
    if dist.get_rank() == 0:
        print(f"torch-zb: {[round(s * 1e3, 1) for s in out]} ms/step", flush=True)
    dist.destroy_process_group()
    os._exit(0)
