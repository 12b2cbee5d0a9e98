"""Read rank files record batch by record batch, for analyses whose memory must not grow with
the trace (the streaming merge).

`iter_rank_batches` yields one rank's record batches in file order; `survey_rank` makes one
pass over a file and keeps only what is small (calibration rows, the comm rows of the first
iterations for clock alignment, per-iteration first starts); `WindowReader` hands out the rows
of consecutive iteration windows as numpy columns, strings as ids into one shared `Vocabulary`.

Rows arrive in the order the tracer flushed them: whole traced windows, oldest first (see
tracer.py). A row of an earlier iteration may still come late (an async op finishing after a
flush); it is handed out with the window being read.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.scan.record.format import (
    COLUMN_DEFAULTS,
    END_OF_STREAM,
    EVENT_COLUMNS,
    EVENT_SCHEMA,
    RankTrace,
    TraceFormatError,
    build_event_batch_from_columns,
    iteration_mask,
    read_meta,
    with_signal_columns,
)
from megatronapp.spans import CAT_CALIB, CAT_COMM

# One core: decompressing a batch's buffers on a thread pool costs more than it saves.
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)
STRING_COLUMNS = tuple(f.name for f in EVENT_SCHEMA if pa.types.is_dictionary(f.type))
INT_COLUMNS = tuple(f.name for f in EVENT_SCHEMA if not pa.types.is_dictionary(f.type))


class Vocabulary:
    """Every distinct string of the dictionary columns, numbered in order of first sight."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self._ids: dict[str, int] = {}

    def id_of(self, text: str) -> int:
        if text not in self._ids:
            self._ids[text] = len(self.strings)
            self.strings.append(text)
        return self._ids[text]

    def encode(self, column: pa.Array) -> np.ndarray:
        """Dictionary (or plain string) column -> int32 ids."""
        if not pa.types.is_dictionary(column.type):
            column = column.dictionary_encode()
        return self.ids_of(column.dictionary)[column.indices.to_numpy(zero_copy_only=False)]

    def ids_of(self, dictionary: pa.Array) -> np.ndarray:
        """Vocabulary id of each string of `dictionary` (at least one entry, so it can be indexed)."""
        return np.array([self.id_of(v) for v in dictionary.to_pylist()] or [0], dtype=np.int32)


def iter_rank_batches(
    path: str | os.PathLike, warn: bool = True, columns: Sequence[str] | None = None
) -> Iterator[pa.RecordBatch | dict | str]:
    """The record batches of one rank file, in order. The first item is the file's meta dict;
    a stream that stops early ends with the item "partial". With `columns`, batches hold only
    those (the others are never decompressed).

    Raises TraceFormatError naming the file if it is not a MegaScan stream; a truncated stream
    warns (naming the file, if `warn`) and ends after its last complete batch."""
    source = str(path)
    try:
        handle = open(source, "rb")
    except OSError as exc:
        raise TraceFormatError(f"{source}: cannot read ({exc.strerror})") from None
    with handle:
        try:
            reader = pa.ipc.open_stream(handle, options=_READ_OPTIONS)
        except (pa.ArrowInvalid, OSError) as exc:
            raise TraceFormatError(f"{source}: not a MegaScan trace (no Arrow IPC stream header: {exc})") from None
        yield read_meta(reader.schema, source)
        if columns is not None:  # reopen, reading only `columns` (indices into this file's schema)
            fields = sorted(i for c in columns if (i := reader.schema.get_field_index(c)) >= 0)
            handle.seek(0)
            options = pa.ipc.IpcReadOptions(use_threads=False, included_fields=fields)
            reader = pa.ipc.open_stream(handle, options=options)
        count, error = 0, None
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:
                error = exc
                break
            count += 1
            yield batch if columns is not None else with_signal_columns(batch)
        handle.seek(-len(END_OF_STREAM), os.SEEK_END)
        if error is not None or handle.read() != END_OF_STREAM:
            if warn:
                why = f"truncated stream ({error})" if error else "no end-of-stream marker"
                warnings.warn(f"{source}: {why}; using the {count} complete batches", stacklevel=2)
            yield "partial"


@dataclass
class RankSurvey:
    """What one pass over a rank file keeps: bounded by the number of traced iterations, not events."""

    trace: RankTrace  # meta + calib rows + keyed comm rows of the first iterations (for align_traces)
    events: int = 0  # non-calib rows
    # Earliest raw start per traced iteration (16 bytes per iteration, sorted by iteration).
    iterations: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    first_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def first_start(self, iterations: np.ndarray) -> int | None:
        """Earliest raw start of any of `iterations` (None if it traced none of them)."""
        hit = np.isin(self.iterations, iterations)
        return int(self.first_starts[hit].min()) if hit.any() else None


def category_mask(column: pa.Array, text: str) -> np.ndarray:
    """Rows of a string (or dictionary) column equal to `text`; on a dictionary column this
    compares indices, never materialising the strings."""
    if not pa.types.is_dictionary(column.type):
        return np.asarray(pc.equal(column, text).to_numpy(zero_copy_only=False), bool)
    hits = [k for k, v in enumerate(column.dictionary.to_pylist()) if v == text]
    indices = column.indices.to_numpy(zero_copy_only=False)
    if len(hits) <= 1:
        return indices == hits[0] if hits else np.zeros(len(indices), bool)
    return np.isin(indices, hits)


def _earliest_per_iteration(iterations: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct iterations and the earliest start of each."""
    if len(iterations) == 0:
        return iterations.astype(np.int64), starts
    if np.any(iterations[1:] < iterations[:-1]):  # rows come sorted but for late ones
        order = np.argsort(iterations, kind="stable")
        iterations, starts = iterations[order], starts[order]
    head = np.flatnonzero(np.append(True, iterations[1:] != iterations[:-1]))
    return iterations[head].astype(np.int64), np.minimum.reduceat(starts, head)


def _note_first_starts(survey: RankSurvey, iterations: np.ndarray, starts: np.ndarray) -> None:
    its, sts = _earliest_per_iteration(iterations, starts)
    if len(survey.iterations) and len(its) and its[0] <= survey.iterations[-1]:  # overlaps what is known
        its, sts = _earliest_per_iteration(
            np.concatenate([survey.iterations, its]), np.concatenate([survey.first_starts, sts])
        )
    elif len(survey.iterations):
        its, sts = np.concatenate([survey.iterations, its]), np.concatenate([survey.first_starts, sts])
    survey.iterations, survey.first_starts = its, sts


# What the survey decodes of every batch: calib pairs, first starts, the sample's rows.
_SURVEY_COLUMNS = ("cat", "start_ns", "end_ns", "iteration", "seq")


class _FullBatches:
    """A rank file's batches with every column, decoded (and the file opened) only as far as
    they are asked for: the rare sample rows that come late, after the survey stopped decoding
    every column."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._path, self._batches = path, None
        self._index, self._batch = -1, None

    def batch(self, index: int) -> pa.RecordBatch:
        """Batch number `index` (0 = first); indices must not decrease from call to call."""
        if self._batches is None:
            every = iter_rank_batches(self._path, warn=False)
            self._batches = (b for b in every if isinstance(b, pa.RecordBatch))
        while self._index < index:
            self._batch = next(self._batches)
            self._index += 1
        return self._batch


class _AlignSample:
    """The keyed comm rows of a rank's first `size` traced iterations (every column), plus every
    calib row (only its clock pair, start_ns/end_ns: all alignment reads of it)."""

    def __init__(self, size: int, path: str | os.PathLike) -> None:
        self.size, self.iterations, self.full = size, np.zeros(0, np.int64), _FullBatches(path)
        self.tables: list[pa.Table] = []
        self.calib: list[tuple[np.ndarray, np.ndarray]] = []

    def add(
        self,
        index: int,
        batch: pa.RecordBatch,
        whole: bool,
        calib: np.ndarray,
        spans: np.ndarray,
        iterations: np.ndarray,
    ) -> None:
        """Batch number `index`: every column if `whole`, else its _SURVEY_COLUMNS; `spans`: its
        non-calib rows that pass the iteration filter."""
        if len(self.iterations) < self.size and spans.any():
            seen = np.unique(iterations[spans])
            fresh = seen[~np.isin(seen, self.iterations)][: self.size - len(self.iterations)]
            self.iterations = np.concatenate([self.iterations, fresh])
        if calib.any():
            pair = batch.column("start_ns").to_numpy()[calib], batch.column("end_ns").to_numpy()[calib]
            self.calib.append(pair)
        if len(self.iterations) and spans.any() and iterations[spans].min() <= self.iterations.max():
            keyed = category_mask(batch.column("cat"), CAT_COMM) & (batch.column("seq").to_numpy() >= 0)
            rows = np.flatnonzero(spans & np.isin(iterations, self.iterations) & keyed)
            if len(rows):
                source = batch if whole else self.full.batch(index)
                self.tables.append(pa.Table.from_batches([source.take(pa.array(rows))]))

    def settled(self, spans: np.ndarray, iterations: np.ndarray) -> bool:
        """Whether the sample has its iterations and the batch went past them (later batches
        rarely hold rows of them: decoding every column of every batch is then wasted)."""
        if len(self.iterations) < self.size or not spans.any():
            return False
        return bool(iterations[spans].max() > self.iterations.max())

    def table(self) -> pa.Table:
        """The comm rows in file order, then the calib rows in file order."""
        tables = list(self.tables)
        if self.calib:
            starts, ends = (np.concatenate(part) for part in zip(*self.calib))
            columns = {c: [COLUMN_DEFAULTS[c]] * len(starts) for c in EVENT_COLUMNS}
            columns.update(cat=[CAT_CALIB] * len(starts), start_ns=starts, end_ns=ends)
            tables.append(pa.Table.from_batches([build_event_batch_from_columns(columns)]))
        if not tables:
            return EVENT_SCHEMA.empty_table()
        return pa.concat_tables(tables).unify_dictionaries().combine_chunks()


def _batches_after(path: str | os.PathLike, count: int) -> Iterator[pa.RecordBatch | str]:
    """iter_rank_batches(path, columns=_SURVEY_COLUMNS) from batch number `count` on."""
    batches = iter_rank_batches(path, columns=_SURVEY_COLUMNS)
    next(batches)  # meta
    for _ in range(count):
        next(batches)
    return batches


def survey_rank(path: str | os.PathLike, iterations: Container[int] | None, sample_iterations: int) -> RankSurvey:
    """One pass over a rank file: calibration pairs, the keyed comm rows of its first
    `sample_iterations` traced iterations, and the earliest start of every iteration. Every
    column is decoded until the sample is settled, then only _SURVEY_COLUMNS."""
    batches = iter_rank_batches(path)
    meta = next(batches)
    partial, sample, whole, index = False, _AlignSample(sample_iterations, path), True, -1
    survey = RankSurvey(RankTrace(meta, EVENT_SCHEMA.empty_table(), str(path)))
    while (batch := next(batches, None)) is not None:
        if isinstance(batch, str):
            partial = True
            continue
        index += 1
        its = batch.column("iteration").to_numpy()
        calib = category_mask(batch.column("cat"), CAT_CALIB)
        spans = ~calib if iterations is None else ~calib & iteration_mask(its, iterations)
        survey.events += int(spans.sum())
        _note_first_starts(survey, its[spans], batch.column("start_ns").to_numpy()[spans])
        sample.add(index, batch, whole, calib, spans, its)
        if whole and sample.settled(spans, its):
            batches.close()
            batches, whole = _batches_after(path, index + 1), False
    survey.trace = RankTrace(meta, sample.table(), str(path), partial)
    return survey


class _HeldRows:
    """Decoded rows of one batch not handed out yet: rows[pos:] if `ordered` (iterations
    non-decreasing, the usual case: take by slicing), else all of `cols` (take by mask)."""

    def __init__(self, cols: dict[str, np.ndarray]) -> None:
        its = cols["iteration"]
        self.cols, self.pos = cols, 0
        self.ordered = not np.any(its[1:] < its[:-1])
        self.top = int(its.max(initial=-1))  # highest iteration still held

    def take(self, stop: int) -> dict[str, np.ndarray] | None:
        """Hand out the held rows with iteration < stop (None if none), in row order."""
        its = self.cols["iteration"]
        if self.ordered:
            end = self.pos + int(np.searchsorted(its[self.pos :], stop, "left"))
            out = {k: v[self.pos : end] for k, v in self.cols.items()} if end > self.pos else None
            self.pos = end
            return out
        early = its < stop
        if not early.any():
            return None
        out = {k: v[early] for k, v in self.cols.items()}
        self.cols = {k: v[~early] for k, v in self.cols.items()}
        self.top = int(self.cols["iteration"].max(initial=-1))
        return out

    @property
    def empty(self) -> bool:
        return self.pos == len(self.cols["iteration"])


class WindowReader:
    """One rank's rows, window by window: `take(stop)` returns every row read so far with
    iteration < stop (reading on until a row of a later iteration shows up), calib rows
    dropped, as numpy columns (strings as Vocabulary ids)."""

    def __init__(self, path: str | os.PathLike, vocab: Vocabulary, iterations: Container[int] | None) -> None:
        self._batches = iter_rank_batches(path, warn=False)  # the survey warned already
        next(self._batches)  # meta: surveyed already
        self._vocab, self._iterations = vocab, iterations
        self._held: list[_HeldRows] = []
        self._done = False
        self._known: dict[str, tuple[pa.Array, np.ndarray]] = {}  # column -> last dictionary, its ids

    def _encode(self, name: str, column: pa.Array) -> np.ndarray:
        """Vocabulary ids of a string column; a file's dictionary rarely changes between batches."""
        if pa.types.is_dictionary(column.type):
            known = self._known.get(name)
            if known is None or not known[0].equals(column.dictionary):
                self._known[name] = known = (column.dictionary, self._vocab.ids_of(column.dictionary))
            return known[1][column.indices.to_numpy(zero_copy_only=False)]
        return self._vocab.encode(column)

    def _read_one(self) -> bool:
        for batch in self._batches:
            if isinstance(batch, str):
                continue
            keep = ~category_mask(batch.column("cat"), CAT_CALIB)
            if self._iterations is not None:
                keep &= iteration_mask(batch.column("iteration").to_numpy(), self._iterations)
            if keep.any():
                cols = {name: self._encode(name, batch.column(name)) for name in STRING_COLUMNS}
                cols.update({name: batch.column(name).to_numpy() for name in INT_COLUMNS})
                self._held.append(_HeldRows(cols if keep.all() else {k: v[keep] for k, v in cols.items()}))
                return True
        self._done = True
        return False

    def take(self, stop: int) -> dict[str, np.ndarray] | None:
        """Rows with iteration < stop (None if there are none)."""
        while not self._done and not any(h.top >= stop for h in self._held):
            self._read_one()
        out = [part for h in self._held if (part := h.take(stop)) is not None]
        self._held = [h for h in self._held if not h.empty]
        if len(out) <= 1:
            return out[0] if out else None
        return {k: np.concatenate([c[k] for c in out]) for k in out[0]}
