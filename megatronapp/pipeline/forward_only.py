"""Forward-only execution of a pipeline: the loss of a global batch without backward (evaluation).

The forward-only schedule is the breadth-first order of forwards (every microbatch through local
chunk 0, then chunk 1, ...), with its communication placed by the same rules as every training
schedule (comm_placement.py), so it runs on any TP x PP x VPP layout whatever schedule trains
(static, zero-bubble or MegaDPP's run-time decisions: with no backward there are no waits to
fill). It is executed by PipelineRuntime's communication path; only the compute differs:
under no_grad, nothing is kept for a backward, and no timer, tracer or fault injector of the
training step sees it.
"""

from __future__ import annotations

import contextlib

import torch

from megatronapp.parallel.groups import ParallelGroups
from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule
from megatronapp.pipeline.contract import MicrobatchContext, PipelineModel
from megatronapp.pipeline.runtime import PipelineRuntime, _StepState
from megatronapp.pipeline.schedules import build_schedule_from_compute_order


class _NoTrace:
    """Evaluation is not a training step: its forwards stay out of the step's spans."""

    enabled = False

    def context(self, **attrs):
        return contextlib.nullcontext()

    def span(self, name: str, cat: str = "compute", **attrs):
        return contextlib.nullcontext()


def build_forward_only_schedule(pp_size: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Every rank runs F(c, m) for c in its chunks, m in microbatches (chunk-major: the looped
    breadth-first order), sends and receives placed as for training schedules."""
    order = [Action(ActionKind.FORWARD, c, m) for c in range(num_chunks) for m in range(num_microbatches)]
    return build_schedule_from_compute_order(pp_size, num_chunks, num_microbatches, [order] * pp_size, "forward-only")


class ForwardOnlyRuntime(PipelineRuntime):
    """`run(microbatches)`: the global batch's loss share of this rank, as PipelineRuntime.run
    returns it (the sum of the microbatches' 1/M-scaled losses on the last virtual stage, None
    elsewhere), computed under no_grad. The caller puts the chunks in eval mode."""

    def __init__(self, model: PipelineModel, groups: ParallelGroups, num_chunks: int, num_microbatches: int, *, device):
        schedule = build_forward_only_schedule(groups.layout.pp_size, num_chunks, num_microbatches)
        super().__init__(model, groups, schedule, device=device, tracer=_NoTrace())

    def run(self, microbatches: list, iteration: int = 0) -> torch.Tensor | None:
        with torch.no_grad():
            return super().run(microbatches, iteration)

    def _forward(self, a: Action, st: _StepState) -> None:
        vs = self._vstage(a.chunk)
        is_first, is_last = vs == 0, vs == self.num_vstages - 1
        x = None if is_first else self._wait_recv((ActionKind.RECV_FORWARD, a.chunk, a.microbatch), st)
        ctx = MicrobatchContext(st.iteration, a.microbatch, a.chunk, is_first, is_last)
        out, loss_fn = self.model.forward_step(a.chunk, x, st.microbatches[a.microbatch], ctx)
        if is_last:
            st.losses.append(loss_fn(out) / self.schedule.num_microbatches)
        else:
            st.to_send[(ActionKind.SEND_FORWARD, a.chunk, a.microbatch)] = out
