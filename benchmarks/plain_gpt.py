"""A plain single-file PyTorch GPT with the engine's exact shapes: the baseline for MFU.

Same architecture as megatronapp.model.gpt for either family the config names (GPT-NeoX:
pre-LayerNorm, GeLU MLP, biases, untied head; Llama: RMSNorm, SwiGLU, grouped-query
attention, no biases, tied head), rotary positions and SDPA causal attention, but with no
parallel layers, no schedule runtime and no grad buffers: what a user would write by hand.
Used only by benchmarks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.model.gpt import apply_rotary, rotary_tables


def _norm(cfg) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class PlainBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.ffn_size, cfg.add_bias_linear
        self.heads, self.groups, self.hd = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        self.ln1, self.ln2 = _norm(cfg), _norm(cfg)
        self.q = nn.Linear(h, h, bias=cfg.qkv_bias)
        self.kv = nn.Linear(h, 2 * self.groups * self.hd, bias=cfg.qkv_bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.gate = nn.Linear(h, f, bias=bias) if cfg.swiglu else None
        self.fc1, self.fc2 = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.groups, self.hd).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        # each key/value head repeated for its query heads (Hugging Face's repeat_kv), as the engine does
        k, v = k.repeat_interleave(self.heads // self.groups, 1), v.repeat_interleave(self.heads // self.groups, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        y = self.ln2(x)
        act = F.silu(self.gate(y)) * self.fc1(y) if self.gate is not None else F.gelu(self.fc1(y), approximate="tanh")
        return x + self.fc2(act)


class PlainGPT(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        self.emb = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = _norm(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        if not cfg.untie_embeddings_and_output_weights:
            self.head.weight = self.emb.weight
        cos, sin = rotary_tables(cfg.seq_length, cfg.head_dim, cfg.rotary_base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(device)

    def forward(self, idx, labels):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plain_train_step(model, opt, microbatches, clip: float = 1.0, autocast: bool = True) -> float:
    """Gradient accumulation over microbatches, clip, AdamW step (bf16 autocast, or a pure-bf16
    model with autocast=False)."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for mb in microbatches:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(mb[:, :-1], mb[:, 1:]) / len(microbatches)
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    opt.step()
    return float(total)
