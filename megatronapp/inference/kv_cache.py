"""Key/value cache for incremental decoding, with left-padded batches of prompts.

Prompts of different lengths are left-padded to one length, so every row's newest token
sits in the same column. Row b has `pad_left[b]` padding columns; its token at column c has
rotary position c - pad_left[b]. For a step that appends columns [start, start + S):

    positions[b, i]      = max(0, start + i - pad_left[b])                      (B, S)
    attn_mask[b, 0, i, j] = (j <= start + i and j >= pad_left[b]) or j == start + i   (B, 1, S, T)

The `j == start + i` term lets a padding column attend to itself only, so no softmax row is
empty (an empty row would give NaN that could leak into the cache). Buffers are allocated
once for the longest sequence and written in place.

Static mode (for CUDA graphs): the step's start column lives in a device tensor, keys and
values are written with index_copy_ and attention always spans all `max_len` columns (the
mask hides the unwritten ones), so a decode step has the same shapes and addresses every
time; positions and mask are computed inside the forward by `prepare()`. A static cache is
`reset` for the next generation of the same shape instead of reallocated, so a captured decode
graph (which reads these very tensors) can be replayed again.
"""

from __future__ import annotations

import torch


def compute_positions_and_mask(
    pad_left: torch.Tensor, start, num_new: int, key_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions (B, S) and boolean attention mask (B, 1, S, T) for one step; `start`
    is an int or a 0-d device tensor, T = key_len (default start + S)."""
    device = pad_left.device
    q_col = start + torch.arange(num_new, device=device)  # (S,)
    k_col = torch.arange(start + num_new if key_len is None else key_len, device=device)  # (T,)
    positions = (q_col[None, :] - pad_left[:, None]).clamp(min=0)
    causal = k_col[None, :] <= q_col[:, None]  # (S, T)
    valid = k_col[None, :] >= pad_left[:, None]  # (B, T)
    itself = k_col[None, :] == q_col[:, None]  # (S, T)
    mask = (causal[None] & valid[:, None, :]) | itself[None]
    return positions, mask.unsqueeze(1)


class LayerCache:
    """One layer's view: `update(k, v)` stores this step's keys/values and returns all so far."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    @property
    def attn_mask(self) -> torch.Tensor:
        return self.cache.attn_mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (B, local key/value heads, S, D), rotary already applied to k
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        if self.cache.static:
            columns = self.cache.start_t + torch.arange(k.shape[2], device=k.device)
            keys.index_copy_(2, columns, k)
            values.index_copy_(2, columns, v)
            return keys, values
        start, end = self.cache.start, self.cache.start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def keys_so_far(self, full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys (B, local key/value heads, T, D), mask (B, 1, S, T)) over the T columns written so far,
        this step's included (read by MegaScope's attention maps). `full` (static mode): all
        max_len columns, unwritten ones masked, so the shapes do not change between steps."""
        if full and self.cache.static:
            return self.cache.keys[self.layer], self.cache.attn_mask
        end = self.cache.start + self.cache.num_new
        return self.cache.keys[self.layer][:, :, :end], self.cache.attn_mask[..., :end]


STATIC_LENGTH_STEP = 64


def compute_static_length(max_len: int, seq_length: int) -> int:
    """Columns of a static cache: `max_len` rounded up to a multiple of 64 (at most the model's
    sequence length), so generations of similar length share one cache and decode graph."""
    return min(seq_length, -(-max_len // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP)


class KVCache:
    """Keys and values of the layers one pipeline rank holds, for a batch of left-padded rows.

    Sized by key/value heads: with grouped-query attention one per query group (a rank's
    groups / TP), which the attention expands to its query heads after reading the cache."""

    def __init__(
        self,
        layers,
        *,
        batch: int,
        local_kv_heads: int,
        head_dim: int,
        max_len: int,
        pad_left: torch.Tensor,
        dtype: torch.dtype,
        device,
        static: bool = False,
    ):
        shape = (batch, local_kv_heads, max_len, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.max_len = max_len
        self.pad_left = pad_left.to(device)
        self.start = 0  # columns stored before the current step
        self.num_new = 0
        self.positions = self.attn_mask = None
        self.static = static
        self.start_t = torch.zeros((), dtype=torch.long, device=device)  # static mode's start column

    def matches(self, batch: int, max_len: int) -> bool:
        """True when this static cache can serve a generation of `batch` rows and `max_len` columns."""
        return self.static and self.pad_left.shape[0] == batch and self.max_len == max_len

    def reset(self, pad_left: torch.Tensor) -> None:
        """Empty the cache for a new batch, in place (same tensors: captured graphs stay valid)."""
        for t in (*self.keys.values(), *self.values.values()):
            t.zero_()  # stale columns are masked, but 0 * NaN would still leak through attention
        self.pad_left.copy_(pad_left)
        self.start = self.num_new = 0
        self.start_t.fill_(0)

    def begin_step(self, num_new: int) -> None:
        """Prepare positions and mask for `num_new` new columns (call before the forward)."""
        if self.start + self.num_new + num_new > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; step would need {self.start + self.num_new + num_new}"
            )
        self.start += self.num_new
        self.num_new = num_new
        if self.static:
            self.start_t.fill_(self.start)
        else:
            self.positions, self.attn_mask = compute_positions_and_mask(self.pad_left, self.start, num_new)

    def prepare(self) -> None:
        """Static mode: positions and mask of the current step from device state (inside the
        forward, so a CUDA graph recomputes them on every replay)."""
        if self.static:
            self.positions, self.attn_mask = compute_positions_and_mask(
                self.pad_left, self.start_t, self.num_new, self.max_len
            )

    def layer(self, layer: int) -> LayerCache:
        return LayerCache(self, layer)
