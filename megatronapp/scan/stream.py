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
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.spans import CAT_CALIB, CAT_COMM
from megatronapp.scan.format import (
    END_OF_STREAM,
    EVENT_SCHEMA,
    RankTrace,
    TraceFormatError,
    filter_iterations,
    read_meta,
)

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
        table = np.array([self.id_of(v) for v in column.dictionary.to_pylist()] or [0], dtype=np.int32)
        return table[column.indices.to_numpy(zero_copy_only=False)]


def iter_rank_batches(path: str | os.PathLike, warn: bool = True) -> Iterator[pa.RecordBatch | dict | str]:
    """The record batches of one rank file, in order. The first item is the file's meta dict;
    a stream that stops early ends with the item "partial".

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
            yield batch
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


def _is_category(batch: pa.RecordBatch, cat: str) -> pa.Array:
    return pc.equal(batch.column("cat").cast(pa.string()), cat)


def _earliest_per_iteration(iterations: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct iterations and the earliest start of each."""
    order = np.lexsort((starts, iterations))
    its, sts = iterations[order], starts[order]
    head = np.flatnonzero(np.append(True, its[1:] != its[:-1])) if len(its) else np.zeros(0, np.int64)
    return its[head], sts[head]


def _note_first_starts(survey: RankSurvey, iterations: np.ndarray, starts: np.ndarray) -> None:
    its, sts = _earliest_per_iteration(np.concatenate([survey.iterations, iterations.astype(np.int64)]),
                                       np.concatenate([survey.first_starts, starts]))
    survey.iterations, survey.first_starts = its, sts


def survey_rank(path: str | os.PathLike, iterations: Container[int] | None, sample_iterations: int) -> RankSurvey:
    """One pass over a rank file: calibration rows, the keyed comm rows of its first
    `sample_iterations` traced iterations, and the earliest start of every iteration."""
    batches = iter_rank_batches(path)
    meta = next(batches)
    kept, partial, sampled = [], False, set()
    survey = RankSurvey(RankTrace(meta, EVENT_SCHEMA.empty_table(), str(path)))
    for batch in batches:
        if isinstance(batch, str):
            partial = True
            continue
        table = pa.Table.from_batches([batch])
        if iterations is not None:
            table = filter_iterations(table, iterations)
        calib = np.asarray(_is_category(table, CAT_CALIB).to_numpy(zero_copy_only=False), bool)
        its, starts = table.column("iteration").to_numpy()[~calib], table.column("start_ns").to_numpy()[~calib]
        survey.events += len(its)
        _note_first_starts(survey, its, starts)
        for it in np.unique(its).tolist()[:max(0, sample_iterations - len(sampled))]:
            sampled.add(it)
        keyed = pc.and_(_is_category(table, CAT_COMM), pc.greater_equal(table.column("seq"), 0))
        in_sample = pc.is_in(table.column("iteration"), value_set=pa.array(sorted(sampled), pa.int32()))
        kept.append(table.filter(pc.or_(pa.array(calib), pc.and_(keyed, in_sample))))
    events = pa.concat_tables(kept).unify_dictionaries().combine_chunks() if kept else EVENT_SCHEMA.empty_table()
    survey.trace = RankTrace(meta, events, str(path), partial)
    return survey


class WindowReader:
    """One rank's rows, window by window: `take(stop)` returns every row read so far with
    iteration < stop (reading on until a row of a later iteration shows up), calib rows
    dropped, as numpy columns (strings as Vocabulary ids)."""

    def __init__(self, path: str | os.PathLike, vocab: Vocabulary, iterations: Container[int] | None) -> None:
        self._batches = iter_rank_batches(path, warn=False)  # the survey warned already
        next(self._batches)  # meta: surveyed already
        self._vocab, self._iterations = vocab, iterations
        self._calib = vocab.id_of(CAT_CALIB)
        self._held: list[dict[str, np.ndarray]] = []
        self._done = False

    def _read_one(self) -> bool:
        for batch in self._batches:
            if isinstance(batch, str):
                continue
            if self._iterations is not None:
                batch = filter_iterations(pa.Table.from_batches([batch]), self._iterations).combine_chunks()
                batch = batch.to_batches()[0] if batch.num_rows else None
            if batch is not None and batch.num_rows:
                cols = {name: self._vocab.encode(batch.column(name)) for name in STRING_COLUMNS}
                cols.update({name: batch.column(name).to_numpy() for name in INT_COLUMNS})
                keep = cols["cat"] != self._calib
                self._held.append({k: v[keep] for k, v in cols.items()})
                return True
        self._done = True
        return False

    def take(self, stop: int) -> dict[str, np.ndarray] | None:
        """Rows with iteration < stop (None if there are none)."""
        while not self._done and not any(int(c["iteration"].max(initial=-1)) >= stop for c in self._held):
            self._read_one()
        out, rest = [], []
        for cols in self._held:
            early = cols["iteration"] < stop
            out.append({k: v[early] for k, v in cols.items()})
            if not early.all():
                rest.append({k: v[~early] for k, v in cols.items()})
        self._held = rest
        out = [c for c in out if len(c["iteration"])]
        if not out:
            return None
        return {k: np.concatenate([c[k] for c in out]) for k in out[0]}
