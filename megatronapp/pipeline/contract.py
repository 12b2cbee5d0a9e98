"""What the pipeline runtime asks of a model: the whole seam between schedules and networks.

The runtime and the schedules know nothing of GPT. A *pipeline model* is any object with

    chunks: list[nn.Module]                 # this rank's model chunks, indexed by local chunk id
    forward_step(chunk_id, stage_input, microbatch, ctx) -> (output, loss_fn | None)
    input_spec(chunk_id, microbatch) -> TensorSpec
    output_spec(chunk_id, microbatch) -> TensorSpec

as Megatron's `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`:

* `stage_input` is the activation received from the previous virtual stage, or None on the
  first virtual stage (which reads its input from `microbatch`, an opaque object the data
  iterator produced).
* On the last virtual stage `loss_fn(output)` returns the microbatch's scalar loss (a mean
  over its tokens or samples); the runtime scales it by 1/num_microbatches and runs
  backward from it. Elsewhere `loss_fn` is None and `output` is sent to the next stage.
* `input_spec` / `output_spec` give the shape and dtype of the activation a non-first chunk
  receives and of what a non-last chunk sends (the gradient coming back has the same spec).
  Receive buffers are allocated from them, so shapes come from the model (sequence
  parallelism, mixed precision, any network), never from trainer constants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

LossFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class MicrobatchContext:
    """Where a forward runs: the model uses it for anything keyed by position in training
    (e.g. layout-invariant dropout masks keyed by iteration and sample)."""

    iteration: int  # optimizer steps completed before this one
    microbatch: int  # index among this rank's microbatches of the step
    chunk: int  # local chunk id
    is_first_stage: bool  # first virtual stage: input comes from the microbatch
    is_last_stage: bool  # last virtual stage: produces the loss


class PipelineModel(Protocol):
    chunks: Sequence[nn.Module]

    def forward_step(
        self, chunk_id: int, stage_input: torch.Tensor | None, microbatch: Any, ctx: MicrobatchContext
    ) -> tuple[torch.Tensor, LossFn | None]: ...

    def input_spec(self, chunk_id: int, microbatch: Any) -> TensorSpec: ...

    def output_spec(self, chunk_id: int, microbatch: Any) -> TensorSpec: ...
