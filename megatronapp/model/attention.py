"""Causal self-attention with rotary positions and grouped-query attention, tensor-parallel.

Query heads come in `query_groups` groups; each group shares one key and one value head
(multi-head attention: one query head per group). The QKV projection's output rows are
ordered (group, [q_1 .. q_{heads/groups}, k, v], head_dim), Megatron's layout, so slicing
its rows over TP gives each rank whole groups: a rank holds groups/TP key/value heads and
heads/TP query heads. With one query head per group this is the (head, [q, k, v], head_dim)
layout of multi-head attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.model.attention_kernels import specialise_on_preference
from megatronapp.model.layer_parts import ChunkOptions, TPContext, tp_linear_kwargs
from megatronapp.model.recompute import recompute
from megatronapp.parallel.layers import ColumnParallelLinear, RowParallelLinear


def rotary_tables(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, S, D); rotate the two halves of each head dim (GPT-NeoX and Hugging Face Llama layout)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_qkv(qkv: torch.Tensor, heads_per_group: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """(B, S, groups * (heads_per_group + 2) * D) -> q (B, heads, S, D), k and v (B, groups, S, D).

    Query heads are group-major: head i uses key/value head i // heads_per_group."""
    b, s, _ = qkv.shape
    qkv = qkv.view(b, s, -1, heads_per_group + 2, head_dim)
    q = qkv[:, :, :, :heads_per_group].reshape(b, s, -1, head_dim)
    k, v = qkv[:, :, :, heads_per_group], qkv[:, :, :, heads_per_group + 1]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def expand_kv(x: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """(B, groups, T, D) -> (B, heads, T, D): each key/value head repeated for its query heads."""
    return x if heads_per_group == 1 else x.repeat_interleave(heads_per_group, dim=1)


class Attention(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device, options: ChunkOptions):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.local_heads = cfg.num_attention_heads // tp.size
        self.local_groups = cfg.query_groups // tp.size
        self.heads_per_group = cfg.num_attention_heads // cfg.query_groups
        self.head_dim = d
        self.dropout_p = cfg.attention_dropout
        self.options = options
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = tp_linear_kwargs(tp, seed, device)
        qkv_out = cfg.query_groups * (self.heads_per_group + 2) * d
        self.qkv = ColumnParallelLinear(f"{name}.qkv", h, qkv_out, std=cfg.init_method_std, bias=cfg.qkv_bias, **kw)
        self.proj = RowParallelLinear(f"{name}.proj", h, h, std=out_std, bias=cfg.add_bias_linear, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, S, (heads + 2 groups) D / TP): sequence shards are gathered by the linear
        b, s, _ = qkv.shape
        q, k, v = split_qkv(qkv, self.heads_per_group, self.head_dim)  # (B, nh, S, D), (B, ng, S, D) x 2
        if cache is None:  # with a cache, cos/sin are already per row and column (B, 1, S, D/2)
            cos, sin = cos[:s], sin[:s]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        specialise_on_preference()  # compiled graphs keep the kernel they were traced with
        if cache is not None:  # inference: earlier steps' keys/values and the mask (inference/kv_cache.py)
            k, v = cache.update(k, v)  # the cache holds the groups' heads, not the expanded ones
            k, v = expand_kv(k, self.heads_per_group), expand_kv(v, self.heads_per_group)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask)
        elif self.options.recompute.granularity == "selective" and self.training:
            y = recompute(self._core, q, k, v, rng_tracker=self.options.rng_tracker if self.dropout_p else None)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(D)) V with causal mask; attention dropout on the TP-rank stream."""
        k, v = expand_kv(k, self.heads_per_group), expand_kv(v, self.heads_per_group)
        p = self.dropout_p if self.training else 0.0
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with self.options.rng_tracker.fork():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
