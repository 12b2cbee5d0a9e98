"""JSONL documents -> Megatron indexed datasets (`megatronapp preprocess-data`).

    megatronapp preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model tokenizer.json --append-eod --workers 4
    # -> data/corpus_text_document.bin + .idx ; train with --data-path data/corpus_text_document

As Megatron-LM's tools/preprocess_data.py: one output pair per JSON key, named
PREFIX_KEY_document; each line's text under that key is one document of one sequence (with
`--append-eod`, followed by the tokenizer's EOD); documents that tokenize to nothing are left
out; token ids are stored as uint16 below 65500 ids, else int32. Lines are tokenized by
`workers` processes in chunks and written in input order, so the output does not depend on the
worker count. Files appear complete or not at all (files.py); a bad line stops the run with
`FILE:LINE` and what is wrong, and no output is written.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from megatronapp.data.dataset import parse_jsonl_record
from megatronapp.data.indexed import IndexedDatasetWriter, compute_optimal_dtype
from megatronapp.data.tokenizer_types import build_tokenizer

LINES_PER_TASK = 256  # lines a worker tokenizes per task: large enough to amortise the pickling


@dataclass(frozen=True)
class PreprocessConfig:
    """What preprocess-data reads, how it tokenizes and where it writes."""

    input: str
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    tokenizer_type: str | None = None  # Megatron's name (tokenizer_types.py); None: by tokenizer_model
    tokenizer_model: str | None = None  # a Hugging Face tokenizer.json; None: bytes
    vocab_size: int | None = None  # NullTokenizer
    append_eod: bool = False
    workers: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not self.json_keys or any(not k for k in self.json_keys) or len(set(self.json_keys)) < len(self.json_keys):
            raise ValueError(f"--json-keys needs distinct non-empty keys, got {list(self.json_keys)}")
        if not Path(self.input).is_file():
            raise ValueError(f"--input {self.input}: file not found")

    def output_prefixes(self) -> dict[str, str]:
        """JSON key -> the prefix of its .bin/.idx pair (Megatron's PREFIX_KEY_document)."""
        return {key: f"{self.output_prefix}_{key}_document" for key in self.json_keys}


_worker_state: dict = {}


def _init_worker(config: PreprocessConfig) -> None:
    _worker_state["config"] = config
    _worker_state["tokenizer"] = build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_size)


def encode_lines(task: tuple[int, list[bytes]]) -> tuple[int, list[list[list[int]] | None]]:
    """(the chunk's bytes, token ids per JSON key of each of its lines (None for a blank line)) for
    a chunk of lines starting at line `first`."""
    first, lines = task
    config, tokenizer = _worker_state["config"], _worker_state["tokenizer"]
    encoded = []
    for lineno, raw in enumerate(lines, start=first):
        if not raw.strip():
            encoded.append(None)
            continue
        record = parse_jsonl_record(raw, f"{config.input}:{lineno}", config.json_keys)
        ids = [tokenizer.encode(record[key]) for key in config.json_keys]
        if config.append_eod:
            ids = [doc + [tokenizer.eod_id] if doc else doc for doc in ids]
        encoded.append(ids)
    return sum(len(line) for line in lines), encoded


def _read_tasks(path: str) -> Iterator[tuple[int, list[bytes]]]:
    """Chunks of LINES_PER_TASK lines with their first line number."""
    with open(path, "rb") as f:
        lineno = 1
        while chunk := list(islice(f, LINES_PER_TASK)):
            yield lineno, chunk
            lineno += len(chunk)


def _encoded_chunks(config: PreprocessConfig) -> Iterator[tuple[int, list]]:
    """encode_lines over the input, in order: in this process, or on `workers` processes."""
    tasks = _read_tasks(config.input)
    if config.workers == 1:
        _init_worker(config)
        yield from map(encode_lines, tasks)
        return
    # fork where there is one: nothing here has started threads yet, and a spawned worker would
    # import the command line (and with it torch) again, seconds per worker
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(config.workers, initializer=_init_worker, initargs=(config,)) as pool:
        yield from pool.imap(encode_lines, tasks)


def preprocess_data(config: PreprocessConfig, *, show_progress: bool = True) -> dict[str, int]:
    """Tokenize config.input into one .bin/.idx pair per JSON key; returns documents written per key.

    ValueError (one line: file, line, what) for a bad line; the outputs are then left untouched."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    tokenizer = build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_size)
    dtype = compute_optimal_dtype(tokenizer.vocab_size)
    writers: dict[str, IndexedDatasetWriter] = {}
    counts = dict.fromkeys(config.json_keys, 0)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    try:
        for key, prefix in config.output_prefixes().items():
            writers[key] = IndexedDatasetWriter(prefix, dtype)
        with Progress(*columns, disable=not show_progress, transient=True) as progress:
            bar = progress.add_task("tokenizing", total=os.path.getsize(config.input))
            for size, chunk in _encoded_chunks(config):
                _write_chunk(chunk, writers, counts)
                progress.advance(bar, size)
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    for writer in writers.values():
        writer.close()
    return counts


def _write_chunk(chunk: list, writers: dict[str, IndexedDatasetWriter], counts: dict[str, int]) -> None:
    for encoded in chunk:
        for (key, writer), ids in zip(writers.items(), encoded or ()):
            if ids:
                writer.add_document(ids)
                counts[key] += 1
