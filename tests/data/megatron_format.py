"""An independent writer and reader of Megatron's indexed-dataset files, written from the format's
specification with struct and numpy (no project code), and a reference of GPTDataset's sample
construction written from its algorithm as a plain loop.

.idx: magic b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64 sequence count S, u64 document
count D, S int32 lengths, S int64 byte pointers into .bin, D int64 document indices [, S int8 modes].
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


def write_pair(prefix, documents: list[list[int]], code: int = 8, modes: bool = False) -> None:
    """PREFIX.bin/.idx holding `documents`, one sequence each, tokens in the dtype of `code`."""
    dtype = np.dtype(CODES[code])
    lengths, pointers, offset = [], [], 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            data = np.asarray(doc, dtype=dtype).tobytes()
            f.write(data)
            lengths.append(len(doc))
            pointers.append(offset)
            offset += len(data)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(documents)))
        f.write(struct.pack("<Q", len(documents) + 1))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(documents) + 1}q", *range(len(documents) + 1)))
        if modes:
            f.write(bytes(len(documents)))


def read_pair(prefix) -> tuple[list[np.ndarray], list[int]]:
    """(every sequence's tokens, the document indices) of PREFIX.bin/.idx."""
    with open(f"{prefix}.idx", "rb") as f:
        assert f.read(9) == MAGIC
        (version,) = struct.unpack("<Q", f.read(8))
        assert version == 1
        (code,) = struct.unpack("<B", f.read(1))
        num_sequences, num_documents = struct.unpack("<QQ", f.read(16))
        lengths = struct.unpack(f"<{num_sequences}i", f.read(4 * num_sequences))
        pointers = struct.unpack(f"<{num_sequences}q", f.read(8 * num_sequences))
        documents = list(struct.unpack(f"<{num_documents}q", f.read(8 * num_documents)))
        assert f.read() == b""
    data = open(f"{prefix}.bin", "rb").read()
    dtype = np.dtype(CODES[code])
    sequences = [np.frombuffer(data, dtype, count=n, offset=p) for n, p in zip(lengths, pointers)]
    return sequences, documents


def reference_samples(
    lengths: list[int], sequence_ids: np.ndarray, seq_length: int, seed: int, num_samples: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTDataset's (document index, sample index, shuffle index), by the algorithm's loops."""
    tokens_per_epoch = sum(lengths[i] for i in sequence_ids)
    epochs, tokens = 0, 0
    while True:
        epochs += 1
        tokens += tokens_per_epoch
        if num_samples is None or tokens >= num_samples * seq_length + 1:
            break
    separate, before_final = False, None
    if epochs > 1:
        before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_final < int(0.8 * per_epoch)
    rng = np.random.RandomState(seed)

    def shuffled_documents(n_epochs):
        index = np.array([d for _ in range(n_epochs) for d in sequence_ids], dtype=np.int32)
        rng.shuffle(index)
        return index

    if separate:
        first = shuffled_documents(epochs - 1)
        document_index = np.concatenate((first, shuffled_documents(1)))
    else:
        document_index = shuffled_documents(epochs)
    sample_index = _sample_index_loop(lengths, document_index, seq_length, epochs * tokens_per_epoch)
    total = len(sample_index) - 1
    head = np.arange(before_final if separate else total, dtype=np.uint32)
    rng.shuffle(head)
    if separate:
        tail = np.arange(before_final, total, dtype=np.uint32)
        rng.shuffle(tail)
        head = np.concatenate((head, tail))
    return document_index, sample_index, head


def _sample_index_loop(lengths, document_index, seq_length, tokens) -> np.ndarray:
    num_samples = (tokens - 1) // seq_length
    rows, doc, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = lengths[document_index[doc]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc += 1
                offset = 0
        rows.append((doc, offset))
    return np.array(rows, dtype=np.int64)


def reference_sample(sequences, document_index, sample_index, k: int) -> np.ndarray:
    """Sample k of the stream: from (document, offset) row k to row k + 1's token, inclusive."""
    (d0, o0), (d1, o1) = sample_index[k], sample_index[k + 1]
    if d0 == d1:
        return np.asarray(sequences[document_index[d0]][o0 : o1 + 1], dtype=np.int64)
    parts = [sequences[document_index[d0]][o0:]]
    parts += [sequences[document_index[d]] for d in range(d0 + 1, d1)]
    parts.append(sequences[document_index[d1]][: o1 + 1])
    return np.concatenate(parts).astype(np.int64)


def reference_blending(weights, size: int) -> tuple[list[int], list[int]]:
    """BlendedDataset's (dataset index, dataset sample index): each sample from the dataset whose
    weight * max(i, 1) - drawn is largest, the first of equals."""
    drawn = [0] * len(weights)
    datasets, samples = [], []
    for i in range(size):
        errors = [w * max(i, 1.0) - n for w, n in zip(weights, drawn)]
        d = max(range(len(weights)), key=lambda j: (errors[j], -j))
        datasets.append(d)
        samples.append(drawn[d])
        drawn[d] += 1
    return datasets, samples
