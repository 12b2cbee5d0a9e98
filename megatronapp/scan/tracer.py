"""MegaScan's recorder: cheap spans on the training thread, file I/O on a background one.

The training thread only takes timestamps. On CUDA a timestamp is a pooled
`torch.cuda.Event` recorded on the current stream, so recording never synchronises
the step; on CPU it is `time.monotonic_ns()`. After the last step of a traced window
the raw records go to one background thread, which waits for the events, turns them
into nanoseconds on one device timeline, and appends a record batch to this rank's
file (see format.py). Tracing adds no collective and touches only this rank's file.

When tracing is off, or the iteration is not traced, `span()` returns one shared
no-op context manager: the cost is an attribute check.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatronapp.spans import CAT_CALIB, CAT_COMM, CAT_STEP, CATEGORIES, ITERATION
from megatronapp.scan.format import (
    SCHEMA_VERSION,
    TraceWriter,
    build_event_batch_from_columns,
    trace_file_name,
)

GRANULARITIES = ("base", "full")
# Span attributes a caller may set, in record order; values default to -1 / "".
SPAN_ATTRS = ("chunk", "microbatch", "layer", "op", "group", "seq", "peer", "bytes")
_ATTR_DEFAULTS = (-1, -1, -1, "", "", -1, -1, -1)
_SPAN_CATEGORIES = tuple(c for c in CATEGORIES if c != CAT_CALIB)
_RECORDS_PER_GIL_SLICE = 64
_INITIAL_EVENT_POOL = 4096  # CUDA timing events made at start (two per span)
# Hand a window to the writer once this many spans are waiting, whatever flush_seconds says:
# on CUDA that returns events to the pool before it runs dry (a new event costs a driver
# call inside the step); on CPU it bounds memory.
_FLUSH_RECORDS = _INITIAL_EVENT_POOL // 4


@dataclass(frozen=True)
class TraceConfig:
    """When and how much to trace.

    Windows of `continuous_iterations` consecutive iterations start at iterations
    `interval`, 2*`interval`, ... (the first one after warm-up, never iteration 0).
    `granularity` "full" also records per-layer attention/mlp spans.
    `clock_skew_ns` is a testing knob added to every timestamp of this rank."""

    enabled: bool = False
    trace_dir: str = ""
    interval: int = 100
    continuous_iterations: int = 1
    granularity: str = "base"
    clock_skew_ns: int = 0
    # Hand records to the writer thread at a window's end only when this many seconds have
    # passed since the last hand-over (or at close): every wake-up of the writer competes
    # with the training thread for the GIL, which costs a launch-bound step several percent
    # if it happens every iteration. A crash loses at most this much of the trace.
    flush_seconds: float = 5.0
    # Windows waiting for the writer thread at most; past that a window is dropped and
    # counted (Tracer.dropped_events), so a slow disk never grows memory or blocks a step.
    max_pending_windows: int = 16

    def __post_init__(self) -> None:
        if self.max_pending_windows < 1:
            raise ValueError(f"max_pending_windows must be >= 1, got {self.max_pending_windows}")
        if self.interval < 1:
            raise ValueError(f"trace interval must be >= 1 iteration, got {self.interval}")
        if not 1 <= self.continuous_iterations <= self.interval:
            raise ValueError(
                f"continuous_iterations must be in 1..interval ({self.interval}), "
                f"got {self.continuous_iterations}"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.enabled and not self.trace_dir:
            raise ValueError("tracing is enabled but trace_dir is empty: set a directory for the .mscan files")

    def should_trace(self, iteration: int) -> bool:
        """True for iterations k*interval .. k*interval + continuous_iterations - 1, k >= 1."""
        return (
            self.enabled
            and iteration >= self.interval
            and iteration % self.interval < self.continuous_iterations
        )


class _NoOpSpan:
    """Shared stand-in when nothing is recorded; must stay stateless."""

    __slots__ = ()

    def __enter__(self) -> "_NoOpSpan":
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def finish(self) -> None:
        pass


NOOP_SPAN = _NoOpSpan()


class _MonotonicClock:
    """CPU timeline: time.monotonic_ns(), shared by all processes of one host."""

    name = "monotonic"

    def __init__(self, skew_ns: int) -> None:
        self._skew = skew_ns

    def mark(self) -> int:
        return time.monotonic_ns() + self._skew

    def to_ns(self, marker: int) -> int:
        return marker

    def release(self, markers: list) -> None:
        pass

    def calibration_pair(self) -> tuple[int, int]:
        # Keep the tightest of a few monotonic brackets around the wall read, so a
        # preemption between the two clock reads does not become a clock offset.
        best = None
        for _ in range(5):
            before, wall, after = time.monotonic_ns(), time.time_ns(), time.monotonic_ns()
            if best is None or after - before < best[0]:
                best = (after - before, (before + after) // 2, wall)
        return best[1] + self._skew, best[2] + self._skew


class _CudaClock:
    """GPU timeline: pooled timing events, converted against an anchor event whose
    host monotonic time was taken while the device was idle (at construction)."""

    name = "cuda"

    def __init__(self, device: Any, skew_ns: int) -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device)
        # Creating an event inside a step costs a driver call (torch creates the CUDA event
        # lazily, at its first record), so make a stock now: record each once, off-step.
        self._pool = [torch.cuda.Event(enable_timing=True) for _ in range(_INITIAL_EVENT_POOL)]
        # Calibration events go on their own idle stream so they complete at once.
        self._calib_stream = torch.cuda.Stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(self._calib_stream):
            for event in self._pool:
                event.record()
        torch.cuda.synchronize(self._device)
        self._anchor = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self._device):
            self._anchor.record()
        self._anchor.synchronize()
        self._anchor_ns = time.monotonic_ns() + skew_ns
        self._skew = skew_ns

    def mark(self) -> Any:
        event = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def to_ns(self, event: Any) -> int:
        event.synchronize()
        return self._anchor_ns + round(self._anchor.elapsed_time(event) * 1e6)

    def release(self, events: list) -> None:
        self._pool.extend(events)

    def calibration_pair(self) -> tuple[int, int]:
        torch = self._torch
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self._device), torch.cuda.stream(self._calib_stream):
            event.record()
            wall = time.time_ns()
        return self.to_ns(event), wall + self._skew


class _Span:
    """One open span; `finish()` (or leaving the `with`) records its end."""

    __slots__ = ("_tracer", "_name", "_cat", "_attrs", "_iteration", "_start", "_done")

    def __init__(self, tracer: "Tracer", name: str, cat: str, attrs: tuple) -> None:
        self._tracer, self._name, self._cat, self._attrs = tracer, name, cat, attrs
        # Captured at open: an async op may finish during a later iteration.
        self._iteration = tracer._iteration
        self._start = None
        self._done = False

    def start(self) -> "_Span":
        self._start = self._tracer._clock.mark()
        return self

    def finish(self) -> None:
        if self._done or self._start is None:
            return
        self._done = True
        end = self._tracer._clock.mark()
        self._tracer._records.append(
            (self._name, self._cat, self._start, end, self._iteration, self._attrs)
        )

    def __enter__(self) -> "_Span":
        return self.start()

    def __exit__(self, *exc: object) -> bool:
        self.finish()
        return False


class _Context:
    """Sets default span attributes for everything recorded inside it."""

    __slots__ = ("_tracer", "_attrs", "_saved")

    def __init__(self, tracer: "Tracer", attrs: dict) -> None:
        self._tracer, self._attrs, self._saved = tracer, attrs, None

    def __enter__(self) -> "_Context":
        self._saved = self._tracer._defaults
        self._tracer._defaults = {**self._saved, **self._attrs}
        return self

    def __exit__(self, *exc: object) -> bool:
        self._tracer._defaults = self._saved
        return False


def _check_attrs(attrs: Mapping[str, Any]) -> None:
    unknown = attrs.keys() - set(SPAN_ATTRS)
    if unknown:
        raise TypeError(f"unknown span attributes {sorted(unknown)}; allowed: {SPAN_ATTRS}")


def _build_window_batch(records: list, clock: Any, calib: tuple[int, int] | None):
    """Columns of one flushed window (plus an optional calibration row) as a batch."""
    cols: dict[str, list] = {c: [] for c in ("name", "cat", "start_ns", "end_ns", "iteration", *SPAN_ATTRS)}
    markers = []
    for k, (name, cat, start, end, iteration, attrs) in enumerate(records):
        if k % _RECORDS_PER_GIL_SLICE == 0:
            # Hand the GIL back between slices so the training thread, which launches
            # the next step meanwhile, never waits a whole switch interval for it.
            time.sleep(0)
        cols["name"].append(name)
        cols["cat"].append(cat)
        cols["start_ns"].append(clock.to_ns(start))
        cols["end_ns"].append(clock.to_ns(end))
        cols["iteration"].append(iteration)
        for key, value in zip(SPAN_ATTRS, attrs):
            cols[key].append(value)
        markers += (start, end)
    if calib is not None:
        for key, value in zip(cols, ("clock", CAT_CALIB, calib[0], calib[1], -1, *_ATTR_DEFAULTS)):
            cols[key].append(value)
    clock.release(markers)
    return build_event_batch_from_columns(cols)


class _BackgroundWriter:
    """One thread that owns the TraceWriter: converts windows and appends them.

    The queue holds at most `max_pending` windows; `submit` never blocks: a window that does
    not fit is dropped (its CUDA events go back to the pool) and counted."""

    def __init__(self, writer: TraceWriter, clock: Any, max_pending: int) -> None:
        self._writer, self._clock = writer, clock
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self.dropped_windows = self.dropped_events = 0
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
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue
            records, calib = job
            try:
                calib = calib or self._clock.calibration_pair()
                self._writer.append(_build_window_batch(records, self._clock, calib))
            except Exception as exc:  # keep training alive; close() reports it
                self.error = exc
                warnings.warn(f"MegaScan writer for {self._writer.path} failed: {exc!r}", stacklevel=1)

    def close(self) -> None:
        self._queue.put(None)  # blocks until there is room: the writer drains what is queued
        self._thread.join()
        self._writer.close()


def _complete_meta(meta: Mapping[str, Any], clock_name: str, device: Any) -> dict:
    full = dict(meta)
    full.setdefault("schema_version", SCHEMA_VERSION)
    full.setdefault("host", socket.gethostname())
    full.setdefault("run_id", "")
    full.setdefault("run", {})
    full["clock"] = clock_name
    if "device" not in full:
        if clock_name == "cuda":
            import torch

            full["device"] = torch.cuda.get_device_name(device)
        else:
            full["device"] = "cpu"
    return full


class Tracer:
    """Records spans of traced iterations of one rank into `trace_dir/rankNNNNN.mscan`.

    `meta` needs rank, world_size, coords and layout (see format.build_rank_meta);
    host, device, clock and schema_version are filled in. `device` selects the clock:
    a CUDA device uses CUDA events, anything else the host monotonic clock."""

    def __init__(self, config: TraceConfig, meta: Mapping[str, Any], device: Any = "cpu") -> None:
        self.config = config
        self._active = False
        self._layers_active = False
        self._iteration = -1
        self._defaults: dict = {}
        self._records: list = []
        self._last_flush = time.monotonic()
        self._step_span: _Span | None = None
        self._background: _BackgroundWriter | None = None
        self.dropped_events = 0  # events lost because the writer queue was full (final at close)
        self.meta = dict(meta)
        if not config.enabled:
            return
        is_cuda = str(device).startswith("cuda")
        self._clock = _CudaClock(device, config.clock_skew_ns) if is_cuda else _MonotonicClock(config.clock_skew_ns)
        self.meta = _complete_meta(meta, self._clock.name, device)
        path = Path(config.trace_dir) / trace_file_name(int(self.meta["rank"]))
        writer = TraceWriter(path, self.meta)
        self.path = path
        self._background = _BackgroundWriter(writer, self._clock, config.max_pending_windows)
        # Start-of-run calibration pair, taken here: no step is running yet.
        self._background.submit([], self._clock.calibration_pair())

    @property
    def enabled(self) -> bool:
        return self._background is not None

    @property
    def active(self) -> bool:
        """True while inside a traced iteration (spans are being recorded)."""
        return self._active

    def should_trace(self, iteration: int) -> bool:
        """Whether `iteration` is recorded (see TraceConfig.should_trace)."""
        return self._background is not None and self.config.should_trace(iteration)

    def step_begin(self, iteration: int) -> None:
        """Start iteration `iteration`; opens its "iteration" step span if traced."""
        self._iteration = iteration
        self._active = self.should_trace(iteration)
        self._layers_active = self._active and self.config.granularity == "full"
        if self._active:
            self._step_span = _Span(self, ITERATION, CAT_STEP, _ATTR_DEFAULTS).start()

    def step_end(self, iteration: int) -> None:
        """End iteration `iteration`; after the last one of a window, hand its records
        to the background writer (never waits for the device here)."""
        if not self._active:
            return
        if iteration != self._iteration:
            raise ValueError(f"step_end({iteration}) does not match step_begin({self._iteration})")
        self._step_span.finish()
        self._step_span = None
        self._active = self._layers_active = False
        window_done = iteration % self.config.interval == self.config.continuous_iterations - 1
        due = (time.monotonic() - self._last_flush >= self.config.flush_seconds
               or len(self._records) >= _FLUSH_RECORDS)
        if window_done and due:
            self._flush()

    def cancel_step(self) -> None:
        """Close the current iteration without recording it (its spans are dropped too): for
        the unfinished tail of a program, whose teardown is not an iteration."""
        if self._active:
            dropped = [r for r in self._records if r[4] == self._iteration]
            self._records = [r for r in self._records if r[4] != self._iteration]
            self._clock.release([m for r in dropped for m in (r[2], r[3])])
        self._step_span = None
        self._active = self._layers_active = False

    @contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """`with tracer.step(i):` is step_begin(i) ... step_end(i), for plain scripts."""
        self.step_begin(iteration)
        try:
            yield
        finally:
            self.step_end(iteration)

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        records, self._records = self._records, []
        if records:
            self._background.submit(records)

    def _open(self, name: str, cat: str, attrs: dict) -> _Span:
        if cat not in _SPAN_CATEGORIES:
            raise ValueError(f"span category must be one of {_SPAN_CATEGORIES}, got {cat!r}")
        if attrs:
            _check_attrs(attrs)
        merged = {**self._defaults, **attrs} if self._defaults else attrs
        values = tuple(merged.get(k, d) for k, d in zip(SPAN_ATTRS, _ATTR_DEFAULTS))
        return _Span(self, name, cat, values)

    def span(self, name: str, cat: str = "compute", **attrs: Any):
        """Context manager timing `name`; attrs from SPAN_ATTRS, defaults from context()."""
        if not self._active:
            return NOOP_SPAN
        return self._open(name, cat, attrs)

    def layer_span(self, name: str, layer: int, **attrs: Any):
        """Like span() but recorded only with granularity "full" (per-layer detail)."""
        if not self._layers_active:
            return NOOP_SPAN
        return self._open(name, "compute", {**attrs, "layer": layer})

    def context(self, **attrs: Any):
        """Context manager giving spans opened inside it these default attributes."""
        if not self._active:
            return NOOP_SPAN
        _check_attrs(attrs)
        return _Context(self, attrs)

    def record_comm(self, op: str, *, group: str, seq: int, peer: int = -1, bytes: int = -1):
        """Open a comm span started now; the caller calls `.finish()` when the op is done.
        Returns the no-op span outside traced iterations."""
        if not self._active:
            return NOOP_SPAN
        return self._open(op, CAT_COMM, {"op": op, "group": group, "seq": seq, "peer": peer, "bytes": bytes}).start()

    def close(self) -> None:
        """Flush what was recorded, write the end-of-stream marker and stop the writer
        thread; raises RuntimeError if writing failed. Idempotent."""
        if self._background is None:
            return
        if self._step_span is not None:
            self._step_span.finish()
        self._active = self._layers_active = False
        self._flush()
        background, self._background = self._background, None
        background.close()
        self.dropped_events = background.dropped_events
        if background.dropped_windows:
            warnings.warn(f"MegaScan dropped {background.dropped_events} events ({background.dropped_windows} windows) "
                          f"of {self.path}: the writer could not keep up", stacklevel=2)
        if background.error is not None:
            raise RuntimeError(f"MegaScan could not write {self.path}: {background.error!r}") from background.error

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
