"""Tokenizers behind one small protocol: a byte-level default and a Hugging Face wrapper.

The trainer only needs `vocab_size` (the model pads it, see ModelConfig.padded_vocab_size),
`eod_id` (the separator between documents in the token stream) and encode/decode for
prompts and samples. Both implementations keep `eod_id < vocab_size`.

build_token_stream lives here, next to the protocol it consumes, so that both the
synthetic corpus and the file datasets build their streams the same way.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# Tried in order when a tokenizer.json does not name its end-of-document token.
EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and an end-of-document id 256 (vocab_size 257).

    Needs no file, so every machine gets the same ids for the same text.
    """

    EOD_ID = 256

    @property
    def vocab_size(self) -> int:
        return self.EOD_ID + 1

    @property
    def eod_id(self) -> int:
        return self.EOD_ID

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text`; never emits EOD."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text. EOD is dropped; invalid UTF-8 and ids outside 0..255 (a model
        can sample padded-vocab ids) become U+FFFD instead of raising."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if i != self.EOD_ID:
                out.append("\ufffd")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded through the `tokenizers` library.

    The end-of-document id is, in order: `eod_id` when given; the id of the first token of
    EOD_TOKEN_CANDIDATES the vocabulary has; otherwise one new id just past the vocabulary
    (vocab_size grows by one, as with ByteTokenizer).
    """

    def __init__(self, path: str | os.PathLike, *, eod_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # optional dependency at import time

        file = _resolve_tokenizer_file(Path(path))
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON
            raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from None
        self.path = file
        base = self._tok.get_vocab_size(with_added_tokens=True)
        if eod_id is None:
            eod_id = self._find_eod_token_id()
        if eod_id is None:
            eod_id = base
        if not 0 <= eod_id <= base:
            raise ValueError(f"eod_id {eod_id} is outside the vocabulary of {file} (0..{base})")
        self._eod_id = eod_id
        self._vocab_size = max(base, eod_id + 1)
        self._base_vocab_size = base

    def _find_eod_token_id(self) -> int | None:
        for token in EOD_TOKEN_CANDIDATES:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without added special tokens (no BOS/EOS): documents get
        exactly one EOD, appended by the token-stream builder."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens, EOD and ids past the vocabulary are dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self._base_vocab_size and int(i) != self._eod_id]
        return self._tok.decode(keep, skip_special_tokens=True)


def _resolve_tokenizer_file(path: Path) -> Path:
    """Accept either the tokenizer.json itself or a folder holding one."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {file}")
    return file


@functools.lru_cache(maxsize=8)  # one per file and process: the CLI's checks and the rank body share it
def load_tokenizer(path: str | os.PathLike | None, *, eod_id: int | None = None) -> Tokenizer:
    """ByteTokenizer when `path` is None, else an HFTokenizer for that tokenizer.json (or
    folder holding one). Raises FileNotFoundError / ValueError with the path in the message."""
    if path is None:
        if eod_id is not None:
            raise ValueError("eod_id only applies to a tokenizer file; the byte tokenizer's EOD is 256")
        return ByteTokenizer()
    return HFTokenizer(path, eod_id=eod_id)


def compute_token_dtype(vocab_size: int) -> np.dtype:
    """Smallest numpy dtype that holds every id of a `vocab_size` vocabulary (halves memory
    for the common < 65536 case)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def build_token_stream(tokenizer: Tokenizer, documents: Iterable[str], *, max_tokens: int | None = None) -> np.ndarray:
    """Encode `documents` in order into one 1-D id array, each document followed by one EOD.

    Documents that encode to no tokens are skipped (no double EODs). With `max_tokens`, stops
    reading `documents` once that many ids exist and returns exactly the first `max_tokens`
    (so `documents` may be an endless generator). dtype: compute_token_dtype(vocab_size).
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids: list[int] = []
    eod = tokenizer.eod_id
    for doc in documents:
        if max_tokens is not None and len(ids) >= max_tokens:
            break
        doc_ids = tokenizer.encode(doc)
        if doc_ids:
            ids.extend(doc_ids)
            ids.append(eod)
    if max_tokens is not None:
        del ids[max_tokens:]
    return np.asarray(ids, dtype=compute_token_dtype(tokenizer.vocab_size))
