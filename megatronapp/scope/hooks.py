"""Forward hooks that stash capture sites on this rank (on device, no host sync).

Installed only while a capture is active; `remove()` leaves the modules with no hooks. The
stash maps (layer, site) to this rank's local tensor: heads / ffn columns of its TP shard.
The hooks only do tensor work, so in a decode step recorded into a CUDA graph (see
capture.py) their kernels are replayed while their Python is not; `full_keys` makes the
attention probabilities span the whole static cache then (fixed shape, unwritten columns 0).
"""

from __future__ import annotations

import math

import torch

from megatronapp.model.attention import apply_rotary, expand_kv, split_qkv
from megatronapp.scope.sites import layer_modules

LENS = "_lens"  # internal: residual of the newest column, for the logit lens


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) in fp32: q (B, h, S, D), k (B, h, T, D), bool mask (B, 1, S, T)
    or None for causal attention over the same columns (S == T); `hidden` = ~mask when the
    caller has it already (one per step, shared by the layers)."""
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is None:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    return scores.masked_fill(~mask if hidden is None else hidden, float("-inf")).softmax(dim=-1)


class CaptureHooks:
    def __init__(self, target, layers, sites, want_lens: bool):
        self.target, self.sites = target, set(sites)
        self.stash: dict[tuple[int, str], torch.Tensor] = {}
        self.handles = []
        self.full_keys = False
        self._attn_args: dict[int, tuple] = {}
        # Per forward, shared by every layer (each layer gets the same rotary tables and mask):
        # the tables cast to the activations' dtype and the inverted mask, made once, not per layer.
        self._tables, self._hidden = None, None
        need_qkv = self.sites & {"q", "k", "v", "attn_probs"}
        for layer, block in target.blocks().items():
            m = layer_modules(block)
            if layer not in layers:  # the logit lens reads every layer's residual all the same
                if want_lens:
                    self.handles.append(m["block"].register_forward_hook(self._residual(layer, True, False)))
                continue
            if need_qkv:
                self.handles.append(m["attn"].register_forward_pre_hook(self._remember_attn_args(layer)))
                self.handles.append(m["qkv"].register_forward_hook(self._qkv(layer)))
            if "attn_probs" in self.sites or "attn_out" in self.sites:
                self.handles.append(m["attn"].register_forward_hook(self._attn(layer)))
            if "fc1" in self.sites:
                self.handles.append(m["fc2"].register_forward_pre_hook(self._fc1(layer)))
            if "mlp_out" in self.sites:
                self.handles.append(m["mlp"].register_forward_hook(self._store(layer, "mlp_out")))
            if "residual" in self.sites or want_lens:
                self.handles.append(
                    m["block"].register_forward_hook(self._residual(layer, want_lens, "residual" in self.sites))
                )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.stash, self._attn_args = [], {}, {}
        self._tables, self._hidden = None, None

    def _remember_attn_args(self, layer: int):
        def hook(module, args):
            self._attn_args[layer] = args[1:]  # (cos, sin[, cache])

        return hook

    def _qkv(self, layer: int):
        def hook(module, args, output):
            b, s, _ = output.shape
            cos, sin, *cache = self._attn_args[layer]
            cos, sin = self._rotary_tables(cos, sin, s, output.dtype)
            cfg = self.target.cfg
            per_group = cfg.num_attention_heads // cfg.query_groups
            q, k, v = split_qkv(output.detach(), per_group, cfg.head_dim)  # (B, h, S, D), (B, groups, S, D) x 2
            # keys and values per query head (a group's head repeated), so head indices mean one thing
            k, v = expand_kv(k, per_group), expand_kv(v, per_group)
            wanted = self.sites & {"q", "k", "v"}
            if "attn_probs" in self.sites:  # with a cache, the keys come from it (this step's included)
                wanted |= {"q"} if cache and cache[0] is not None else {"q", "k"}
            for site, t in (("q", q), ("k", k), ("v", v)):
                if site in wanted:
                    self.stash[(layer, site)] = t if site == "v" else apply_rotary(t, cos, sin)

        return hook

    def _rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor, s: int, dtype) -> tuple:
        """The rotary tables as the model applies them: sliced to S columns without a cache,
        in the activations' dtype (apply_rotary's own cast is then a no-op): once per forward."""
        t = self._tables
        if t is None or t[0] is not cos or t[1] is not sin or (t[2], t[3]) != (s, dtype):
            if cos.dim() == 2:  # no cache: the full tables, sliced as the model does
                cos_s, sin_s = cos[:s], sin[:s]
            else:
                cos_s, sin_s = cos, sin
            self._tables = (cos, sin, s, dtype, cos_s.to(dtype), sin_s.to(dtype))
        return self._tables[4:]

    def _attn(self, layer: int):
        def hook(module, args, output):
            if "attn_out" in self.sites:
                self.stash[(layer, "attn_out")] = output.detach()
            if "attn_probs" in self.sites:
                cache = args[3] if len(args) > 3 else None
                hidden = None
                if cache is not None:
                    keys, mask = cache.keys_so_far(self.full_keys)
                    keys = expand_kv(keys, module.heads_per_group)  # the cache holds one head per group
                    hidden = self._hidden_mask(cache.attn_mask, mask)
                else:
                    keys, mask = self.stash[(layer, "k")], None
                self.stash[(layer, "attn_probs")] = attention_probs(self.stash[(layer, "q")], keys, mask, hidden)

        return hook

    def _hidden_mask(self, step_mask: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """~mask, computed by the first layer of a forward (`step_mask`: the cache's mask of this
        forward, of which `mask` is a column slice) and reused by the others."""
        if self._hidden is None or self._hidden[0] is not step_mask or self._hidden[1] != mask.shape:
            self._hidden = (step_mask, mask.shape, ~mask)
        return self._hidden[2]

    def _fc1(self, layer: int):
        def hook(module, args):
            self.stash[(layer, "fc1")] = args[0].detach()

        return hook

    def _store(self, layer: int, site: str):
        def hook(module, args, output):
            self.stash[(layer, site)] = output.detach()

        return hook

    def _residual(self, layer: int, want_lens: bool, want_residual: bool):
        def hook(module, args, output):
            if want_residual:
                self.stash[(layer, "residual")] = output.detach()
            if want_lens:
                self.stash[(layer, LENS)] = output.detach()[:, -1]

        return hook
