"""Key/value cache for incremental decoding, with left-padded batches of prompts.

Prompts of different lengths are left-padded to one length, so every row's newest token
sits in the same column. Row b has `pad_left[b]` padding columns; its token at column c has
rotary position c - pad_left[b]. For a step that appends columns [start, start + S):

    positions[b, i]      = max(0, start + i - pad_left[b])                      (B, S)
    attn_mask[b, 0, i, j] = (j <= start + i and j >= pad_left[b]) or j == start + i   (B, 1, S, T)

The `j == start + i` term lets a padding column attend to itself only, so no softmax row is
empty (an empty row would give NaN that could leak into the cache). Buffers are allocated
once for the longest sequence and written in place.
"""

from __future__ import annotations

import torch


def compute_positions_and_mask(pad_left: torch.Tensor, start: int, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions (B, S) and boolean attention mask (B, 1, S, start + S) for one step."""
    device = pad_left.device
    q_col = torch.arange(start, start + num_new, device=device)  # (S,)
    k_col = torch.arange(start + num_new, device=device)  # (T,)
    positions = (q_col[None, :] - pad_left[:, None]).clamp(min=0)
    causal = k_col[None, :] <= q_col[:, None]  # (S, T)
    valid = k_col[None, :] >= pad_left[:, None]  # (B, T)
    itself = k_col[None, :] == q_col[:, None]  # (S, T)
    mask = (causal[None] & valid[:, None, :]) | itself[None]
    return positions, mask.unsqueeze(1)


class LayerCache:
    """One layer's view: `update(k, v)` stores this step's keys/values and returns all so far."""

    def __init__(self, cache: "KVCache", layer: int):
        self.cache, self.layer = cache, layer

    @property
    def attn_mask(self) -> torch.Tensor:
        return self.cache.attn_mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (B, local heads, S, D), rotary already applied to k
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        start, end = self.cache.start, self.cache.start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def keys_so_far(self) -> torch.Tensor:
        """(B, local heads, T, D) keys including this step's (read by MegaScope's attention maps)."""
        return self.cache.keys[self.layer][:, :, :self.cache.start + self.cache.num_new]


class KVCache:
    """Keys and values of the layers one pipeline rank holds, for a batch of left-padded rows."""

    def __init__(self, layers, *, batch: int, local_heads: int, head_dim: int, max_len: int,
                 pad_left: torch.Tensor, dtype: torch.dtype, device):
        shape = (batch, local_heads, max_len, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.max_len = max_len
        self.pad_left = pad_left.to(device)
        self.start = 0  # columns stored before the current step
        self.num_new = 0
        self.positions = self.attn_mask = None

    def begin_step(self, num_new: int) -> None:
        """Prepare positions and mask for `num_new` new columns (call before the forward)."""
        if self.start + self.num_new + num_new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; step would need "
                             f"{self.start + self.num_new + num_new}")
        self.start += self.num_new
        self.num_new = num_new
        self.positions, self.attn_mask = compute_positions_and_mask(self.pad_left, self.start, num_new)

    def layer(self, layer: int) -> LayerCache:
        return LayerCache(self, layer)
