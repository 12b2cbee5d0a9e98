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
# The same rows padded to 4 bytes, one uint32 each: a 1-D take is ~4x faster than a 2-D gather.
_TRIPLES32 = np.concatenate([_TRIPLES, np.zeros((len(_TRIPLES), 1), np.uint8)], axis=1).view(np.uint32).ravel()


def _triples(index: np.ndarray) -> np.ndarray:
    """(n, 3) bytes of _TRIPLES rows `index`."""
    return np.take(_TRIPLES32, index).view(np.uint8).reshape(len(index), 4)[:, :3]  # (n, 3)


def _digit_count(values: np.ndarray) -> int:
    top = int(values.max(initial=0))
    return max(1, len(str(top)))


def _write_uints(out: np.ndarray, values: np.ndarray) -> None:
    """Write non-negative ints right-aligned and space-padded into `out` (n, width), in place."""
    values = values.astype(np.int64, copy=False)
    width = out.shape[1]
    rest = values
    for k in range(-(-width // 3)):
        rest, index = np.divmod(rest, 1000)
        index += (rest == 0) * 1000  # top chunk: leading zeros become spaces
        if k:
            index[values < 1000**k] = 2000  # wholly above the top digit
        hi = width - 3 * k
        lo = max(0, hi - 3)
        out[:, lo:hi] = _triples(index)[:, 3 - (hi - lo):]


def format_uints(values: np.ndarray, width: int | None = None) -> np.ndarray:
    """Non-negative ints -> (n, width) right-aligned decimal bytes, space-padded."""
    out = np.empty((len(values), width or _digit_count(values)), np.uint8)
    _write_uints(out, values)
    return out


def format_micros(ns: np.ndarray) -> np.ndarray:
    """Non-negative ns -> microseconds with exactly three decimals ("12.345"), right-aligned."""
    block = LineBlock(len(ns)).micros(ns)
    return np.frombuffer(block.to_bytes(), np.uint8).reshape(len(ns), -1)


class TextTable:
    """Strings (e.g. a vocabulary's JSON literals) as a space-padded byte matrix, taken by id."""

    def __init__(self, texts: Sequence[str]) -> None:
        encoded = [t.encode() for t in texts] or [b""]
        self.lengths = np.array([len(t) for t in encoded], np.int64)
        self.matrix = np.full((len(encoded), max(1, int(self.lengths.max()))), _SPACE, np.uint8)
        for k, t in enumerate(encoded):
            self.matrix[k, :len(t)] = np.frombuffer(t, np.uint8)
        self._rows = self.matrix.view(f"V{self.matrix.shape[1]}").ravel()

    def take(self, ids: np.ndarray) -> np.ndarray:
        width = max(1, int(self.lengths[ids].max(initial=1))) if len(ids) else 1
        rows = np.take(self._rows, ids)  # 1-D take of whole rows: far faster than a 2-D gather
        return rows.view(np.uint8).reshape(len(ids), self.matrix.shape[1])[:, :width]


class LineBlock:
    """One line layout for n rows: add parts left to right, then `to_bytes()`. Numbers are
    written straight into the output matrix (no per-field temporary)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._parts: list[tuple[int, object]] = []  # (width, constant row | matrix | ("uint", values))

    def text(self, constant: str) -> "LineBlock":
        row = np.frombuffer(constant.encode(), np.uint8)
        self._parts.append((len(row), row))
        return self

    def field(self, matrix: np.ndarray) -> "LineBlock":
        self._parts.append((matrix.shape[1], matrix))
        return self

    def uint(self, values: np.ndarray) -> "LineBlock":
        self._parts.append((_digit_count(values), ("uint", values)))
        return self

    def micros(self, ns: np.ndarray) -> "LineBlock":
        self.uint(ns // 1000).text(".")
        self._parts.append((3, ("frac", ns % 1000)))
        return self

    def to_bytes(self) -> memoryview:
        """The n lines, concatenated (a view of one fresh buffer: write it, no copy)."""
        if self.n == 0:
            return memoryview(b"")
        out = np.empty((self.n, sum(w for w, _ in self._parts)), np.uint8)
        col = 0
        for width, part in self._parts:
            target = out[:, col:col + width]
            if isinstance(part, tuple) and part[0] == "uint":
                _write_uints(target, part[1])
            elif isinstance(part, tuple):
                target[:] = _triples(part[1])
            else:
                target[:] = part
            col += width
        return memoryview(out).cast("B")
