"""The MegaScan on-disk format: one Arrow IPC stream per rank.

Each rank writes `rank{R:05d}.mscan` in the trace directory. The file is an Arrow IPC
*stream* (not the random-access file format) so that it can be appended to while
training runs: the schema is written once at open, every flush appends one record
batch, and `close()` writes the end-of-stream marker. A rank that crashes mid-run
therefore leaves a readable prefix; `load_rank_trace` returns it with `partial=True`.
The string columns of a file share one dictionary that only grows (IPC dictionary
deltas), so a batch carries dictionary messages only when it brings new strings.

Rank metadata is JSON under the schema metadata key ``megascan`` (see `META_KEYS`).
Every event is one row of `EVENT_SCHEMA`; all columns are non-null and use -1 / ""
for "not applicable". Timestamps are nanoseconds on the rank's device timeline.

Calibration pairs are rows with cat "calib", name "clock": start_ns is the device
timestamp, end_ns the host wall clock (time.time_ns()) taken at the same moment.

Measured causes (schema version 2): `cpu_ns` is the CPU time the thread that opened a span spent
between its start and end (-1 when another thread closed it); on a "cuda" clock start_ns/end_ns
are CUDA event times, so end_ns - start_ns is the span's device time and `cpu_ns` the host's. The
"iteration" span carries what the operating system took from the training thread during it
(deltas of sched.py's counters): `run_delay_ns` (runnable, not running), `involuntary_switches`,
and the process cgroup's CPU throttling, `throttled_ns` and `nr_throttled`. Version 1 files,
without these columns, load with -1 in them.

Sequence numbers let analyses pair events across ranks without any extra
communication: for a collective, `seq` is the k-th collective this rank issued on
`group` (same k on every member); for p2p, `seq` is the k-th message on the directed
pair (src -> dst), identical for the send on src and the matching recv on dst.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatronapp.spans import CATEGORIES

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 lacks SIGNAL_COLUMNS (read as -1)
META_FIELD = b"megascan"
FILE_SUFFIX = ".mscan"
META_KEYS = (
    "schema_version",
    "rank",
    "world_size",
    "coords",
    "layout",
    "host",
    "device",
    "run_id",
    "clock",
    "run",
)
# Arrow IPC end-of-stream marker: continuation token 0xFFFFFFFF + zero length.
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_RANK_FILE = re.compile(r"^rank(\d{5,})\.mscan$")
# Record batches are compressed (Arrow IPC body compression; readers need nothing special):
# zstd brings an event from ~65 bytes to well under 40 (measured in benchmarks/scan_scale.py).
_COMPRESSION = "zstd" if pa.Codec.is_available("zstd") else ("lz4" if pa.Codec.is_available("lz4") else None)

_DICT_STRING = pa.dictionary(pa.int32(), pa.string())
EVENT_SCHEMA = pa.schema(
    [
        pa.field("name", _DICT_STRING, nullable=False),
        pa.field("cat", _DICT_STRING, nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("chunk", pa.int16(), nullable=False),
        pa.field("microbatch", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("op", _DICT_STRING, nullable=False),
        pa.field("group", _DICT_STRING, nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("peer", pa.int32(), nullable=False),
        pa.field("bytes", pa.int64(), nullable=False),
        pa.field("cpu_ns", pa.int64(), nullable=False),
        pa.field("run_delay_ns", pa.int64(), nullable=False),
        pa.field("involuntary_switches", pa.int64(), nullable=False),
        pa.field("throttled_ns", pa.int64(), nullable=False),
        pa.field("nr_throttled", pa.int64(), nullable=False),
    ]
)
EVENT_COLUMNS = tuple(EVENT_SCHEMA.names)
# Columns added by schema version 2; a file without them reads -1 there.
SIGNAL_COLUMNS = ("cpu_ns", "run_delay_ns", "involuntary_switches", "throttled_ns", "nr_throttled")
# Value used for a column a row does not set.
COLUMN_DEFAULTS: dict[str, Any] = {
    "name": "",
    "cat": "user",
    "start_ns": -1,
    "end_ns": -1,
    "iteration": -1,
    "chunk": -1,
    "microbatch": -1,
    "layer": -1,
    "op": "",
    "group": "",
    "seq": -1,
    "peer": -1,
    "bytes": -1,
    **dict.fromkeys(SIGNAL_COLUMNS, -1),
}


class TraceFormatError(ValueError):
    """A file that is not a readable MegaScan trace; the message names the file."""


@dataclass
class RankTrace:
    """One rank's trace: its meta dict, its events (columns of EVENT_SCHEMA), where it
    came from, and whether the stream ended early (crashed or still being written)."""

    meta: dict
    events: pa.Table
    path: str = ""
    partial: bool = False

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])


def trace_file_name(rank: int) -> str:
    """File name of `rank`'s trace inside a trace directory."""
    return f"rank{rank:05d}{FILE_SUFFIX}"


def build_rank_meta(
    *,
    rank: int,
    world_size: int,
    coords: Mapping[str, int],
    layout: Mapping[str, int],
    host: str,
    device: str,
    run_id: str,
    clock: str,
    run: Mapping[str, Any] | None = None,
) -> dict:
    """Meta dict for one rank, complete and valid (see META_KEYS)."""
    meta = {
        "schema_version": SCHEMA_VERSION,
        "rank": int(rank),
        "world_size": int(world_size),
        "coords": {k: int(coords[k]) for k in ("tp", "dp", "pp")},
        "layout": {k: int(layout.get(k, 1)) for k in ("tp_size", "pp_size", "dp_size", "virtual_pp_size")},
        "host": str(host),
        "device": str(device),
        "run_id": str(run_id),
        "clock": str(clock),
        "run": dict(run or {}),
    }
    validate_rank_meta(meta)
    return meta


def validate_rank_meta(meta: Mapping[str, Any], source: str = "meta") -> None:
    """Raise TraceFormatError naming `source` unless `meta` has every required key."""
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise TraceFormatError(f"{source}: MegaScan meta lacks keys {missing}")
    if meta["schema_version"] not in READABLE_VERSIONS:
        raise TraceFormatError(
            f"{source}: schema_version {meta['schema_version']} is not supported "
            f"(this reader understands {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if meta["clock"] not in ("cuda", "monotonic"):
        raise TraceFormatError(f"{source}: clock must be 'cuda' or 'monotonic', got {meta['clock']!r}")


def build_event_batch(rows: Iterable[Mapping[str, Any]]) -> pa.RecordBatch:
    """Record batch of EVENT_SCHEMA from row dicts; absent columns take COLUMN_DEFAULTS.

    Raises ValueError for an unknown column or category, so bad rows fail at the writer
    rather than in an analysis much later."""
    cols: dict[str, list] = {c: [] for c in EVENT_COLUMNS}
    for row in rows:
        unknown = row.keys() - COLUMN_DEFAULTS.keys()
        if unknown:
            raise ValueError(f"unknown MegaScan event columns {sorted(unknown)}")
        for name in EVENT_COLUMNS:
            cols[name].append(row.get(name, COLUMN_DEFAULTS[name]))
    return build_event_batch_from_columns(cols)


def build_event_batch_from_columns(cols: Mapping[str, Sequence[Any]]) -> pa.RecordBatch:
    """Record batch of EVENT_SCHEMA from one equal-length list per column (all required).

    Raises ValueError for a missing column or an unknown category."""
    missing = [c for c in EVENT_COLUMNS if c not in cols]
    if missing:
        raise ValueError(f"event columns {missing} missing")
    bad = set(cols["cat"]) - set(CATEGORIES)
    if bad:
        raise ValueError(f"event categories {sorted(bad)} not in {CATEGORIES}")
    # dictionary_encode yields int32 indices, matching the schema's dictionary type.
    arrays = [
        pa.array(cols[f.name], type=pa.string()).dictionary_encode()
        if pa.types.is_dictionary(f.type)
        else pa.array(cols[f.name], type=f.type)
        for f in EVENT_SCHEMA
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=EVENT_SCHEMA)


def _schema_with_meta(meta: Mapping[str, Any]) -> pa.Schema:
    return EVENT_SCHEMA.with_metadata({META_FIELD: json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()})


class _GrowingDictionaries:
    """Per string column, every value written so far, in order of first sight. Each batch is
    re-encoded against it, so its dictionary extends the last one written: the IPC writer then
    writes only the new strings (a delta), and nothing once the names repeat. (A dictionary
    per batch costs ~200 bytes of message header per string column and batch.)"""

    def __init__(self) -> None:
        self._words: dict[str, dict[str, int]] = {f.name: {} for f in EVENT_SCHEMA if pa.types.is_dictionary(f.type)}

    def encode(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        arrays = []
        for f, column in zip(EVENT_SCHEMA, batch.columns):
            if f.name not in self._words:
                arrays.append(column)
                continue
            ids = self._words[f.name]
            column = column if pa.types.is_dictionary(column.type) else column.dictionary_encode()
            local = np.array([ids.setdefault(w, len(ids)) for w in column.dictionary.to_pylist()] or [0], np.int32)
            indices = local[column.indices.to_numpy(zero_copy_only=False)]
            arrays.append(
                pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(list(ids), pa.string()))
            )
        return pa.RecordBatch.from_arrays(arrays, schema=batch.schema)


class _SchemaWrittenSink:
    """The IPC writer's sink: the file, minus the schema message the writer writes first
    (TraceWriter wrote that message itself when it opened the file, so the file is a
    readable, empty trace at once without an empty batch's ~1.5 KB of headers)."""

    def __init__(self, handle: Any, schema_message: bytes) -> None:
        self._handle, self._message, self._position = handle, schema_message, 0
        self.closed = False

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        skipped = self._position
        if skipped < len(self._message):
            n = min(len(self._message) - skipped, len(data))
            if data[:n] != self._message[skipped : skipped + n]:  # not the message written: rewrite the file
                self._handle.seek(0)
                self._handle.truncate()
                self._handle.write(self._message[:skipped])
                self._message = b""
            else:
                data = data[n:]
                self._position += n
        self._handle.write(data)
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> None:
        self.closed = True
        self._handle.close()


class TraceWriter:
    """Appends event batches to one rank's stream file; flushes after every batch.

    Not atomic by design: the point of the stream format is that a crash leaves a
    readable prefix. Not thread-safe: one writer thread per file."""

    def __init__(self, path: str | os.PathLike, meta: Mapping[str, Any]) -> None:
        validate_rank_meta(meta, str(path))
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        schema = _schema_with_meta(meta)
        message = schema.serialize().to_pybytes()
        handle = open(self.path, "wb")
        handle.write(message)  # readable (empty) from now on; Arrow would write it with the first batch
        handle.flush()
        self._sink = _SchemaWrittenSink(handle, message)
        options = pa.ipc.IpcWriteOptions(compression=_COMPRESSION, emit_dictionary_deltas=True)
        self._writer = pa.ipc.new_stream(self._sink, schema, options=options)
        self._dictionaries = _GrowingDictionaries()
        # Encode an empty batch now: pyarrow and numpy import what encoding needs at its first
        # use (numpy.ma, pyarrow's compute kernels: ~30 ms on the 2-core VM, 200-330 ms on a fresh
        # H200 host that also compiles their bytecode), which a background writer would otherwise
        # do holding the GIL in the middle of the first traced window.
        self._dictionaries.encode(build_event_batch_from_columns({c: [] for c in EVENT_COLUMNS}))
        self.rows_written = 0

    def append(self, rows: Iterable[Mapping[str, Any]] | pa.RecordBatch) -> None:
        """Append rows (dicts, or a ready EVENT_SCHEMA batch) as one record batch."""
        if self._writer is None:
            raise ValueError(f"{self.path}: append after close")
        batch = rows if isinstance(rows, pa.RecordBatch) else build_event_batch(rows)
        if batch.num_rows == 0:
            return
        self._writer.write_batch(self._dictionaries.encode(batch))
        self._sink.flush()
        self.rows_written += batch.num_rows

    def close(self) -> None:
        """Write the end-of-stream marker and close; idempotent."""
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        self._writer = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_meta(schema: pa.Schema, source: str) -> dict:
    raw = (schema.metadata or {}).get(META_FIELD)
    if raw is None:
        raise TraceFormatError(f"{source}: not a MegaScan trace (no '{META_FIELD.decode()}' schema metadata)")
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise TraceFormatError(f"{source}: MegaScan meta is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{source}: MegaScan meta must be a JSON object")
    validate_rank_meta(meta, source)
    missing = [c for c in EVENT_COLUMNS if c not in schema.names and c not in SIGNAL_COLUMNS]
    if missing:
        raise TraceFormatError(f"{source}: event columns {missing} missing")
    return meta


def with_signal_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with the SIGNAL_COLUMNS a version 1 file lacks, as -1 (the same batch if none)."""
    absent = [c for c in SIGNAL_COLUMNS if c not in batch.schema.names]
    if not absent:
        return batch
    for name in absent:
        batch = batch.append_column(EVENT_SCHEMA.field(name), pa.array(np.full(batch.num_rows, -1, np.int64)))
    return batch


def load_rank_trace(path: str | os.PathLike) -> RankTrace:
    """Read one rank's file.

    A file that is not a MegaScan stream raises TraceFormatError naming it. A stream
    that stops early (crash, or writer still open) yields the complete batches read so
    far, `partial=True`, and a warning naming the file."""
    source = str(path)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceFormatError(f"{source}: cannot read ({exc.strerror})") from None
    try:
        reader = pa.ipc.open_stream(data)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{source}: not a MegaScan trace (no Arrow IPC stream header: {exc})") from None
    meta = read_meta(reader.schema, source)
    batches, error = [], None
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError) as exc:
            error = exc
            break
    partial = error is not None or not data.endswith(END_OF_STREAM)
    if partial:
        why = f"truncated stream ({error})" if error else "no end-of-stream marker"
        warnings.warn(f"{source}: {why}; using the {len(batches)} complete batches", stacklevel=2)
    schema = reader.schema
    if any(c not in schema.names for c in SIGNAL_COLUMNS):
        batches = [with_signal_columns(b) for b in batches]
        schema = EVENT_SCHEMA.with_metadata(schema.metadata)
    table = pa.Table.from_batches(batches, schema=schema)
    return RankTrace(meta=meta, events=table, path=source, partial=partial)


def iteration_mask(iterations: np.ndarray, wanted: Container[int]) -> np.ndarray:
    """Which entries of `iterations` (an int array) are in `wanted` (a range or any container)."""
    if isinstance(wanted, range) and wanted.step == 1:
        return (iterations >= wanted.start) & (iterations < wanted.stop)
    return np.isin(iterations, np.fromiter(sorted(set(wanted)), np.int64))


def filter_iterations(events: pa.Table, iterations: Container[int]) -> pa.Table:
    """Rows whose iteration is in `iterations`, plus every calib row (alignment needs them)."""
    keep = iteration_mask(events.column("iteration").to_numpy(), iterations)
    keep |= np.asarray(pc.equal(events.column("cat").cast(pa.string()), "calib").to_numpy(zero_copy_only=False), bool)
    return events.filter(pa.array(keep))


def list_trace_files(trace_dir: str | os.PathLike) -> dict[int, Path]:
    """Rank -> path of every `rankNNNNN.mscan` in `trace_dir` (other files are ignored)."""
    root = Path(trace_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"trace directory {root} does not exist")
    found = {}
    for entry in root.iterdir():
        match = _RANK_FILE.match(entry.name)
        if match and entry.is_file():
            found[int(match.group(1))] = entry
    return found


def select_trace_files(trace_dir: str | os.PathLike, ranks: Sequence[int] | None = None) -> dict[int, Path]:
    """Rank -> file of every rank (or only `ranks`) of `trace_dir`, sorted by rank; an empty
    directory or a requested rank without a file raises FileNotFoundError."""
    files = list_trace_files(trace_dir)
    if not files:
        raise FileNotFoundError(f"no MegaScan files (rank*{FILE_SUFFIX}) in {trace_dir}")
    wanted = sorted(files) if ranks is None else sorted(set(ranks))
    absent = [r for r in wanted if r not in files]
    if absent:
        raise FileNotFoundError(f"no trace file for ranks {absent} in {trace_dir} (have {sorted(files)})")
    return {rank: files[rank] for rank in wanted}


def check_file_rank(path: str | os.PathLike, rank: int, meta: Mapping[str, Any]) -> None:
    """TraceFormatError unless the meta of the file named for `rank` says that rank."""
    if int(meta["rank"]) != rank:
        raise TraceFormatError(f"{path}: file name says rank {rank} but meta says {meta['rank']}")


def load_trace_dir(
    trace_dir: str | os.PathLike,
    ranks: Sequence[int] | None = None,
    iterations: Container[int] | None = None,
) -> list[RankTrace]:
    """Load every rank file (or only `ranks`) of `trace_dir`, sorted by rank.

    `iterations` keeps only events of those iterations (calibration rows always kept).
    Errors name the offending file; an empty directory or a requested rank without a
    file raises FileNotFoundError."""
    traces = []
    for rank, path in select_trace_files(trace_dir, ranks).items():
        trace = load_rank_trace(path)
        check_file_rank(path, rank, trace.meta)
        if iterations is not None:
            trace.events = filter_iterations(trace.events, iterations)
        traces.append(trace)
    return traces
