"""Weighted blends of datasets, drawn as Megatron-Core's `BlendedDataset` draws them.

`--data-path 0.3 A 0.7 B`: weights are normalised to sum to 1 (so `30 A 70 B` is the same
blend); a blend asked for `size` samples holds sum(ceil(size * weight)) of them, and each
dataset is asked for ceil(ceil(size * weight) * 1.005) (Megatron's 0.5% margin). Sample i of the blend comes from the dataset whose running count lags its weight the
most: the dataset d maximising weight[d] * max(i, 1) - drawn[d] (the first on ties), which takes
that dataset's next sample in its own order. Every prefix of the blend is then within one
sample per dataset of the stated proportions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SIZE_MARGIN = 1.005  # Megatron's: each dataset is asked for slightly more than its share


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights scaled to sum to 1; ValueError for a negative or non-finite weight or a zero sum."""
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"blend weights must be finite and >= 0, got {list(weights)}")
    if w.sum() <= 0:
        raise ValueError(f"blend weights sum to {w.sum():g}; at least one must be positive")
    return w / w.sum()


def compute_dataset_shares(weights: np.ndarray, size: int) -> list[int]:
    """Each dataset's share of a blend of `size` samples, rounded up; the blend's length is their sum."""
    return [int(math.ceil(size * float(w))) for w in weights]


def compute_dataset_sizes(weights: np.ndarray, size: int) -> list[int]:
    """The samples to ask of each dataset of a blend of `size` samples: its share plus the margin."""
    return [int(math.ceil(share * SIZE_MARGIN)) for share in compute_dataset_shares(weights, size)]


def compute_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, that sample's index within its dataset), both (size,) int64.

    The choice is sequential (each depends on the counts so far), so it is a plain loop over
    Python floats, which round as Megatron's C++ doubles do: about 1.3 s per million samples."""
    weights = [float(w) for w in weights]
    drawn = [0] * len(weights)
    others = range(1, len(weights))
    choices = [0] * size
    for i in range(size):
        scale = i if i > 1 else 1  # max(i, 1)
        best, best_error = 0, weights[0] * scale - drawn[0]
        for d in others:
            error = weights[d] * scale - drawn[d]
            if error > best_error:  # strictly: ties go to the first dataset
                best, best_error = d, error
        choices[i] = best
        drawn[best] += 1
    dataset_index = np.asarray(choices, dtype=np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    for d, count in enumerate(drawn):
        sample_index[dataset_index == d] = np.arange(count)
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in the proportions `weights` (normalised here).

    Each dataset needs `len()` and `get_samples(indices)` and should hold at least
    compute_dataset_sizes(weights, size) samples; a shorter one wraps around."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.seq_length = self.datasets[0].seq_length
        self.dataset_index, self.dataset_sample_index = compute_blending_indices(self.weights, size)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def get_samples(self, indices: np.ndarray) -> np.ndarray:
        """Samples `indices` stacked as an int64 array of shape (len(indices), seq_length + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_length + 1), dtype=np.int64)
        which = self.dataset_index[indices]
        for d, dataset in enumerate(self.datasets):
            rows = np.flatnonzero(which == d)
            if rows.size:
                out[rows] = dataset.get_samples(self.dataset_sample_index[indices[rows]] % len(dataset))
        return out
