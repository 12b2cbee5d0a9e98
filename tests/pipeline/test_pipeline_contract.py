"""The pipeline runtime knows nothing of GPT: a stack of MLP blocks with its own
forward_step, microbatch type and loss pipelines with the gradients of one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.parallel.groups import build_process_groups
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.actions import virtual_stage
from megatronapp.pipeline.contract import MicrobatchContext, TensorSpec
from megatronapp.pipeline.runtime import PipelineRuntime
from megatronapp.pipeline.schedules import build_schedule

WIDTH, NUM_BLOCKS, MICROBATCHES = 12, 8, 4


def _block(i: int) -> nn.Module:
    torch.manual_seed(100 + i)  # block i has the same weights wherever it lives
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


class MLPStack:
    """Virtual stage v holds blocks [v*k, (v+1)*k); microbatches are (x, y) pairs, loss is MSE."""

    def __init__(self, pp_rank: int, pp_size: int, num_chunks: int):
        per = NUM_BLOCKS // (pp_size * num_chunks)
        self.chunks = [
            nn.Sequential(*[_block(virtual_stage(c, pp_rank, pp_size) * per + j) for j in range(per)])
            for c in range(num_chunks)
        ]

    def forward_step(self, chunk_id, stage_input, microbatch, ctx: MicrobatchContext):
        x, y = microbatch
        out = self.chunks[chunk_id](x if ctx.is_first_stage else stage_input)
        return out, ((lambda o: ((o - y) ** 2).mean()) if ctx.is_last_stage else None)

    def input_spec(self, chunk_id, microbatch) -> TensorSpec:
        return TensorSpec((microbatch[0].shape[0], WIDTH))

    output_spec = input_spec


def _microbatches():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(3, WIDTH, generator=gen), torch.randn(3, WIDTH, generator=gen)) for _ in range(MICROBATCHES)]


def pipeline_grads(rank: int, world: int, schedule: str, num_chunks: int) -> dict:
    layout = ParallelLayout(world, pp_size=world, virtual_pp_size=num_chunks)
    groups = build_process_groups(layout, rank)
    model = MLPStack(groups.pp_rank, world, num_chunks)
    sched = build_schedule(schedule, world, num_chunks, MICROBATCHES)
    loss = PipelineRuntime(model, groups, sched, device=torch.device("cpu"), tracer=NULL_TRACER).run(_microbatches())
    per = NUM_BLOCKS // (world * num_chunks)
    grads = {}
    for c, chunk in enumerate(model.chunks):
        first = virtual_stage(c, groups.pp_rank, world) * per
        for j, block in enumerate(chunk):
            grads[first + j] = block[0].weight.grad.clone()
    return {"grads": grads, "loss": None if loss is None else loss.item()}


@pytest.mark.parametrize("schedule,num_chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_mlp_stack_pipelines_like_one_process(cluster, schedule, num_chunks):
    torch.set_num_threads(1)
    ref = pipeline_grads(0, 1, "1f1b", 1)
    reports = cluster.run(pipeline_grads, 2, schedule, num_chunks)
    grads = {k: v for rep in reports for k, v in rep["grads"].items()}
    assert sorted(grads) == list(range(NUM_BLOCKS))
    for k, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][k], rtol=1e-5, atol=1e-7)
    assert reports[-1]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert ref["grads"][0].abs().sum() > 0
