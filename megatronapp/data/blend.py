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


def _choose_datasets(weights: list[float], drawn: list[int], start: int, stop: int) -> np.ndarray:
    """The dataset of samples start..stop-1, given the counts `drawn` before `start` (updated).

    The choice is sequential (each depends on the counts so far), so it is a plain loop over
    Python floats, which round as Megatron's C++ doubles do: about 1.3 s per million samples."""
    others = range(1, len(weights))
    choices = [0] * (stop - start)
    for i in range(start, stop):
        scale = i if i > 1 else 1  # max(i, 1)
        best, best_error = 0, weights[0] * scale - drawn[0]
        for d in others:
            error = weights[d] * scale - drawn[d]
            if error > best_error:  # strictly: ties go to the first dataset
                best, best_error = d, error
        choices[i - start] = best
        drawn[best] += 1
    return np.asarray(choices, dtype=np.int64)


class BlendingIndices:
    """Megatron's blending indices, computed chunk by chunk as far as they are read: a run pays
    for the samples it reaches (a resumed one for those before its position), not for the whole
    schedule at start-up."""

    CHUNK = 1 << 20

    def __init__(self, weights: np.ndarray, size: int) -> None:
        self.weights, self.size = [float(w) for w in weights], size
        self._drawn = [0] * len(self.weights)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (dataset, sample within it) per chunk

    def _extend(self) -> None:
        start = len(self._chunks) * self.CHUNK
        before = list(self._drawn)
        datasets = _choose_datasets(self.weights, self._drawn, start, min(start + self.CHUNK, self.size))
        samples = np.empty(len(datasets), dtype=np.int64)
        for d, first in enumerate(before):
            picked = datasets == d
            samples[picked] = np.arange(first, self._drawn[d])
        self._chunks.append((datasets, samples))

    def lookup(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within it) of each of `indices` (all in 0..size-1)."""
        indices = np.asarray(indices, dtype=np.int64)
        datasets, samples = np.empty_like(indices), np.empty_like(indices)
        chunk_of = indices // self.CHUNK
        for chunk in np.unique(chunk_of):
            while len(self._chunks) <= chunk:
                self._extend()
            rows = chunk_of == chunk
            chunk_datasets, chunk_samples = self._chunks[chunk]
            datasets[rows] = chunk_datasets[indices[rows] % self.CHUNK]
            samples[rows] = chunk_samples[indices[rows] % self.CHUNK]
        return datasets, samples


def compute_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, that sample's index within its dataset), both (size,) int64."""
    return BlendingIndices(weights, size).lookup(np.arange(size))


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
        self.size = size
        self.indices = BlendingIndices(self.weights, size)

    def __len__(self) -> int:
        return self.size

    def get_samples(self, indices: np.ndarray) -> np.ndarray:
        """Samples `indices` stacked as an int64 array of shape (len(indices), seq_length + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.size):
            raise IndexError(f"sample indices out of range for {self.size} samples")
        out = np.empty((len(indices), self.seq_length + 1), dtype=np.int64)
        which, within = self.indices.lookup(indices)
        for d, dataset in enumerate(self.datasets):
            rows = np.flatnonzero(which == d)
            if rows.size:
                out[rows] = dataset.get_samples(within[rows] % len(dataset))
        return out
