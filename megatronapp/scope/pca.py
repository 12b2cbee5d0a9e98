"""PCA of captured hidden states over tokens, with torch's randomized low-rank PCA."""

from __future__ import annotations

import torch

from megatronapp.scope.compress import CapturedItem
from megatronapp.scope.store import dequantized


def compute_pca(x: torch.Tensor, k: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Project rows of x (N, F) on their top-k principal axes: (coords (N, k), explained
    variance ratio (k,)). Deterministic for a given seed."""
    x = x.float()
    k = max(1, min(k, x.shape[0], x.shape[1]))
    centered = x - x.mean(dim=0, keepdim=True)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # pca_lowrank draws a random projection
    try:
        _, s, v = torch.pca_lowrank(centered, q=k, center=False)
    finally:
        torch.random.set_rng_state(state)
    total = centered.pow(2).sum().clamp(min=1e-30)
    return centered @ v[:, :k], s[:k].pow(2) / total


def token_rows(items: list[CapturedItem]) -> torch.Tensor:
    """Rows (tokens, features) of (batch, token, features) items, concatenated over steps."""
    rows = []
    for it in sorted(items, key=lambda i: i.step):
        data = dequantized(it)
        if it.dims[:2] != ("batch", "token"):
            raise ValueError(f"PCA needs a (batch, token, features) site, not {it.site} {it.dims}")
        rows.append(data.reshape(-1, data.shape[-1]))
    if not rows:
        raise ValueError("nothing captured for PCA at that site/layer")
    return torch.cat(rows)
