"""Text lines from numpy columns at memory speed: every row of a block has the same width.

JSON allows whitespace between tokens, so a number or string literal padded with spaces to the
widest value of its column is still the same JSON value. `LineBlock` lays out one line
template (constant text and column fields) as an (n, width) byte matrix: the constant text is
broadcast into every row at once, then each field is stored column by column. Integers are
written four digits at a time through a lookup table (a microsecond value's decimals, three).

Why stores are whole words: numpy copies a narrow 2-D byte slice (n, 3) of a wide matrix one
byte loop per row (~5 ns a row), but an unaligned 4-byte word (or a `V<w>` record) per row in
one strided store (~1 ns). A chunk of fewer than four chars (three decimals, or a number's
top chunk cut to the field) is therefore stored as a 4-byte word whose extra bytes are what
belongs after it: the template's constant there, or anything where a later (left-to-right)
store will overwrite it. The buffer has a few spare bytes after the last row so the last
row's words stay inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SPACE = ord(" ")
_SPARE = 4  # bytes after the last row: room for a word store's overhang


class _DigitTable:
    """Base-10**chars chunks of numbers as little-endian uint32 words, chars in the low bytes:
    rows 0..base-1 hold the chunk with leading zeros ("042"), base..2*base-1 with leading
    spaces ("  7": a number's top chunk), 2*base all spaces (a chunk above the top digit)."""

    def __init__(self, chars: int) -> None:
        self.chars, self.base = chars, 10**chars
        texts = (
            [f"{v:0{chars}d}" for v in range(self.base)] + [f"{v:{chars}d}" for v in range(self.base)] + [" " * chars]
        )
        self.words = np.array([int.from_bytes(t.encode(), "little") for t in texts], np.uint32)
        self.matrix = self.words.view(np.uint8).reshape(-1, 4)[:, :chars]  # (rows, chars)
        self._shifted: dict[tuple[int, int], np.ndarray] = {}

    def table(self, kept: int, after: int) -> np.ndarray:
        """Words holding a chunk's last `kept` chars, then the little-endian bytes of `after`."""
        if kept == self.chars and after == 0:
            return self.words
        if (kept, after) not in self._shifted:  # a few per template: the bytes that follow a field
            self._shifted[kept, after] = (self.words >> np.uint32(8 * (self.chars - kept))) | np.uint32(after)
        return self._shifted[kept, after]


_TRIPLES = _DigitTable(3)  # a microsecond value's three decimals: one word with a spare byte
_QUADS = _DigitTable(4)  # integers: four digits per word, no spare byte (fewer stores)


def _digit_count(values: np.ndarray) -> int:
    top = int(values.max(initial=0))
    return max(1, len(str(top)))


def _chunk_indices(values: np.ndarray, width: int) -> list[np.ndarray]:
    """_QUADS rows of the base-10000 chunks of non-negative ints written right-aligned and
    space-padded in `width` chars, lowest chunk first."""
    if width <= 4:  # one chunk, the top one (values < 10000): no arithmetic
        return [np.add(values, _QUADS.base, dtype=np.int64)]  # int64: an int16 column + 10000 may not fit
    # uint32 arithmetic where the values fit (width <= 9 digits): several times faster than int64.
    dtype = np.uint32 if width <= 9 else np.int64
    rest = values.astype(dtype, copy=False)
    out, blank = [], None  # blank: value < 10000**k (chunk k is all spaces)
    base = dtype(_QUADS.base)
    for _ in range(-(-width // 4)):
        high = rest // base
        index = rest - high * base
        top = high == 0  # leading zeros of this chunk become spaces
        index += (top if blank is None else top.view(np.uint8) + blank.view(np.uint8)).astype(dtype) * base
        out.append(index)
        blank, rest = top, high
    return out


def format_uints(values: np.ndarray, width: int | None = None) -> np.ndarray:
    """Non-negative ints -> (n, width) right-aligned decimal bytes, space-padded."""
    block = LineBlock(len(values))
    block._parts.append((width or _digit_count(values), ("uint", values)))
    return np.frombuffer(block.to_bytes(), np.uint8).reshape(len(values), -1)


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
            self.matrix[k, : len(t)] = np.frombuffer(t, np.uint8)
        self._records: dict[int, np.ndarray] = {}  # width -> rows cut to it, one V<width> record each

    def take(self, ids: np.ndarray) -> np.ndarray:
        """(n, width) bytes, C-contiguous: the strings of `ids`, padded to the longest of them."""
        width = max(1, int(self.lengths[ids].max(initial=1))) if len(ids) else 1
        if width not in self._records:
            self._records[width] = np.ascontiguousarray(self.matrix[:, :width]).view(f"V{width}").ravel()
        return np.take(self._records[width], ids).view(np.uint8).reshape(len(ids), width)


class OutputArena:
    """Memory that blocks of lines are formatted into, reused from one `reset()` to the next.

    Why: a window's lines fill tens of megabytes; fresh buffers each window are fresh pages,
    one page fault per 4 KB (on a VM a noticeable share of the merge). Views handed out stay
    valid until the next `reset()`."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self._used = 0  # bytes handed out of the last chunk
        self._round = 0  # bytes handed out since reset()

    def reset(self) -> None:
        """Forget what was handed out; keep memory for the next round: the one chunk, or, if
        this round took several, one of twice what it used (so growth stops after a few rounds;
        pages never written are never resident)."""
        if len(self._chunks) > 1:
            self._chunks = [np.empty(2 * self._round, np.uint8)]
        self._used = self._round = 0

    def take(self, nbytes: int) -> np.ndarray:
        if not self._chunks or self._used + nbytes > len(self._chunks[-1]):
            grown = 2 * len(self._chunks[-1]) if self._chunks else 0  # doubling: few chunks per round
            self._chunks.append(np.empty(max(nbytes, grown), np.uint8))
            self._used = 0
        out = self._chunks[-1][self._used : self._used + nbytes]
        self._used += nbytes
        self._round += nbytes
        return out


class LineBlock:
    """One line layout for n rows: add parts left to right, then `to_bytes()` (into `arena`'s
    memory if given, else a fresh buffer)."""

    def __init__(self, n: int, arena: OutputArena | None = None) -> None:
        self.n, self.arena = n, arena
        self._parts: list[tuple[int, object]] = []  # (width, constant bytes | matrix | ("uint"/"frac", values))

    def text(self, constant: str) -> LineBlock:
        encoded = constant.encode()
        self._parts.append((len(encoded), encoded))
        return self

    def field(self, matrix: np.ndarray) -> LineBlock:
        self._parts.append((matrix.shape[1], matrix))
        return self

    def uint(self, values: np.ndarray) -> LineBlock:
        self._parts.append((_digit_count(values), ("uint", values)))
        return self

    def micros(self, ns: np.ndarray) -> LineBlock:
        ns = ns.astype(np.int64, copy=False)
        whole = ns // 1000
        self.uint(whole).text(".")
        self._parts.append((3, ("frac", ns - whole * 1000)))
        return self

    def to_bytes(self) -> memoryview:
        """The n lines, concatenated (a view of one fresh buffer: write it, no copy)."""
        if self.n == 0:
            return memoryview(b"")
        template, constant = bytearray(), []
        for width, part in self._parts:
            template += part if isinstance(part, bytes) else b" " * width
            constant += [isinstance(part, bytes)] * width
        line = len(template)
        if line == 0:
            return memoryview(b"")
        size = self.n * line + _SPARE
        flat = self.arena.take(size) if self.arena is not None else np.empty(size, np.uint8)
        _fill_rows(flat, np.frombuffer(bytes(template), np.uint8), self.n)
        # Overhang past a row's end lands on the next row's start, stored already unless constant.
        wrap_ok = all(constant[: min(line, _SPARE)])
        cyclic = bytes(template) * (2 + _SPARE // line)  # template bytes after a position, wrapping into the next row
        col = 0
        for width, part in self._parts:
            if isinstance(part, tuple):
                if part[0] == "uint":
                    _store_chunks(flat, line, col, width, _chunk_indices(part[1], width), _QUADS, cyclic, wrap_ok)
                else:  # "frac": three decimals, leading zeros kept
                    _store_chunks(flat, line, col, width, [part[1]], _TRIPLES, cyclic, wrap_ok)
            elif not isinstance(part, bytes):
                _store_records(flat, line, col, np.ascontiguousarray(part))
            col += width
        return memoryview(flat[: self.n * line]).cast("B")


def _fill_rows(flat: np.ndarray, row: np.ndarray, n: int) -> None:
    """flat[:n * len(row)] = row repeated n times, by doubling copies (memcpy of ever larger
    blocks: ~2x faster than a broadcast, which copies row by row)."""
    total, done = n * len(row), len(row)
    flat[:done] = row
    while done < total:
        step = min(done, total - done)
        flat[done : done + step] = flat[:step]
        done += step


def _store_records(flat: np.ndarray, line: int, col: int, matrix: np.ndarray) -> None:
    """Store an (n, w) byte matrix at column `col` of every row, one V<w> record per row."""
    width = matrix.shape[1]
    target = np.ndarray((len(matrix),), f"V{width}", buffer=flat, offset=col, strides=(line,))
    target[:] = matrix.view(f"V{width}").ravel()


def _store_chunks(
    flat: np.ndarray,
    line: int,
    col: int,
    width: int,
    chunks: list[np.ndarray],
    digits: _DigitTable,
    cyclic: bytes,
    wrap_ok: bool,
) -> None:
    """Store a `width`-char number, given as `digits` rows lowest chunk first, at column `col`
    of every row: one 4-byte word per chunk, left to right. A word holds the chunk's chars
    (the top one may be cut to its last chars) and then the template's bytes that follow,
    so the overhang leaves constants intact and is overwritten where a field follows.
    Unless `wrap_ok`, a chunk whose overhang would reach into the next row is copied exactly."""
    n = (len(flat) - _SPARE) // line
    end, size = col + width, digits.chars
    for k in reversed(range(len(chunks))):
        hi = end - size * k
        lo = max(col, hi - size)
        kept = hi - lo  # chars of this chunk inside the field
        if not wrap_ok and lo + 4 > line:
            rows = flat[: n * line].reshape(n, line)
            rows[:, lo:hi] = digits.matrix[chunks[k]][:, size - kept :]
            continue
        after = int.from_bytes(cyclic[hi % line : hi % line + 4 - kept], "little") << (8 * kept)
        target = np.ndarray((n,), "<u4", buffer=flat, offset=lo, strides=(line,))
        target[:] = np.take(digits.table(kept, after), chunks[k])
