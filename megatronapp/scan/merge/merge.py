"""Merge a MegaScan trace directory into one Chrome Trace Event Format JSON, streaming.

The output opens in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per
rank, named by its coordinates and ordered by (pp, dp, tp); inside it the tracks
"step", "compute", "comm" (and "user"). Spans are complete events ("X", µs). Flow
arrows (v1 "s"/"t"/"f" events, binding to the enclosing slice) link every send to its
message's *arrival*: a short slice the merge adds inside the recv, at its end. (Perfetto
makes the slice that starts first an arrow's source, and a recv is usually posted before
its send, so an arrow ending on the recv itself would point backwards.) Each collective
instance is one chain through its members in arrival order.

Memory does not grow with the trace. Two passes over the rank files:

1. Survey (stream.survey_rank): per rank, the calibration rows, the keyed comm rows of its
   first ALIGN_SAMPLE_ITERATIONS traced iterations and the earliest start of each iteration.
   Clocks are aligned on that sample (align.align_traces: clock offsets are a property of
   the run, the calibration pairs of the whole run give the drift).
2. Windows of consecutive iterations (about WINDOW_EVENTS rows), all ranks at once, as numpy
   columns: times aligned by array ops, messages and collective instances matched
   (matching.py), thread lanes assigned and lines formatted without per-event Python
   (chrome.py), and written. An unmatched message end waits one window for its other end
   (an op finishing after a flush), then is dropped and counted (`unmatched`); a collective
   instance is closed with its window.

What is held at once: one window of rows, one decoded record batch per rank (a tracer flush),
the alignment sample, and one first start per traced iteration; none of it grows with the
number of events (benchmarks/scan_merge_scale.py measures it).

Output goes to a temporary file that replaces `out` only when complete; `.gz` outputs are
gzipped. The alignment report, the time origin and merge statistics go to "otherData".
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatronapp.files import commit_temp, temp_path_beside
from megatronapp.scan.merge.align import AlignmentReport, align_traces
from megatronapp.scan.merge.chrome import process_lines
from megatronapp.scan.merge.merge_window import ARRIVAL_NS, RankClocks, WindowMerger, place_arrival
from megatronapp.scan.merge.stream import RankSurvey, Vocabulary, WindowReader, survey_rank
from megatronapp.scan.record.format import check_file_rank, select_trace_files

__all__ = ["ARRIVAL_NS", "MergeSummary", "merge_traces", "merge_traces_split", "place_arrival", "split_output_name"]

ALIGN_SAMPLE_ITERATIONS = 8  # traced iterations per rank whose comm rows align the clocks
WINDOW_EVENTS = 1 << 16  # rows (all ranks) merged at a time, about
_ALL = 2**31 - 1


@dataclass(frozen=True)
class MergeSummary:
    """What merge_traces wrote."""

    out: str
    ranks: list[int]
    events: int  # recorded spans
    arrivals: int  # arrival slices added, one per matched p2p message
    flows: int  # flow arrows: one per message, members - 1 per collective instance
    seconds: float
    report: AlignmentReport
    unmatched: int = 0  # message ends whose other end never came within a window
    peak_window_rows: int = 0  # most rows held at once: what bounds memory
    peak_pending: int = 0  # most unmatched message ends carried to the next window

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Survey:
    surveys: list[RankSurvey]
    clocks: RankClocks
    report: AlignmentReport

    def present_iterations(self) -> list[int]:
        return np.unique(np.concatenate([s.iterations for s in self.surveys])).tolist()

    def origin(self, iterations: Sequence[int]) -> int:
        """Earliest aligned start of any span of `iterations` (0 if there is none)."""
        wanted = np.asarray(iterations, np.int64)
        firsts = [
            self.clocks.apply_one(s.trace.rank, first)
            for s in self.surveys
            if (first := s.first_start(wanted)) is not None
        ]
        return min(firsts) if firsts else 0


def _survey(trace_dir, ranks, iterations) -> _Survey:
    surveys = []
    for rank, path in select_trace_files(trace_dir, ranks).items():
        survey = survey_rank(path, iterations, ALIGN_SAMPLE_ITERATIONS)
        check_file_rank(path, rank, survey.trace.meta)
        surveys.append(survey)
    aligned, report = align_traces([s.trace for s in surveys])
    return _Survey(surveys, RankClocks.from_aligned(aligned), report)


class _OutputFile:
    """The merged output (gzipped if asked), written through; every DROP_EVERY bytes it asks
    the kernel to write back and drop from the page cache what lies DROP_LAG behind.

    Why: a merge writes gigabytes once. Kept cached, they push other data out of memory, and
    every page of them is a freshly allocated page-cache page; on this VM that doubled the
    CPU time of the write (measured: 1.1 GB written, 0.3 s of system time with the drops,
    0.35-2.0 s without). The recent DROP_LAG bytes stay: their writeback has just begun."""

    DROP_EVERY, DROP_LAG = 64 << 20, 32 << 20

    def __init__(self, path: str, gz: bool) -> None:
        self._file = open(path, "wb")
        self._gzip = gzip.GzipFile(filename=path, mode="wb", compresslevel=6, fileobj=self._file) if gz else None
        self._written, self._next_drop = 0, self.DROP_EVERY

    def write(self, data: bytes | memoryview) -> None:
        (self._gzip or self._file).write(data)
        self._written += len(data)
        if self._written >= self._next_drop:
            self._next_drop = self._written + self.DROP_EVERY
            self._file.flush()
            behind = self._file.tell() - self.DROP_LAG
            if behind > 0 and hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(self._file.fileno(), 0, behind, os.POSIX_FADV_DONTNEED)
                except OSError:  # a file system without it: the drops only save work, skip them
                    self._next_drop = float("inf")

    def __enter__(self) -> _OutputFile:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._gzip is not None:
                self._gzip.close()  # writes the gzip trailer; leaves self._file open
        finally:
            self._file.close()


def _open_output(path: Path) -> tuple[_OutputFile, str]:
    tmp = temp_path_beside(path)
    return _OutputFile(tmp, path.name.endswith(".gz")), tmp


def _sort_indices(surveys: list[RankSurvey]) -> dict[int, int]:
    def key(s: RankSurvey) -> tuple:
        c = s.trace.meta.get("coords", {})
        return (c.get("pp", 0), c.get("dp", 0), c.get("tp", 0), s.trace.rank)

    return {s.trace.rank: i for i, s in enumerate(sorted(surveys, key=key))}


def _other_data(survey: _Survey, origin: int, stats: dict) -> dict:
    first = survey.surveys[0].trace.meta
    return {
        "megascan": {
            "run_id": first.get("run_id", ""),
            "run": first.get("run", {}),
            "layout": first.get("layout", {}),
            "ranks": [s.trace.rank for s in survey.surveys],
            "partial_ranks": [s.trace.rank for s in survey.surveys if s.trace.partial],
            "origin_wall_ns": origin,
            "alignment": {**survey.report.to_dict(), "sample_iterations": ALIGN_SAMPLE_ITERATIONS},
            "merge": stats,
        }
    }


def plan_windows(iterations: list[int], events_per_iteration: float) -> list[list[int]]:
    """Consecutive groups of `iterations` of about WINDOW_EVENTS rows each (at least one iteration)."""
    per_window = max(1, int(WINDOW_EVENTS // max(events_per_iteration, 1.0)))
    return [iterations[k : k + per_window] for k in range(0, len(iterations), per_window)]


def _write_part(
    out: str | os.PathLike,
    survey: _Survey,
    readers: dict,
    vocab: Vocabulary,
    windows: list[list[int]],
    last: bool,
    began: float,
) -> MergeSummary:
    """Write the windows `windows` (the last one drains the readers if `last`) as one file."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    origin = survey.origin([i for w in windows for i in w])
    merger = WindowMerger(vocab, survey.clocks, origin)
    stream, tmp = _open_output(path)
    try:
        with stream:
            sort_index = _sort_indices(survey.surveys)
            meta = [line for s in survey.surveys for line in process_lines(s.trace.meta, sort_index[s.trace.rank])]
            stream.write(('{"traceEvents": [\n' + ",\n".join(meta)).encode())
            for k, window in enumerate(windows):
                stop = _ALL if last and k == len(windows) - 1 else window[-1] + 1
                parts = {rank: reader.take(stop) for rank, reader in readers.items()}
                for text in merger.merge({r: c for r, c in parts.items() if c is not None}):
                    stream.write(text)
            stream.write(merger.finish())
            seconds = time.perf_counter() - began
            stats = {
                **merger.stats(),
                "seconds": round(seconds, 6),
                "events_per_s": round(merger.spans / seconds, 1) if seconds > 0 else None,
            }
            other = json.dumps(_other_data(survey, origin, stats))
            stream.write(f'\n], "displayTimeUnit": "ms", "otherData": {other}}}\n'.encode())
        commit_temp(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return MergeSummary(
        out=str(path),
        ranks=[s.trace.rank for s in survey.surveys],
        events=merger.spans,
        arrivals=merger.arrivals,
        flows=merger.flows,
        seconds=seconds,
        report=survey.report,
        unmatched=merger.unmatched,
        peak_window_rows=merger.peak_rows,
        peak_pending=merger.peak_pending,
    )


def merge_traces(
    trace_dir: str | os.PathLike,
    out: str | os.PathLike,
    iterations: Container[int] | None = None,
    ranks: Sequence[int] | None = None,
) -> MergeSummary:
    """Survey, align and merge `trace_dir` into Chrome trace JSON at `out` (gzip if .gz).

    `iterations`/`ranks` restrict what is merged. Atomic: `out` is replaced only by a
    complete file. Raises what load_trace_dir raises for missing or malformed files."""
    began = time.perf_counter()
    survey = _survey(trace_dir, ranks, iterations)
    present = survey.present_iterations()
    events = sum(s.events for s in survey.surveys)
    vocab = Vocabulary()
    readers = {s.trace.rank: WindowReader(s.trace.path, vocab, iterations) for s in survey.surveys}
    windows = plan_windows(present, events / max(len(present), 1)) or [[-1]]
    return _write_part(out, survey, readers, vocab, windows, True, began)


def split_output_name(out: str | os.PathLike, first: int, last: int) -> Path:
    """timeline.json.gz -> timeline.iter00010-00019.json.gz (iterations first..last)."""
    path = Path(out)
    name, dot, rest = path.name.partition(".")
    return path.with_name(f"{name}.iter{first:05d}-{last:05d}{dot}{rest}")


def merge_traces_split(
    trace_dir: str | os.PathLike, out: str | os.PathLike, per_file: int, ranks: Sequence[int] | None = None
) -> list[MergeSummary]:
    """Like merge_traces, but one file per `per_file` consecutive traced iterations (named by
    split_output_name), so each stays small enough for the Perfetto UI. Clocks are aligned
    once, on the whole trace. Messages and collectives crossing a file boundary get no arrow."""
    if per_file < 1:
        raise ValueError(f"iterations per file must be >= 1, got {per_file}")
    began = time.perf_counter()
    survey = _survey(trace_dir, ranks, None)
    present = [i for i in survey.present_iterations() if i != -1]
    events = sum(s.events for s in survey.surveys)
    vocab = Vocabulary()
    readers = {s.trace.rank: WindowReader(s.trace.path, vocab, range(0, _ALL)) for s in survey.surveys}
    summaries = []
    for k in range(0, len(present), per_file):
        chunk = present[k : k + per_file]
        windows = plan_windows(chunk, events / max(len(present), 1))
        last = k + per_file >= len(present)
        summaries.append(
            _write_part(split_output_name(out, chunk[0], chunk[-1]), survey, readers, vocab, windows, last, began)
        )
        began = time.perf_counter()
    return summaries
