"""The validation and test streams: held-out samples, read from their start at every evaluation.

An evaluation stream (engine/evaluation.py's `EvalBatches`) is called with a number of global
batches and yields this DP rank's microbatches of each, always from the stream's first batch,
with the same global batch, microbatch and DP slicing as training (data/dataset.py). So the
samples a validation loss is computed on do not depend on the training stream's position, on
the layout, or on whether the run was resumed.

Where the samples come from:
* `--valid-data-path` / `--test-data-path`: text / JSONL files, as `--data-path`;
* the embedded synthetic corpus (no `--data-path`): documents of the same generator drawn from
  a seed of their own per split ("1234/valid", "1234/test"), which no integer training seed
  produces, so validation text is never a training document's random stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatronapp.data.dataset import DistributedBatchIterator, GPTDataset
from megatronapp.data.synthetic import default_corpus_tokens
from megatronapp.data.tokenizer import Tokenizer

EVAL_SPLITS = ("valid", "test")


def held_out_corpus_seed(seed: int, split: str) -> str:
    """The synthetic generator's seed for `split`: random.Random hashes a str seed (SHA-512), so
    the stream differs from every integer seed's, and is the same on every machine."""
    return f"{seed}/{split}"


def build_held_out_synthetic_dataset(
    tokenizer: Tokenizer, seq_length: int, seed: int, split: str, num_samples: int
) -> GPTDataset:
    """`num_samples` samples of the synthetic corpus drawn for `split` (one of EVAL_SPLITS)."""
    if split not in EVAL_SPLITS:
        raise ValueError(f"unknown evaluation split {split!r}; choose from {', '.join(EVAL_SPLITS)}")
    num_tokens = max(1, num_samples) * seq_length + 1
    return GPTDataset(default_corpus_tokens(tokenizer, num_tokens, held_out_corpus_seed(seed, split)), seq_length)


class RestartableBatches:
    """An evaluation stream over a dataset: each call reads global batches from its first one."""

    def __init__(
        self,
        dataset: GPTDataset,
        *,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,  # False for Megatron's indexed samples, shuffled already
    ) -> None:
        self.dataset = dataset
        self.iterator_kw = dict(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            shuffle=shuffle,
        )
        DistributedBatchIterator(dataset, **self.iterator_kw)  # checks the geometry now, not at the first evaluation

    def __call__(self, num_batches: int) -> Iterator[list[torch.Tensor]]:
        stream = DistributedBatchIterator(self.dataset, **self.iterator_kw)
        for _ in range(num_batches):
            yield stream.next_microbatches()
