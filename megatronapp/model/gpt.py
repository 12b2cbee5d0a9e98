"""GPT decoder with tensor parallelism, built as pipeline chunks.

Pre-LayerNorm blocks: x + Attn(LN(x)), then x + MLP(LN(x)). Causal attention through
torch's scaled_dot_product_attention, rotary positions, GeLU MLP, untied input embedding
and output head (Megatron's --untie-embeddings-and-output-weights).

A `GPTChunk` holds a contiguous range of layers; the chunk with layer 0 also holds the
embedding, the chunk with the last layer the final norm, output head and loss. Parameter
names use *global* layer indices ("layers.7.attn.qkv.weight"), so a checkpoint written under
one layout can be loaded under any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp import spans
from megatronapp.config import ModelConfig
from megatronapp.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronapp.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_split,
)


@dataclass(frozen=True)
class TPContext:
    group: object | None
    size: int
    rank: int


def rotary_tables(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, S, D); rotate the two halves of each head dim (GPT-NeoX layout)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _norm(hidden: int, eps: float, device) -> nn.LayerNorm:
    ln = nn.LayerNorm(hidden, eps=eps, device=device)
    mark_split(ln.weight, None)
    mark_split(ln.bias, None)
    return ln


class Attention(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        h = cfg.hidden_size
        self.local_heads = cfg.num_attention_heads // tp.size
        self.head_dim = cfg.head_dim
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = dict(tp_group=tp.group, tp_size=tp.size, tp_rank=tp.rank, seed=seed, device=device)
        # Output rows are ordered (head, [q|k|v], head_dim) so a row slice gives whole heads.
        self.qkv = ColumnParallelLinear(f"{name}.qkv", h, 3 * h, std=cfg.init_method_std, **kw)
        self.proj = RowParallelLinear(f"{name}.proj", h, h, std=out_std, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, nh, S, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = dict(tp_group=tp.group, tp_size=tp.size, tp_rank=tp.rank, seed=seed, device=device)
        self.fc1 = ColumnParallelLinear(f"{name}.fc1", cfg.hidden_size, cfg.ffn_size, std=cfg.init_method_std, **kw)
        self.fc2 = RowParallelLinear(f"{name}.fc2", cfg.ffn_size, cfg.hidden_size, std=out_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ResidualAttention(nn.Module):
    """x + Attn(LN(x)): the unit compiled as one region (norm and residual fused in)."""

    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        self.norm = _norm(cfg.hidden_size, cfg.layernorm_epsilon, device)
        self.attn = Attention(name, cfg, tp, seed, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x), cos, sin)


class ResidualMLP(nn.Module):
    """x + MLP(LN(x))."""

    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        self.norm = _norm(cfg.hidden_size, cfg.layernorm_epsilon, device)
        self.mlp = MLP(name, cfg, tp, seed, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Block(nn.Module):
    def __init__(self, layer: int, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        self.layer = layer
        self.attention = ResidualAttention(f"layers.{layer}.attn", cfg, tp, seed, device)
        self.mlp = ResidualMLP(f"layers.{layer}.mlp", cfg, tp, seed, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tracer=None) -> torch.Tensor:
        if tracer is None:
            return self.mlp(self.attention(x, cos, sin))
        with tracer.layer_span(spans.ATTENTION, self.layer):
            x = self.attention(x, cos, sin)
        with tracer.layer_span(spans.MLP, self.layer):
            return self.mlp(x)


class GPTChunk(nn.Module):
    """Layers [first_layer, last_layer) of the GPT, plus embedding / head when it owns them.

    forward(x, labels): x is token ids (B, S) on the chunk holding the embedding, else the
    hidden states (B, S, H) from the previous chunk. Returns hidden states (B, S, H), or on
    the chunk holding the head the mean token loss (a scalar) when labels are given.
    """

    def __init__(self, cfg: ModelConfig, first_layer: int, last_layer: int, tp: TPContext,
                 seed: int, device="cpu"):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.first_layer, self.last_layer = first_layer, last_layer
        self.has_embedding = first_layer == 0
        self.has_head = last_layer == cfg.num_layers
        kw = dict(tp_group=tp.group, tp_size=tp.size, tp_rank=tp.rank, seed=seed, device=device)
        if self.has_embedding:
            self.embedding = VocabParallelEmbedding("embedding", cfg.padded_vocab_size, cfg.hidden_size,
                                                    std=cfg.init_method_std, **kw)
        self.layers = nn.ModuleDict({str(i): Block(i, cfg, tp, seed, device) for i in range(first_layer, last_layer)})
        if self.has_head:
            self.final_norm = _norm(cfg.hidden_size, cfg.layernorm_epsilon, device)
            self.output = ColumnParallelLinear("output", cfg.hidden_size, cfg.padded_vocab_size,
                                               std=cfg.init_method_std, bias=False, **kw)
        cos, sin = rotary_tables(cfg.seq_length, cfg.head_dim, cfg.rotary_base, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tracer = None  # set by the engine when per-layer spans are wanted

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.has_embedding:
            x = self.embedding(x)  # (B, S) -> (B, S, H)
        s = x.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for block in self.layers.values():
            x = block(x, cos, sin, self.tracer)
        if not self.has_head or labels is None:
            return x
        if self.tracer is None:
            return self._loss(x, labels)
        with self.tracer.span(spans.LOSS):
            return self._loss(x, labels)

    def _loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.final_norm(x))  # (B, S, V/TP)
        vocab_start = self.tp.rank * logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp.group, vocab_start)
        return losses.mean()


def apply_compile(chunks: list[GPTChunk]) -> None:
    """torch.compile the local math of every block (attention, MLP) and the output head.

    Regional compilation: blocks of one class share one compiled graph, TP communication is
    excluded from the graphs (see parallel.mappings), and tracer spans stay in eager code
    around the compiled regions.
    """
    for chunk in chunks:
        for block in chunk.layers.values():
            block.attention.compile()
            block.mlp.compile()
        if chunk.has_head:
            chunk._loss = torch.compile(chunk._loss)


def chunk_layer_ranges(num_layers: int, pp_size: int, num_chunks: int) -> list[list[tuple[int, int]]]:
    """[pp_rank][chunk] -> (first, last) layer range, Megatron's interleaved assignment.

    Virtual stage v = chunk * pp_size + pp_rank holds layers [v * L/(P*V), (v+1) * L/(P*V)).
    """
    per = num_layers // (pp_size * num_chunks)
    return [[((c * pp_size + p) * per, (c * pp_size + p + 1) * per) for c in range(num_chunks)]
            for p in range(pp_size)]


def build_model_chunks(cfg: ModelConfig, *, pp_rank: int, pp_size: int, num_chunks: int, tp: TPContext,
                       seed: int, device="cpu") -> list[GPTChunk]:
    """The model chunks a pipeline rank holds, initialised from the layout-independent full weights."""
    ranges = chunk_layer_ranges(cfg.num_layers, pp_size, num_chunks)[pp_rank]
    return [GPTChunk(cfg, first, last, tp, seed, device) for first, last in ranges]
