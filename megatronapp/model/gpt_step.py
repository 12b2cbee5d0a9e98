"""The GPT as a pipeline model: its forward_step and tensor specs (contract: pipeline/contract.py).

A microbatch is a LongTensor (B, S + 1) of token ids: inputs are tokens[:, :-1], labels
tokens[:, 1:]. The loss function averages the per-token losses of the last chunk.

Hidden-dropout masks are keyed by the global index of each sample in the step's global
batch: DP rank d holds samples [d * M * B, (d + 1) * M * B) of it (data/dataset.py), and
microbatch m of those starts at d * M * B + m * B (under an uneven split, at the replica's first
global microbatch, so every sample keeps its masks). With sequence parallelism a rank's first
position is tp_rank * S / TP.
"""

from __future__ import annotations

import contextlib

import torch

from megatronapp.config import ModelConfig
from megatronapp.model.attention_kernels import attention_backend_context
from megatronapp.model.gpt import GPTChunk
from megatronapp.parallel.random import DropoutKey
from megatronapp.pipeline.contract import MicrobatchContext, TensorSpec


def _mean_loss(per_token: torch.Tensor) -> torch.Tensor:
    return per_token.float().mean()


class GPTPipelineModel:
    def __init__(
        self,
        chunks: list[GPTChunk],
        cfg: ModelConfig,
        *,
        seed: int,
        dp_rank: int,
        num_microbatches: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        sequence_parallel: bool = False,
        autocast_dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
    ):
        self.chunks, self.cfg, self.seed = chunks, cfg, seed
        self.dp_rank, self.num_microbatches = dp_rank, num_microbatches
        # index in the global batch of this replica's first microbatch (another under an uneven
        # data-parallel split: engine/replica_split.py)
        self.first_microbatch = dp_rank * num_microbatches
        self.seq_shards = tp_size if sequence_parallel else 1
        self.position_offset = tp_rank * (cfg.seq_length // self.seq_shards) if sequence_parallel else 0
        self.autocast_dtype = autocast_dtype
        self.attention_backend = attention_backend
        params = [p for c in chunks for p in c.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        # What flows between stages: the residual stream, in the parameters' dtype.
        self.activation_dtype = params[0].dtype if params else torch.float32

    def dropout_key(self, tokens: torch.Tensor, ctx: MicrobatchContext) -> DropoutKey:
        b = tokens.shape[0]
        first = (self.first_microbatch + ctx.microbatch) * b
        return DropoutKey(self.seed, ctx.iteration, first, self.position_offset)

    def forward_step(
        self, chunk_id: int, stage_input: torch.Tensor | None, tokens: torch.Tensor, ctx: MicrobatchContext
    ):
        chunk = self.chunks[chunk_id]
        x = tokens[:, :-1] if ctx.is_first_stage else stage_input
        labels = tokens[:, 1:] if ctx.is_last_stage else None
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        key = self.dropout_key(tokens, ctx) if chunk.training else None  # eval mode: no hidden dropout
        with autocast, attention_backend_context(self.attention_backend):
            out = chunk(x, labels, key)
        return out, (_mean_loss if ctx.is_last_stage else None)

    def input_spec(self, chunk_id: int, tokens: torch.Tensor) -> TensorSpec:
        b, s = tokens.shape[0], tokens.shape[1] - 1
        return TensorSpec((b, s // self.seq_shards, self.cfg.hidden_size), self.activation_dtype)

    output_spec = input_spec  # every chunk maps the residual stream to itself
