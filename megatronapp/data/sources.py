"""Train, valid and test sample streams from Megatron indexed datasets, as Megatron builds them.

    num_samples = compute_split_num_samples(train_iters, global_batch_size, eval_interval, eval_iters)
    splits = build_datasets(config, seq_length=1024, seed=1234, num_samples=num_samples)
    splits.train.get_samples(np.arange(8))   # (8, 1025) int64; splits.valid / .test likewise, or None
    DistributedBatchIterator(splits.valid, ..., shuffle=False)   # this DP rank's microbatches, in order

With `--data-path [W] PREFIX ... --split a,b,c`, each prefix's sequences (Megatron's GPT
datasets split by sequence, one per document as preprocess-data writes them) are cut into
consecutive train/valid/test ranges in the shares a:b:c (Megatron's rounding: each bound
rounded, the last forced to the count); each split is then the blend of its ranges across the
prefixes (blend.py) or, for one prefix, that range alone (gpt_samples.py). With
`--train-data-path` / `--valid-data-path` / `--test-data-path` each split is its own blend of
whole files. A split with share 0, without a path, or (valid, test) whose share rounds to no
documents is None. Prefixes given without weights are each read once and blended by their sample
counts. Checked against Megatron-Core 0.16.1: the same samples, split by split, for one prefix,
weighted and unweighted blends and per-split paths (tests/data/test_indexed_data.py).

num_samples: how many samples each split must provide (the trainer: train_iters *
global_batch_size); None builds one pass over the split's data. The sample order depends only
on (files, split, seed, num_samples, seq_length), never on the parallel layout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatronapp.data.blend import BlendedDataset, compute_dataset_shares, compute_dataset_sizes, normalize_weights
from megatronapp.data.config import DEFAULT_SPLIT, DataConfig
from megatronapp.data.gpt_samples import IndexedGPTDataset
from megatronapp.data.indexed import IndexedDataset, data_file, index_file

SPLIT_NAMES = ("train", "valid", "test")


class Splits(NamedTuple):
    """One sample stream per split (IndexedGPTDataset or BlendedDataset), None where the split is empty."""

    train: object | None
    valid: object | None
    test: object | None


@dataclass(frozen=True)
class SplitPlan:
    """What one split is made of: (prefix, weight) pairs, weights normalised, and each prefix's
    fraction bounds over its sequences."""

    name: str
    prefixes: tuple[str, ...]
    weights: tuple[float, ...]
    fractions: tuple[float, float, float]
    index: int  # which of the three fraction ranges this split takes


def is_indexed_prefix(path: str) -> bool:
    """A path names an indexed dataset when it is not itself a file or folder but PATH.bin or PATH.idx exists."""
    return not os.path.exists(path) and (data_file(path).exists() or index_file(path).exists())


def uses_indexed_data(config: DataConfig) -> bool:
    """Whether the run's data are indexed datasets (else text files or the synthetic corpus).
    --valid/--test-data-path name text files too, beside a text --data-path or the synthetic corpus:
    they make the run indexed only when they name a prefix or a weight."""
    if config.train_data_path or config.split is not None:
        return True
    tokens = (*config.data_path, *config.valid_data_path, *config.test_data_path)
    return any(_is_number(token) or is_indexed_prefix(token) for token in tokens)


def check_not_indexed_file_names(paths: tuple[str, ...]) -> None:
    """Refuse `--data-path corpus.bin` (or .idx): an indexed dataset is named by its prefix."""
    for path in paths:
        if path.endswith((".bin", ".idx")) and os.path.isfile(path):
            raise ValueError(f"--data-path {path}: name an indexed dataset by its prefix, {path[:-4]}")


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return not os.path.exists(token)


def parse_blend(tokens: tuple[str, ...], flag: str) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """`PREFIX`, `PREFIX PREFIX ...` (weights None) or `W PREFIX W PREFIX ...` -> (prefixes, weights)."""
    if len(tokens) == 0:
        raise ValueError(f"{flag} needs at least one dataset prefix")
    if not _is_number(tokens[0]):
        if any(_is_number(t) for t in tokens):
            raise ValueError(f"{flag}: give a weight before every prefix or before none ({' '.join(tokens)})")
        return tuple(tokens), None
    if len(tokens) % 2:
        raise ValueError(f"{flag}: expected WEIGHT PREFIX pairs, got {len(tokens)} values")
    weights, prefixes = tokens[0::2], tokens[1::2]
    for w in weights:
        if not _is_number(w):
            raise ValueError(f"{flag}: {w!r} is not a weight (expected WEIGHT PREFIX pairs)")
    try:
        normalized = normalize_weights([float(w) for w in weights])
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return tuple(prefixes), tuple(float(w) for w in normalized)


def parse_split(text: str) -> tuple[float, float, float]:
    """`969,30,1` (or `98/1/1`, `98 1 1`) -> shares normalised to sum to 1; fewer than three
    values are padded with zeros, as Megatron does."""
    parts = [p for p in re.split(r"[,/\s]+", text.strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {text!r}: expected up to three numbers, e.g. 969,30,1") from None
    if not 1 <= len(values) <= 3:
        raise ValueError(f"--split {text!r}: expected train,valid,test shares (three numbers), got {len(values)}")
    if any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {text!r}: shares must be >= 0 with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def compute_split_bounds(fractions: tuple[float, ...], num_sequences: int) -> list[int]:
    """[0, end of train, end of valid, num_sequences]: each share rounded, the rounding error taken
    off every bound so the last is the count (Megatron's rule)."""
    bounds = [0]
    for share in fractions:
        bounds.append(bounds[-1] + int(round(share * float(num_sequences))))
    excess = bounds[-1] - num_sequences
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def plan_splits(config: DataConfig) -> list[SplitPlan | None]:
    """The three splits' makeup from the flags alone (no file is read)."""
    if config.has_per_split_paths:
        if config.data_path:
            raise ValueError("--data-path and --train-data-path/--valid-data-path/--test-data-path exclude each other")
        if config.split is not None:
            raise ValueError("--split applies to --data-path; --train/valid/test-data-path are already split")
        plans = []
        for i, (name, tokens) in enumerate(zip(SPLIT_NAMES, config.per_split_paths)):
            if not tokens:
                plans.append(None)
                continue
            prefixes, weights = parse_blend(tokens, f"--{name}-data-path")
            one_hot = tuple(1.0 if j == i else 0.0 for j in range(3))
            plans.append(SplitPlan(name, prefixes, weights or (), one_hot, i))
        return plans
    prefixes, weights = parse_blend(config.data_path, "--data-path")
    fractions = parse_split(config.split or DEFAULT_SPLIT)
    return [
        SplitPlan(name, prefixes, weights or (), fractions, i) if fractions[i] > 0 else None
        for i, name in enumerate(SPLIT_NAMES)
    ]


def open_indexed_datasets(plans: list[SplitPlan | None]) -> dict[str, IndexedDataset]:
    """Every prefix the plans name, opened once (one-line ValueError for a missing or damaged file)."""
    opened: dict[str, IndexedDataset] = {}
    for plan in plans:
        for prefix in plan.prefixes if plan else ():
            if prefix not in opened:
                if Path(prefix).is_file() or Path(prefix).is_dir():
                    raise ValueError(
                        f"{prefix} is a text file or folder; weights, --split and --train/valid/test-data-path "
                        "take indexed datasets (PREFIX for PREFIX.bin + PREFIX.idx)"
                    )
                opened[prefix] = IndexedDataset(prefix)
    return opened


def _split_sequences(plan: SplitPlan, indexed: IndexedDataset) -> np.ndarray:
    bounds = compute_split_bounds(plan.fractions, len(indexed))
    return np.arange(bounds[plan.index], bounds[plan.index + 1], dtype=np.int64)


def _is_empty(plan: SplitPlan, opened: dict[str, IndexedDataset]) -> bool:
    """Whether the split holds no documents: fine for valid and test (the split is None then),
    refused for train and when only some prefixes of a blend have documents in it."""
    empty = [p for p in plan.prefixes if _split_sequences(plan, opened[p]).size == 0]
    if empty and (plan.index == 0 or len(empty) < len(plan.prefixes)):
        raise ValueError(
            f"{empty[0]}: the {plan.name} split holds none of its {len(opened[empty[0]])} documents; "
            "add data or change --split"
        )
    return bool(empty)


def _build_split(plan, opened, seq_length: int, seed: int, num_samples: int | None):
    """One split's stream: a single prefix's samples; a weighted blend of samples built to each
    dataset's share; or, without weights, every prefix's samples once, blended by their counts
    (capped at num_samples), as Megatron does."""

    def build_one(prefix: str, size: int | None) -> IndexedGPTDataset:
        indexed = opened[prefix]
        name = f"{prefix} ({plan.name} split)"
        return IndexedGPTDataset(indexed, _split_sequences(plan, indexed), seq_length, seed, size, name)

    if len(plan.prefixes) == 1:
        return build_one(plan.prefixes[0], num_samples)
    if not plan.weights or num_samples is None:
        datasets = [build_one(p, None) for p in plan.prefixes]
        total = sum(map(len, datasets))
        weights = plan.weights or [len(d) for d in datasets]
        return BlendedDataset(datasets, weights, total if num_samples is None else min(num_samples, total))
    weights = np.asarray(plan.weights)
    datasets = [build_one(p, s) for p, s in zip(plan.prefixes, compute_dataset_sizes(weights, num_samples))]
    return BlendedDataset(datasets, weights, sum(compute_dataset_shares(weights, num_samples)))


def compute_split_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int | None = None, eval_iters: int = 0
) -> tuple[int, int, int]:
    """Samples each split must provide, as Megatron asks for them: train_iters global batches;
    valid: eval_iters batches at every eval_interval and once at the end; test: eval_iters batches."""
    evaluations = train_iters // eval_interval + 1 if eval_interval else 1
    return (
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


def build_datasets(
    config: DataConfig,
    *,
    seq_length: int,
    seed: int,
    num_samples: tuple[int | None, int | None, int | None] = (None, None, None),
) -> Splits:
    """The train/valid/test sample streams the config describes (see the module doc)."""
    plans = plan_splits(config)
    opened = open_indexed_datasets(plans)
    built = [
        _build_split(plan, opened, seq_length, seed, n) if plan and not _is_empty(plan, opened) else None
        for plan, n in zip(plans, num_samples)
    ]
    return Splits(*built)


def check_data_config(config: DataConfig, vocab_size: int | None = None) -> None:
    """What a training run's data would fail on, cheaply: the flags, no train split, every prefix's
    files, splits without documents or tokens and (with vocab_size) token ids the tokenizer does
    not have (IndexedDataset.compute_token_range)."""
    plans = plan_splits(config)
    if plans[0] is None:
        raise ValueError(
            "no train split: --train-data-path is needed"
            if config.has_per_split_paths
            else f"--split {config.split}: the train share is 0"
        )
    opened = open_indexed_datasets(plans)
    if vocab_size is not None:
        for indexed in opened.values():
            _check_token_range(indexed, vocab_size)
    for plan in plans:
        for prefix in plan.prefixes if plan and not _is_empty(plan, opened) else ():
            ids = _split_sequences(plan, opened[prefix])
            tokens = int(opened[prefix].sequence_lengths[ids].astype(np.int64).sum())
            if tokens == 0:
                raise ValueError(f"{prefix} ({plan.name} split): its {len(ids)} documents hold no tokens")


def split_has_documents(config: DataConfig, index: int) -> bool:
    """Whether split `index` (0 train, 1 valid, 2 test) of an indexed run holds any document."""
    plan = plan_splits(config)[index]
    return plan is not None and not _is_empty(plan, open_indexed_datasets([plan]))


def _check_token_range(indexed: IndexedDataset, vocab_size: int) -> None:
    low, high = indexed.compute_token_range()
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{data_file(indexed.prefix)}: token id {low if low < 0 else high} is outside the tokenizer's "
            f"{vocab_size} ids; give the tokenizer the data was made with (--tokenizer-model / --tokenizer-type)"
        )
