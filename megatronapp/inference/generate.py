"""The generation loop: batched prompts, KV cache, greedy / temperature / top-k / top-p sampling.

Only the serving rank samples (from a generator seeded by `seed`), then broadcasts the new
tokens and the stop flag to every rank, so every layout draws the same tokens from the same
logits. A row stops at end-of-text; the loop stops when every row has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatronapp.config import ConfigError
from megatronapp.inference.model import InferenceModel


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. greedy=True ignores the other fields."""

    max_new_tokens: int = 32
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0
    stop_on_eod: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt, end-of-text excluded
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    finished: list[bool] = field(default_factory=list)  # row stopped at end-of-text

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second over the decode steps (prefill excluded), all rows counted."""
        rows = len(self.tokens)
        return rows * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def compute_next_tokens(
    logits: torch.Tensor, cfg: SamplingConfig, vocab_size: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token per row from logits (B, V_padded); ids >= vocab_size (padding) are never chosen."""
    logits = logits[:, :vocab_size].float()
    if cfg.greedy:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = logits.topk(min(cfg.top_k, vocab_size), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > cfg.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def check_prompts(prompts: list[list[int]], cfg: SamplingConfig, seq_length: int, vocab_size: int) -> None:
    """One-line ConfigError for empty prompts, ids outside the vocabulary or too long a request."""
    if not prompts:
        raise ConfigError("no prompt given")
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ConfigError(f"prompt {i} has token ids outside the vocabulary (0..{vocab_size - 1})")
    longest = max(len(p) for p in prompts)
    if longest + cfg.max_new_tokens > seq_length:
        raise ConfigError(
            f"prompt length {longest} + max new tokens {cfg.max_new_tokens} exceeds the model's "
            f"sequence length {seq_length}"
        )


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def generate(
    model: InferenceModel, prompts: list[list[int]], cfg: SamplingConfig, *, eod_id: int, vocab_size: int
) -> GenerationResult:
    """Generate for every prompt (token ids) on every rank of the model; same result everywhere."""
    check_prompts(prompts, cfg, model.cfg.seq_length, vocab_size)
    dev = model.device
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    pad_left = width - lengths
    tokens = torch.full((len(prompts), width), eod_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = torch.tensor(p)
    model.start(len(prompts), width + cfg.max_new_tokens, pad_left)
    generator = torch.Generator().manual_seed(cfg.seed) if model.is_serving_rank and not cfg.greedy else None
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    out: list[torch.Tensor] = []
    step_tokens, t0, t_prefill = tokens.to(dev), time.perf_counter(), None
    for step in range(cfg.max_new_tokens):
        logits = model.forward_step(step_tokens)
        nxt = torch.empty(len(prompts), dtype=torch.long, device=dev)
        if model.is_serving_rank:
            nxt = compute_next_tokens(logits, cfg, vocab_size, generator)
            nxt = torch.where(finished, torch.full_like(nxt, eod_id), nxt)
        nxt = _broadcast(nxt)
        out.append(nxt)
        if cfg.stop_on_eod:
            finished |= nxt == eod_id
        if t_prefill is None:
            t_prefill = time.perf_counter()
        if bool(finished.all()):
            break
        step_tokens = nxt[:, None]
    t_end = time.perf_counter()
    new = torch.stack(out, dim=1).cpu()  # (B, steps)
    rows = [_until_eod(row.tolist(), eod_id) if cfg.stop_on_eod else row.tolist() for row in new]
    return GenerationResult(
        tokens=rows,
        prefill_s=t_prefill - t0,
        decode_s=t_end - t_prefill,
        decode_steps=len(out) - 1,
        finished=finished.cpu().tolist(),
    )


def _until_eod(row: list[int], eod_id: int) -> list[int]:
    return row[: row.index(eod_id)] if eod_id in row else row
