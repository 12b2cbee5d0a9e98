"""Samples of an indexed dataset, built as Megatron-Core's `GPTDataset` builds them.

Given the sequences of one split (`sequence_ids`), a sample length `seq_length`, a seed and how
many samples the run needs:

1. num_epochs: the fewest passes over the split whose tokens cover num_samples * seq_length + 1
   (one pass when num_samples is None, unless the split is shorter than one sample).
2. document index: the split's sequence ids repeated num_epochs times and shuffled by
   `numpy.random.RandomState(seed)`; when the last pass would contribute fewer than 80% of an
   epoch's samples it is shuffled on its own after the others ("separate final epoch"), so its
   few samples do not all come from the same few documents.
3. sample index: concatenate the documents in that order into one stream; sample k is the
   seq_length + 1 tokens starting at stream position k * seq_length (consecutive samples share
   one token, and samples run across document boundaries). Row k holds (position in the
   document index, offset in that document) of sample k's first token; there are
   (num_epochs * tokens_per_epoch - 1) // seq_length samples.
4. shuffle index: a permutation of the samples from the same random state (the separate final
   epoch's samples again shuffled apart, after the others).

Sample i of the dataset is sample shuffle_index[i] of the stream. The same seed, split and
num_samples give the same samples, in the same order, on every rank and in every layout.
"""

from __future__ import annotations

import functools

import numpy as np

from megatronapp.data.indexed import IndexedDataset

# Megatron's threshold: a final epoch contributing fewer than this share of an epoch's samples
# is shuffled apart from the others.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def compute_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Passes over the split needed for num_samples samples (each needs seq_length new tokens, plus
    one); None: one pass, or as many as one sample needs. A split shorter than a sample repeats, as
    in Megatron."""
    needed = max(num_samples or 0, 1) * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def compute_separate_final_epoch(
    tokens_per_epoch: int, seq_length: int, num_epochs: int, num_samples: int | None
) -> int | None:
    """The number of samples before the final epoch when that epoch is to be shuffled apart, else None."""
    if num_samples is None or num_epochs == 1:
        return None
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    if num_samples - samples_before_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch):
        return samples_before_final
    return None


def compute_document_index(
    sequence_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`sequence_ids` repeated num_epochs times, shuffled by `rng` (the last epoch apart when asked), int32."""
    if separate_final_epoch and num_epochs > 1:
        first = compute_document_index(sequence_ids, num_epochs - 1, rng, False)
        return np.concatenate((first, compute_document_index(sequence_ids, 1, rng, False)))
    index = np.tile(np.asarray(sequence_ids, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def compute_document_starts(sequence_lengths: np.ndarray, document_index: np.ndarray) -> np.ndarray:
    """Stream position of each document index entry's first token (int64)."""
    lengths = sequence_lengths[document_index].astype(np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def compute_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, tokens_in_stream: int
) -> np.ndarray:
    """(num_samples + 1, 2) int64: (document index position, offset) of each sample's first token,
    the last row being where the last sample's final token is."""
    num_samples = (tokens_in_stream - 1) // seq_length
    starts = compute_document_starts(sequence_lengths, document_index)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # the document holding a position is the last one starting at or before it (empty ones never do)
    documents = np.searchsorted(starts, positions, side="right") - 1
    return np.stack((documents, positions - starts[documents]), axis=1)


def compute_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of range(total): [0, num_samples) shuffled, then [num_samples, total) shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class IndexedGPTDataset:
    """Megatron's GPT samples of the sequences `sequence_ids` of an indexed dataset (see the module doc).

    `len()` is the samples of all num_epochs passes (at least num_samples), `get_samples` returns
    them as the trainer reads them: (n, seq_length + 1) int64 token ids.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        sequence_ids: np.ndarray,
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
        name: str = "",
    ) -> None:
        self.indexed, self.seq_length, self.name = indexed, seq_length, name or indexed.prefix
        self.sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        tokens_per_epoch = int(indexed.sequence_lengths[self.sequence_ids].astype(np.int64).sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"{self.name}: its {len(self.sequence_ids)} documents hold no tokens")
        self.num_epochs = compute_num_epochs(tokens_per_epoch, seq_length, num_samples)
        samples_before_final = compute_separate_final_epoch(tokens_per_epoch, seq_length, self.num_epochs, num_samples)
        rng = np.random.RandomState(seed)
        separate = samples_before_final is not None
        self.document_index = compute_document_index(self.sequence_ids, self.num_epochs, rng, separate)
        self._tokens_in_stream = self.num_epochs * tokens_per_epoch
        total = (self._tokens_in_stream - 1) // seq_length
        self.shuffle_index = compute_shuffle_index(samples_before_final if separate else total, total, rng)
        self._document_starts = compute_document_starts(indexed.sequence_lengths, self.document_index)
        self._sequence_offsets = indexed.token_offsets()

    @functools.cached_property
    def sample_index(self) -> np.ndarray:
        """Megatron's sample index (compute_sample_index). Reading samples needs only its rule,
        sample k starts at stream position k * seq_length, so it is built only when asked for
        (16 bytes a sample)."""
        lengths = self.indexed.sequence_lengths
        return compute_sample_index(lengths, self.document_index, self.seq_length, self._tokens_in_stream)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def get_samples(self, indices: np.ndarray) -> np.ndarray:
        """Samples `indices` stacked as an int64 array of shape (len(indices), seq_length + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample indices out of range for {len(self)} samples")
        start = self.shuffle_index[indices].astype(np.int64) * self.seq_length
        positions = start[:, None] + np.arange(self.seq_length + 1)  # (n, seq_length + 1) stream positions
        documents = np.searchsorted(self._document_starts, positions, side="right") - 1
        in_file = self._sequence_offsets[self.document_index[documents]] + positions - self._document_starts[documents]
        return np.asarray(self.indexed.tokens[in_file], dtype=np.int64)
