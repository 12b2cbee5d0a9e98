"""Megatron's indexed dataset files: `PREFIX.bin` (token ids) and `PREFIX.idx` (where they are).

The `.idx` layout (little-endian), as Megatron-Core's `IndexedDataset` writes and reads it:

    offset  size        field
    0       9           magic b"MMIDIDX\\x00\\x00"
    9       8  (u64)    version, 1
    17      1  (u8)     dtype code of the token ids (DTYPE_CODES)
    18      8  (u64)    S, the number of sequences
    26      8  (u64)    D, the number of document indices
    34      4*S (i32)   sequence lengths, in tokens
    ..      8*S (i64)   sequence pointers, byte offsets into PREFIX.bin
    ..      8*D (i64)   document indices: 0, then the sequence count after each document
    ..      S  (i8)     sequence modes (multimodal datasets only; ignored here)

`.bin` is the sequences' token ids back to back in that dtype. Both files are memory-mapped:
opening a dataset reads 34 bytes, samples touch only the pages they use.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from megatronapp.files import commit_temp, temp_path_beside

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

# Megatron's DType enum: the code stored in the .idx for each token dtype.
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def compute_optimal_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's writer picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDataset:
    """A memory-mapped `PREFIX.bin`/`PREFIX.idx` pair; sequence i is `get(i)`.

    Opening checks what can be checked without reading the token data: the magic, version and
    dtype code, that the index holds exactly what its header announces (plus optional modes),
    that pointers lie inside `.bin` on dtype boundaries and that `.bin` is as long as the last
    sequence's end. Any failure is a ValueError whose one line names the file.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx, bin_ = index_file(prefix), data_file(prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise ValueError(f"{path}: file not found (an indexed dataset needs PREFIX.bin and PREFIX.idx)")
        self.dtype, num_sequences, num_documents = _read_header(idx)
        self._index = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_arrays(
            idx, self._index, num_sequences, num_documents
        )
        self.tokens = _map_tokens(bin_, self.dtype)
        _check_sequences(bin_, self)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def token_offsets(self) -> np.ndarray:
        """Each sequence's first token as an index into `tokens` (pointers are in bytes)."""
        return self.sequence_pointers // self.dtype.itemsize

    def compute_token_range(self, max_tokens: int = 1 << 24) -> tuple[int, int]:
        """(min, max) token id: of the whole file when it holds at most `max_tokens` ids, else of
        64 windows spread evenly over it (a tokenizer mismatch shows everywhere)."""
        n = len(self.tokens)
        if n == 0:
            return 0, 0
        if n <= max_tokens:
            return int(self.tokens.min()), int(self.tokens.max())
        width = max_tokens // 64
        windows = [self.tokens[s : s + width] for s in np.linspace(0, n - width, 64).astype(np.int64)]
        return int(min(w.min() for w in windows)), int(max(w.max() for w in windows))

    def get(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of `sequence` (to its end when length is None), a view."""
        start = int(self.sequence_pointers[sequence]) // self.dtype.itemsize + offset
        stop = start - offset + int(self.sequence_lengths[sequence]) if length is None else start + length
        return self.tokens[start:stop]


def _read_header(idx: Path) -> tuple[np.dtype, int, int]:
    with open(idx, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx}: not a Megatron indexed-dataset index (expected magic {INDEX_MAGIC!r})")
    _, version, code, num_sequences, num_documents = _HEADER.unpack(raw)
    if version != INDEX_VERSION:
        raise ValueError(f"{idx}: index version {version} is not supported (only {INDEX_VERSION})")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
    return DTYPE_CODES[code], num_sequences, num_documents


def _read_arrays(idx: Path, raw: np.ndarray, num_sequences: int, num_documents: int):
    """Lengths (int32), pointers (int64) and document indices (int64) as views into the mapped index."""
    end = _HEADER.size + 12 * num_sequences + 8 * num_documents
    if len(raw) not in (end, end + num_sequences):  # + one mode byte per sequence when multimodal
        raise ValueError(
            f"{idx}: {len(raw)} bytes, but its header announces {num_sequences} sequences and "
            f"{num_documents} document indices ({end} bytes); the file is truncated or damaged"
        )
    start = _HEADER.size
    lengths = raw[start : start + 4 * num_sequences].view(np.int32)
    start += 4 * num_sequences
    pointers = raw[start : start + 8 * num_sequences].view(np.int64)
    start += 8 * num_sequences
    documents = raw[start : start + 8 * num_documents].view(np.int64)
    if num_documents < 1 or documents[0] != 0 or documents[-1] != num_sequences or np.any(np.diff(documents) < 0):
        raise ValueError(f"{idx}: document indices must rise from 0 to the sequence count {num_sequences}")
    if np.any(lengths < 0):
        raise ValueError(f"{idx}: negative sequence length")
    return lengths, pointers, documents


def _map_tokens(bin_: Path, dtype: np.dtype) -> np.ndarray:
    size = bin_.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{bin_}: {size} bytes is not a whole number of {dtype.name} tokens; the file is truncated")
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(bin_, dtype=dtype, mode="r")


def _check_sequences(bin_: Path, dataset: IndexedDataset) -> None:
    if len(dataset) == 0:
        return
    pointers, lengths, itemsize = dataset.sequence_pointers, dataset.sequence_lengths, dataset.dtype.itemsize
    if np.any(pointers % itemsize) or np.any(pointers < 0):
        raise ValueError(f"{index_file(dataset.prefix)}: sequence pointers are not on {dataset.dtype.name} boundaries")
    needed = int(np.max(pointers + lengths.astype(np.int64) * itemsize))
    size = len(dataset.tokens) * itemsize
    if size < needed:
        raise ValueError(f"{bin_}: {size} bytes, but its index points up to byte {needed}; the file is truncated")


class IndexedDatasetWriter:
    """Writes a `PREFIX.bin`/`PREFIX.idx` pair Megatron reads, atomically.

    Both files are written under temporary names beside their targets; `close()` writes the
    index and renames `.bin`, then `.idx`, into place, so a reader never sees a partial pair
    and an interrupted write (`discard()`, or an exception inside a `with` block) leaves none.
    Every `add_document` call is one document of one sequence.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        if dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"token dtype {dtype} has no Megatron dtype code")
        self.prefix, self.dtype = os.fspath(prefix), dtype
        self._bin_tmp = temp_path_beside(data_file(prefix))
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []

    def add_document(self, token_ids) -> None:
        ids = np.asarray(token_ids)
        if ids.size and self.dtype.kind in "iu" and (ids.min() < 0 or ids.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {ids.min()}..{ids.max()} do not fit {self.dtype.name}")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(ids.size))

    def close(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        idx_tmp = temp_path_beside(index_file(self.prefix))
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes() + pointers.tobytes() + documents.tobytes())
        commit_temp(self._bin_tmp, data_file(self.prefix))
        commit_temp(idx_tmp, index_file(self.prefix))

    def discard(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()
