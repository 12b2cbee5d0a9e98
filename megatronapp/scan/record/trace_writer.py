"""The tracer's background side: turns recorded windows into record batches and appends them.

A record is `(name, cat, start_marker, end_marker, iteration, attrs, cpu_ns, counters)`, attrs
in SPAN_ATTRS order, counters None or the iteration's sched.SIGNALS deltas (on its step span);
the markers are the clock's (clocks.py). `BackgroundWriter` owns this rank's
TraceWriter (format.py) on one thread, so the training thread never does file I/O.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from megatronapp.scan.record.format import TraceWriter, build_event_batch_from_columns
from megatronapp.scan.record.sched import SIGNALS
from megatronapp.spans import CAT_CALIB

# Span attributes a caller may set, in record order; values default to -1 / "".
SPAN_ATTRS = ("chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes")
ATTR_DEFAULTS = (-1, -1, -1, "", "", -1, -1, -1)
_NO_COUNTERS = (-1,) * len(SIGNALS)
_RECORDS_PER_GIL_SLICE = 64


def build_window_batch(records: list, clock: Any, calibs: list[tuple[int, int]]):
    """Columns of one flushed window (plus its calibration rows) as a batch."""
    cols: dict[str, list] = {
        c: [] for c in ("name", "cat", "start_ns", "end_ns", "iteration", *SPAN_ATTRS, "cpu_ns", *SIGNALS)
    }
    markers = []
    # A span can start at an earlier span's end mark (Tracer.layer_span(after=...)); that span
    # closed, so was recorded, first: look starts up among the ends converted so far (on CUDA a
    # conversion is a driver call).
    end_ns_of: dict = {}
    for k, (name, cat, start, end, iteration, attrs, cpu_ns, counters) in enumerate(records):
        if k % _RECORDS_PER_GIL_SLICE == 0:
            # Hand the GIL back between slices so the training thread, which launches
            # the next step meanwhile, never waits a whole switch interval for it.
            time.sleep(0)
        cols["name"].append(name)
        cols["cat"].append(cat)
        start_ns = end_ns_of.get(start)
        cols["start_ns"].append(clock.to_ns(start) if start_ns is None else start_ns)
        end_ns = end_ns_of[end] = clock.to_ns(end)
        cols["end_ns"].append(end_ns)
        cols["iteration"].append(iteration)
        for key, value in zip(SPAN_ATTRS, attrs):
            cols[key].append(value)
        cols["cpu_ns"].append(cpu_ns)
        for key, value in zip(SIGNALS, counters or _NO_COUNTERS):
            cols[key].append(value)
        markers += (start, end)
    for calib in calibs:
        row = ("clock", CAT_CALIB, calib[0], calib[1], -1, *ATTR_DEFAULTS, -1, *_NO_COUNTERS)
        for key, value in zip(cols, row):
            cols[key].append(value)
    clock.release(markers)
    return build_event_batch_from_columns(cols)


@dataclass
class WriterCost:
    """The writer thread's CPU time converting and writing, not waiting for the GPU. The first
    batch also opens the file (schema, dictionaries, the thread's first CUDA calls): a cost a
    long run pays once, so it is kept apart from the steady state."""

    first_batch_s: float = 0.0
    batches: int = 0
    later_records: int = 0  # records of every batch after the first
    later_s: float = 0.0

    def add(self, records: int, seconds: float) -> None:
        if self.batches == 0:
            self.first_batch_s = seconds
        else:
            self.later_records += records
            self.later_s += seconds
        self.batches += 1

    @property
    def total_s(self) -> float:
        return self.first_batch_s + self.later_s


class BackgroundWriter:
    """One thread that owns the TraceWriter: converts windows and appends them.

    The queue holds at most `max_pending` windows; `submit` never blocks: a window that does
    not fit is dropped (its CUDA events go back to the pool) and counted."""

    def __init__(self, writer: TraceWriter, clock: Any, max_pending: int) -> None:
        self._writer, self._clock = writer, clock
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self.dropped_windows = self.dropped_events = 0
        self.cost = WriterCost()  # final at close
        self._thread = threading.Thread(target=self._run, name="megascan-writer", daemon=True)
        self._thread.start()

    def submit(self, records: list, calib: tuple[int, int] | None = None) -> bool:
        """Queue a window (`calib` None: take the calibration pair after it); False if dropped."""
        try:
            self._queue.put_nowait((records, calib))
            return True
        except queue.Full:
            self.dropped_windows += 1
            self.dropped_events += len(records)
            self._clock.release([m for r in records for m in (r[2], r[3])])
            return False

    def _run(self) -> None:
        held: list[tuple[int, int]] = []  # calibration pairs not written yet
        while (job := self._queue.get()) is not None:
            records, calib = job
            try:
                if records or calib is None:
                    self._write(records, held + ([calib] if calib else []), fresh_pair=calib is None)
                    held = []
                else:  # a lone pair (the tracer's start pair) rides with the next window: a batch of its own costs ~1 KB
                    held.append(calib)
            finally:  # wait_idle must not hang on a window that failed
                self._queue.task_done()
        try:
            if held:
                self._write([], held, fresh_pair=False)
        finally:
            self._queue.task_done()

    def wait_idle(self) -> None:
        """Block until every window submitted so far is converted and appended (a lone
        calibration pair waits for the next window). For measurements that must keep the
        writer's work out of a timed interval, e.g. benchmarks/scan_overhead.py."""
        self._queue.join()

    def _write(self, records: list, pairs: list[tuple[int, int]], fresh_pair: bool) -> None:
        """Append `records` and the calibration `pairs` (+ one taken now if `fresh_pair`) as one batch."""
        if self.error is not None:
            return
        # Asleep, not counted: until the GPU passes the window's last mark (its last span end).
        self._clock.wait_recorded([r[3] for r in records[-1:]])
        began = time.thread_time()
        try:
            pairs = [*pairs, self._clock.calibration_pair()] if fresh_pair else pairs
            self._writer.append(build_window_batch(records, self._clock, pairs))
        except Exception as exc:  # keep training alive; close() reports it
            self.error = exc
            warnings.warn(f"MegaScan writer for {self._writer.path} failed: {exc!r}", stacklevel=1)
        finally:
            self.cost.add(len(records), time.thread_time() - began)

    def close(self) -> None:
        self._queue.put(None)  # blocks until there is room: the writer drains what is queued
        self._thread.join()
        self._writer.close()
