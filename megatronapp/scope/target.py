"""What MegaScope attaches to: an InferenceModel (generation) or GPT chunks (e.g. a Trainer's).

Both expose the same few things here: the local blocks by global layer index, the local
parameters by layout-independent name, this rank's TP coordinates, the current step and
the rotary positions of the columns being processed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronapp.inference.model import InferenceModel
from megatronapp.model.gpt import GPTChunk


@dataclass
class ScopeTarget:
    cfg: object  # ModelConfig
    chunks: list
    tp_group: object | None
    tp_size: int
    tp_rank: int
    model: InferenceModel | None = None

    def blocks(self) -> dict[int, object]:
        return {int(i): b for c in self.chunks for i, b in c.layers.items()}

    def named_params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for c in self.chunks for n, p in c.named_parameters()}

    def local_full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Un-sharded shapes of the parameters this rank holds."""
        shapes = {}
        for name, p in self.named_params().items():
            shape = list(p.shape)
            if p.tp_split_dim is not None:
                shape[p.tp_split_dim] *= self.tp_size
            shapes[name] = tuple(shape)
        return shapes

    def full_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Un-sharded shapes of every parameter of the whole model (all pipeline stages), so a
        spec naming a parameter on another stage validates the same on every rank."""
        local = self.local_full_shapes()
        per_layer = {n.split(".", 2)[2]: s for n, s in local.items() if n.startswith("layers.")}
        shapes = {f"layers.{i}.{suffix}": s for i in range(self.cfg.num_layers) for suffix, s in per_layer.items()}
        v, h = self.cfg.padded_vocab_size, self.cfg.hidden_size
        shapes.update(
            {"embedding.weight": (v, h), "final_norm.weight": (h,), "final_norm.bias": (h,), "output.weight": (v, h)}
        )
        shapes.update(local)
        return shapes

    def step(self) -> int:
        return self.model.step if self.model is not None else 0

    def positions(self, batch: int, seq: int, device) -> torch.Tensor:
        """Rotary positions (B, S) of the columns in the current forward."""
        if self.model is not None and self.model.cache is not None:
            return self.model.cache.positions
        return torch.arange(seq, device=device).expand(batch, seq)


def resolve_target(obj) -> ScopeTarget:
    """A ScopeTarget for an InferenceModel, a GPTChunk or a list of GPTChunks (one rank's)."""
    if isinstance(obj, ScopeTarget):
        return obj
    if isinstance(obj, InferenceModel):
        c = obj.chunk
        return ScopeTarget(obj.cfg, [c], c.tp.group, c.tp.size, c.tp.rank, model=obj)
    chunks = [obj] if isinstance(obj, GPTChunk) else list(obj)
    if not chunks or not all(isinstance(c, GPTChunk) for c in chunks):
        raise TypeError("MegaScope attaches to an InferenceModel, a GPTChunk or a list of GPTChunks")
    tp = chunks[0].tp
    return ScopeTarget(chunks[0].cfg, chunks, tp.group, tp.size, tp.rank)


def stand_in_target(cfg) -> ScopeTarget:
    """One real-shaped layer (no embedding when the model has > 2 layers): enough to validate
    sites, layers and parameter names before any rank is launched."""
    from megatronapp.model.gpt import TPContext

    first = min(1, cfg.num_layers - 1)
    chunk = GPTChunk(cfg, first, first + 1, TPContext(None, 1, 0), seed=0)
    return ScopeTarget(cfg, [chunk], None, 1, 0)
