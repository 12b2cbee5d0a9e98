"""From text files to the microbatches each data-parallel rank trains on.

    files --load_text_documents--> documents --build_token_stream--> 1-D token ids
          --GPTDataset--> samples of seq_length + 1 tokens (inputs and shifted labels)
          --DistributedBatchIterator--> this DP rank's microbatches of each global batch

The sample order depends only on (seed, dataset size), never on the DP size: global batch
i is the same set of samples whether one process or eight train it. That is what makes a
parallel run comparable, step by step, with its single-process reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from megatronapp.data.synthetic import default_corpus_tokens
from megatronapp.data.tokenizer import Tokenizer, build_token_stream

__all__ = [
    "DEFAULT_NUM_TOKENS",
    "DistributedBatchIterator",
    "GPTDataset",
    "build_default_dataset",
    "build_text_dataset",
    "build_token_stream",
    "compute_epoch_permutation",
    "compute_replica_sample_range",
    "check_text_files",
    "check_token_id_files",
    "load_text_documents",
]

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
_BINARY_SNIFF_BYTES = 8192  # as git and grep decide a file is binary: a NUL byte among the first 8 KiB
DEFAULT_NUM_TOKENS = 1 << 20  # ~1M tokens: several epochs of headroom for demo runs, < 1 s to build


def load_text_documents(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Documents from plain-text and Megatron-style JSONL files, in the order given.

    - `.txt`: the whole file is ONE document (paragraph breaks stay inside it, so a story is
      never cut by an EOD at a blank line).
    - `.jsonl` / `.json`: one JSON object per line with a string field "text"; blank lines are
      skipped; any other line raises ValueError naming `file:line`.
    - a directory: its .txt/.jsonl/.json files in sorted name order (not recursive).
    Whitespace-only documents are dropped. Files must be non-empty UTF-8 text: an empty file, a
    binary file (a NUL byte early on) or invalid UTF-8 raises ValueError naming the file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    documents: list[str] = []
    for file in _expand_paths([Path(p) for p in paths]):
        _check_text_file(file)
        if file.suffix.lower() in JSONL_SUFFIXES:
            documents.extend(_load_jsonl_documents(file))
        else:
            documents.append(_load_txt_document(file))
    return [d for d in documents if d.strip()]


def _expand_paths(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file() and _is_supported(p)))
        elif not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        elif not _is_supported(path):
            raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use .txt or .jsonl")
        else:
            files.append(path)
    return files


def _check_text_file(file: Path) -> None:
    """Refuse what is surely not a text corpus before decoding it: an empty file (a failed
    download or export) and a binary one (text has no NUL bytes; a tokenizer would take it)."""
    with open(file, "rb") as f:
        head = f.read(_BINARY_SNIFF_BYTES)
    if not head:
        raise ValueError(f"{file}: empty file")
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{file}: a binary file, not UTF-8 text (NUL byte at offset {nul})")


def _is_supported(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES


def _load_txt_document(file: Path) -> str:
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not valid UTF-8 at byte {e.start}") from None


def _load_jsonl_documents(file: Path) -> list[str]:
    documents = []
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                documents.append(_parse_jsonl_line(raw, f"{file}:{lineno}"))
    return documents


def parse_jsonl_record(raw: bytes, where: str, keys: tuple[str, ...]) -> dict:
    """One JSONL line as an object with a string field for each of `keys`; ValueError (one line,
    `where` first) for bytes that are not UTF-8, not JSON, or not such an object."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    for key in keys:
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f'{where}: expected a JSON object with a string "{key}" field')
    return record


def _parse_jsonl_line(raw: bytes, where: str) -> str:
    return parse_jsonl_record(raw, where, ("text",))["text"]


class GPTDataset:
    """Non-overlapping windows of a token stream.

    Sample i is tokens[i*seq_length : i*seq_length + seq_length + 1]: the model reads the
    first seq_length ids and predicts the last seq_length, so consecutive samples share
    one boundary token and no token is a label twice.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tokens.shape}")
        if len(tokens) < seq_length + 1:
            raise ValueError(
                f"token stream has {len(tokens)} tokens, fewer than one sample of "
                f"seq_length + 1 = {seq_length + 1}; add data or lower --seq-length"
            )
        self.tokens = tokens
        self.seq_length = seq_length
        self._num_samples = (len(tokens) - 1) // seq_length

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample `index` (negative counts from the end) as a (seq_length + 1,) array view."""
        if not -self._num_samples <= index < self._num_samples:
            raise IndexError(f"sample {index} out of range for {self._num_samples} samples")
        start = (index % self._num_samples) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1]

    def get_samples(self, indices: np.ndarray) -> np.ndarray:
        """Samples `indices` stacked as an int64 array of shape (len(indices), seq_length + 1)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self._num_samples):
            raise IndexError(f"sample indices out of range for {self._num_samples} samples")
        offsets = indices[:, None] * self.seq_length + np.arange(self.seq_length + 1)
        return self.tokens[offsets].astype(np.int64)


def compute_epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of sample indices in `epoch`: a permutation of range(num_samples) that
    depends only on (num_samples, seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def compute_num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Microbatches per DP rank and step; ValueError (one line) when the global batch does not
    split into micro batches over the DP ranks (the job's check before launch is this one)."""
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by micro batch size "
            f"{micro_batch_size} x data-parallel size {dp_size}"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def compute_replica_sample_range(replica_microbatches: tuple[int, ...], dp_rank: int, micro_batch_size: int) -> range:
    """Positions in the global batch that DP rank `dp_rank` trains when replica r runs
    replica_microbatches[r] microbatches: the replicas' contiguous slices in rank order, so the
    global batch's samples are the same set under any split, and sample i keeps its position i.

    Worked example, micro 1, split (3, 1): rank 0 takes positions 0..2, rank 1 position 3.
    """
    first = sum(replica_microbatches[:dp_rank]) * micro_batch_size
    return range(first, first + replica_microbatches[dp_rank] * micro_batch_size)


class DistributedBatchIterator:
    """Hands one data-parallel rank its microbatches of each global batch.

    The sample stream is the concatenation of per-epoch permutations
    (compute_epoch_permutation). Global batch i is positions
    [i*global_batch_size, (i+1)*global_batch_size) of that stream; DP rank r takes the
    contiguous slice [r*per_rank, (r+1)*per_rank) of it, per_rank = global // dp_size, and
    splits that into micro_batch_size chunks in order.

    Worked example, global 8, micro 2, dp_size 2: the batch's 8 samples s0..s7 go
    rank 0 -> [s0 s1] [s2 s3], rank 1 -> [s4 s5] [s6 s7]; with dp_size 1 one rank gets
    [s0 s1] [s2 s3] [s4 s5] [s6 s7]: the same samples, so the same averaged gradient.

    `shuffle=False` reads the dataset in its own order (position p is sample p % len), for
    datasets that are shuffled already, as Megatron's indexed GPT datasets and blends are
    (data/sources.py); `dataset` is anything with `len()` and `get_samples(indices)`.
    """

    def __init__(
        self,
        dataset: GPTDataset,
        *,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("global_batch_size", global_batch_size),
            ("dp_size", dp_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        compute_num_microbatches(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if seed < 0:
            raise ValueError(f"data seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0
        self._cached_epoch = -1
        self._cached_permutation = np.empty(0, dtype=np.int64)

    @property
    def num_microbatches(self) -> int:
        return compute_num_microbatches(self.global_batch_size, self.micro_batch_size, self.dp_size)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // len(self.dataset)

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            self._cached_permutation = compute_epoch_permutation(len(self.dataset), self.seed, epoch)
            self._cached_epoch = epoch
        return self._cached_permutation

    def compute_global_batch_indices(self, start: int) -> np.ndarray:
        """Sample indices at stream positions [start, start + global_batch_size), across
        epoch boundaries (a global batch may be larger than the dataset)."""
        n = len(self.dataset)
        positions = np.arange(start, start + self.global_batch_size)
        if not self.shuffle:
            return positions % n
        indices = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(positions // n):
            in_epoch = positions // n == epoch
            indices[in_epoch] = self._epoch_permutation(int(epoch))[positions[in_epoch] % n]
        return indices

    def next_microbatches(self, replica_microbatches: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        """This rank's num_microbatches LongTensors of shape (micro_batch_size, seq_length + 1)
        for the next global batch (replica_microbatches[dp_rank] of them under an uneven split,
        see compute_replica_sample_range); advances consumed_samples by global_batch_size."""
        batch = self.compute_global_batch_indices(self.consumed_samples)
        split = replica_microbatches or (self.num_microbatches,) * self.dp_size
        positions = compute_replica_sample_range(split, self.dp_rank, self.micro_batch_size)
        mine = batch[positions.start : positions.stop]
        self.consumed_samples += self.global_batch_size
        samples = torch.from_numpy(self.dataset.get_samples(mine))
        return list(samples.split(self.micro_batch_size))

    def state_dict(self) -> dict[str, int]:
        """Position in the sample stream (global, so it resumes under any dp_size) plus
        what the order depends on, checked on load."""
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_samples": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at `state["consumed_samples"]`; ValueError if the seed or dataset size
        differ, because the resumed order would silently not continue the saved one."""
        for key, ours in (("seed", self.seed), ("num_samples", len(self.dataset))):
            if key in state and int(state[key]) != ours:
                raise ValueError(f"data iterator state has {key}={state[key]} but this run has {ours}")
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self.consumed_samples = consumed


def check_text_files(paths: Iterable[str | os.PathLike], flag: str) -> None:
    """Every text file of `flag` loads as documents (load_text_documents' own checks: empty,
    binary, invalid UTF-8, bad JSONL lines, unsupported types) and at least one has text;
    ValueError naming the flag and the file otherwise."""
    paths = list(paths)
    try:
        documents = load_text_documents(paths)
    except ValueError as exc:
        raise ValueError(f"{flag} {exc}") from None
    if not documents:
        raise ValueError(f"{flag} {' '.join(map(str, paths))}: no non-empty documents")


def check_token_id_files(paths: Iterable[str | os.PathLike], flag: str, vocab_size: int) -> None:
    """NullTokenizer's text files: every document whitespace-separated integer ids in
    0..vocab_size-1; ValueError naming the flag, the file and the first token that is not.
    Checked before launch: the ranks would fail mid-build, or index the embedding out of range."""
    for file in _expand_paths([Path(p) for p in paths]):
        for document in load_text_documents(file):
            for token in document.split():
                if not token.lstrip("-").isdigit():
                    raise ValueError(
                        f"{flag} {file}: NullTokenizer reads whitespace-separated integer ids, found {token[:40]!r}"
                    )
                if not 0 <= int(token) < vocab_size:
                    raise ValueError(
                        f"{flag} {file}: token id {token} is outside --vocab-size {vocab_size} (ids 0..{vocab_size - 1})"
                    )


def build_default_dataset(
    tokenizer: Tokenizer, seq_length: int, seed: int, num_tokens: int = DEFAULT_NUM_TOKENS
) -> GPTDataset:
    """A GPTDataset over `num_tokens` tokens of the embedded synthetic corpus (see synthetic.py)."""
    return GPTDataset(default_corpus_tokens(tokenizer, num_tokens, seed), seq_length)


def build_text_dataset(
    tokenizer: Tokenizer, paths: str | os.PathLike | Iterable[str | os.PathLike], seq_length: int
) -> GPTDataset:
    """A GPTDataset over the documents of `paths` (see load_text_documents), EOD-separated."""
    documents = load_text_documents(paths)
    if not documents:
        raise ValueError(f"no non-empty documents in {paths}")
    return GPTDataset(build_token_stream(tokenizer, documents), seq_length)
