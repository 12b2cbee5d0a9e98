"""A plain single-file PyTorch GPT with the engine's exact shapes: the baseline for MFU.

Same architecture as megatronapp.model.gpt (pre-LN, rotary, SDPA causal attention, GeLU
MLP, untied head) but with no parallel layers, no schedule runtime and no grad buffers:
what a user would write by hand. Used only by benchmarks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.model.gpt import apply_rotary, rotary_tables


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.hd = heads, h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, self.hd)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        self.emb = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(
            PlainBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_size) for _ in range(cfg.num_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
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
