"""A checkpoint folder's files: their sizes and checksums, recorded at save and verified on load.

`meta.json` lists every other file of its iteration folder under "files" with its byte size and
xxh3-64 checksum (xxhash, several GB/s: reading a 459 MB shard back and hashing it took 13% of
its torch.save on a shared 2-core machine; zlib.crc32 hashes about 3x slower). Every launching command verifies all of them before any rank starts, so a
truncated or corrupted file (also one the resuming layout would not read) is reported in one
line naming it instead of as a deserialisation traceback from whichever rank reads it:

    checkpoint ckpt/iter_0000020: model_tp1_pp0.pt is damaged (expected 81234 bytes, found 4096)

Checkpoints written before checksums were recorded have no "files": their files are not checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

META_FILE = "meta.json"
_READ_CHUNK = 1 << 22
_META_KEYS = ("iteration", "layout", "model")


class CheckpointDamagedError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or unreadable; the message is one line."""

    def __init__(self, folder: str | os.PathLike, name: str, what: str):
        super().__init__(f"checkpoint {folder}: {name} is {what}")


def compute_file_digest(path: str | os.PathLike) -> dict:
    """{"bytes": size, "xxh3": 16 hex digits} of the file at `path`."""
    digest, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3": digest.hexdigest()}


def read_checkpoint_meta(folder: str | os.PathLike) -> dict:
    """`folder`/meta.json as a dict; CheckpointDamagedError when it is missing, unreadable or not
    a checkpoint's metadata (a truncated write, an edited file)."""
    path = Path(folder) / META_FILE
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointDamagedError(folder, META_FILE, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointDamagedError(folder, META_FILE, f"damaged (not valid JSON: {_one_line(exc)})") from None
    missing = [key for key in _META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise CheckpointDamagedError(folder, META_FILE, f"damaged (no {', '.join(missing)})")
    return meta


def verify_checkpoint_files(folder: str | os.PathLike, meta: dict | None = None) -> dict:
    """Check every file `meta.json` lists (all shards and rank files, whichever layout reads
    them) against its recorded size and checksum; returns the meta. Sizes are compared first,
    so a truncated file is named without reading the others."""
    folder = Path(folder)
    meta = read_checkpoint_meta(folder) if meta is None else meta
    recorded = meta.get("files", {})
    for name, expected in recorded.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointDamagedError(folder, name, "missing") from None
        if size != expected["bytes"]:
            raise CheckpointDamagedError(folder, name, f"damaged (expected {expected['bytes']} bytes, found {size})")
    for name, expected in recorded.items():
        found = compute_file_digest(folder / name)["xxh3"]
        if found != expected["xxh3"]:
            raise CheckpointDamagedError(folder, name, f"damaged (checksum xxh3 {found}, expected {expected['xxh3']})")
    return meta


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
