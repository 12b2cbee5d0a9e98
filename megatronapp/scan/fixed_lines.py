"""Text lines from numpy columns at memory speed: every row of a block has the same width.

JSON allows whitespace between tokens, so a number or string literal padded with spaces to the
widest value of its column is still the same JSON value. `LineBlock` lays out one line
template (constant text and column fields) as an (n, width) byte matrix and fills each field
for all rows at once; numbers are written three digits at a time through a lookup table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SPACE = ord(" ")
# Rows 0..999: "000".."999"; 1000..1999: the same with leading zeros as spaces ("  7");
# 2000: three spaces (a chunk above the number's top digit).
_TRIPLES = np.array(
    [list(f"{v:03d}".encode()) for v in range(1000)]
    + [list(f"{v:3d}".encode()) for v in range(1000)]
    + [list(b"   ")],
    dtype=np.uint8,
)


def _digit_count(values: np.ndarray) -> int:
    top = int(values.max(initial=0))
    return max(1, len(str(top)))


def format_uints(values: np.ndarray, width: int | None = None) -> np.ndarray:
    """Non-negative ints -> (n, width) right-aligned decimal bytes, space-padded."""
    values = values.astype(np.int64, copy=False)
    width = width or _digit_count(values)
    chunks = -(-width // 3)
    out = np.empty((len(values), chunks * 3), np.uint8)
    rest = values
    for k in range(chunks):
        chunk = rest % 1000
        rest = rest // 1000
        index = chunk + np.where(rest == 0, 1000, 0)  # top chunk: leading zeros become spaces
        if k:
            index = np.where(values < 1000**k, 2000, index)  # wholly above the top digit
        col = (chunks - 1 - k) * 3
        out[:, col:col + 3] = _TRIPLES[index]
    return out[:, chunks * 3 - width:]


def format_micros(ns: np.ndarray) -> np.ndarray:
    """Non-negative ns -> microseconds with exactly three decimals ("12.345"), right-aligned."""
    whole = format_uints(ns // 1000)
    frac = _TRIPLES[ns % 1000]
    dot = np.full((len(ns), 1), ord("."), np.uint8)
    return np.concatenate([whole, dot, frac], axis=1)


class TextTable:
    """Strings (e.g. a vocabulary's JSON literals) as a space-padded byte matrix, taken by id."""

    def __init__(self, texts: Sequence[str]) -> None:
        encoded = [t.encode() for t in texts] or [b""]
        self.lengths = np.array([len(t) for t in encoded], np.int64)
        self.matrix = np.full((len(encoded), max(1, int(self.lengths.max()))), _SPACE, np.uint8)
        for k, t in enumerate(encoded):
            self.matrix[k, :len(t)] = np.frombuffer(t, np.uint8)

    def take(self, ids: np.ndarray) -> np.ndarray:
        width = max(1, int(self.lengths[ids].max(initial=1))) if len(ids) else 1
        return self.matrix[ids, :width]


class LineBlock:
    """One line layout for n rows: add parts left to right, then `to_bytes()`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._parts: list[np.ndarray] = []

    def text(self, constant: str) -> "LineBlock":
        self._parts.append(np.frombuffer(constant.encode(), np.uint8)[None, :])
        return self

    def field(self, matrix: np.ndarray) -> "LineBlock":
        self._parts.append(matrix)
        return self

    def uint(self, values: np.ndarray) -> "LineBlock":
        return self.field(format_uints(values))

    def micros(self, ns: np.ndarray) -> "LineBlock":
        return self.field(format_micros(ns))

    def to_bytes(self) -> memoryview:
        """The n lines, concatenated (a view of one fresh buffer: write it, no copy)."""
        if self.n == 0:
            return memoryview(b"")
        widths = [p.shape[1] for p in self._parts]
        out = np.empty((self.n, sum(widths)), np.uint8)
        col = 0
        for part, width in zip(self._parts, widths):
            out[:, col:col + width] = part
            col += width
        return memoryview(out).cast("B")
