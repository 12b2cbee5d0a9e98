"""MegaScan's recorder: cheap spans on the training thread, file I/O on a background one.

The training thread only takes timestamps (clocks.py). After the last step of a traced
window the raw records go to one background thread (trace_writer.py), which waits for the
events, turns them into nanoseconds on one device timeline, and appends a record batch to
this rank's file (see format.py). Tracing adds no collective and touches only this rank's file.

Beside each span's timestamps the training thread takes its own CPU time (so a span that
waited reads CPU << wall, one that computed CPU ~ wall; per-layer spans go without), and at each traced iteration's start
and end the scheduler's and cgroup's counters (sched.py): the iteration's span carries what the
operating system took from the thread (run-queue delay, involuntary switches, CPU throttling).

When tracing is off, or the iteration is not traced, `span()` returns one shared
no-op context manager: the cost is an attribute check.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatronapp.scan.record.clocks import INITIAL_EVENT_POOL, build_clock
from megatronapp.scan.record.format import SCHEMA_VERSION, TraceWriter, trace_file_name
from megatronapp.scan.record.sched import SchedCounters, counter_deltas
from megatronapp.scan.record.trace_config import GRANULARITIES, TraceConfig
from megatronapp.scan.record.trace_writer import ATTR_DEFAULTS, SPAN_ATTRS, BackgroundWriter, WriterCost
from megatronapp.spans import CAT_CALIB, CAT_COMM, CAT_STEP, CAT_USER, CATEGORIES, ITERATION

__all__ = ["GRANULARITIES", "NOOP_SPAN", "SPAN_ATTRS", "TraceConfig", "Tracer"]

_SPAN_CATEGORIES = tuple(c for c in CATEGORIES if c != CAT_CALIB)
# Hand a window to the writer once this many spans are waiting, whatever flush_seconds says:
# on CUDA that returns events to the pool before it runs dry (a new event costs a driver
# call inside the step); on CPU it bounds memory.
_FLUSH_RECORDS = INITIAL_EVENT_POOL // 4
_LAYER = SPAN_ATTRS.index("layer")
_thread_time_ns, _thread_id = time.thread_time_ns, threading.get_ident


class _NoOpSpan:
    """Shared stand-in when nothing is recorded; must stay stateless."""

    __slots__ = ()

    def __enter__(self) -> _NoOpSpan:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def finish(self) -> None:
        pass


NOOP_SPAN = _NoOpSpan()


class _Span:
    """One open span; `finish()` (or leaving the `with`) records its end."""

    __slots__ = ("_tracer", "_name", "_cat", "_attrs", "_iteration", "_start", "_end", "_done", "_cpu", "_thread")

    def __init__(self, tracer: Tracer, name: str, cat: str, attrs: tuple, cpu_time: bool = True) -> None:
        self._tracer, self._name, self._cat, self._attrs = tracer, name, cat, attrs
        # Captured at open: an async op may finish during a later iteration.
        self._iteration = tracer._iteration
        self._start = self._end = None
        self._done = False
        self._cpu = 0 if cpu_time else None
        self._thread = None

    def start(self) -> _Span:
        if self._start is None:  # else set by layer_span(after=...)
            self._start = self._tracer._clock.mark()
        if self._cpu is not None:  # the thread CPU clock is a system call (~1 us), not a vDSO read
            self._thread, self._cpu = _thread_id(), _thread_time_ns()
        return self

    def finish(self, counters: tuple | None = None) -> None:
        """Record the span; `counters`: the iteration's sched.SIGNALS deltas (its step span only)."""
        if self._done or self._start is None:
            return
        self._done = True
        # CPU time of the thread that opened the span; unknown when another thread closes it
        # (an async op's Work waited on elsewhere).
        cpu_ns = _thread_time_ns() - self._cpu if self._thread is not None and _thread_id() == self._thread else -1
        self._end = end = self._tracer._clock.mark()
        record = (self._name, self._cat, self._start, end, self._iteration, self._attrs, cpu_ns, counters)
        self._tracer._records.append(record)

    def __enter__(self) -> _Span:
        return self.start()

    def __exit__(self, *exc: object) -> bool:
        self.finish()
        return False


class _Context:
    """Sets default span attributes for everything recorded inside it."""

    __slots__ = ("_tracer", "_attrs", "_saved")

    def __init__(self, tracer: Tracer, attrs: dict) -> None:
        self._tracer, self._attrs, self._saved = tracer, attrs, None

    def __enter__(self) -> _Context:
        self._saved = self._tracer._defaults
        self._tracer._set_defaults({**self._saved, **self._attrs})
        return self

    def __exit__(self, *exc: object) -> bool:
        self._tracer._set_defaults(self._saved)
        return False


def _attr_values(attrs: Mapping[str, Any]) -> tuple:
    """`attrs` in SPAN_ATTRS order, defaults where missing (the record's attribute tuple)."""
    return tuple(attrs.get(k, d) for k, d in zip(SPAN_ATTRS, ATTR_DEFAULTS))


def _check_attrs(attrs: Mapping[str, Any]) -> None:
    unknown = attrs.keys() - set(SPAN_ATTRS)
    if unknown:
        raise TypeError(f"unknown span attributes {sorted(unknown)}; allowed: {SPAN_ATTRS}")


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
        self._default_values = ATTR_DEFAULTS  # _defaults in SPAN_ATTRS order
        self._records: list = []
        self._last_flush = time.monotonic()
        self._step_span: _Span | None = None
        self._step_counters: tuple | None = None  # sched counters at the traced iteration's start
        self._sched: SchedCounters | None = None
        self._background: BackgroundWriter | None = None
        self.dropped_events = 0  # events lost because the writer queue was full (final at close)
        self.writer_cost = WriterCost()  # the writer thread's CPU time (final at close)
        self.meta = dict(meta)
        if not config.enabled:
            return
        self._clock = build_clock(device, config.clock_skew_ns)
        self.meta = _complete_meta(meta, self._clock.name, device)
        path = Path(config.trace_dir) / trace_file_name(int(self.meta["rank"]))
        writer = TraceWriter(path, self.meta)
        self.path = path
        self._background = BackgroundWriter(writer, self._clock, config.max_pending_windows)
        self._sched = SchedCounters()
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
            self._step_counters = self._sched.sample()
            self._step_span = _Span(self, ITERATION, CAT_STEP, ATTR_DEFAULTS).start()

    def step_end(self, iteration: int) -> None:
        """End iteration `iteration`; after the last one of a window, hand its records
        to the background writer (never waits for the device here)."""
        if not self._active:
            return
        if iteration != self._iteration:
            raise ValueError(f"step_end({iteration}) does not match step_begin({self._iteration})")
        self._step_span.finish(counter_deltas(self._step_counters, self._sched.sample()))
        self._step_span = None
        self._active = self._layers_active = False
        window_done = iteration % self.config.interval == self.config.continuous_iterations - 1
        due = time.monotonic() - self._last_flush >= self.config.flush_seconds or len(self._records) >= _FLUSH_RECORDS
        if window_done and due:
            self._flush()

    def mark_iteration(self, iteration: int, label: str, **attrs: Any) -> None:
        """A zero-length "user" span named `label k=v ...` in traced iteration `iteration`,
        marked now (called right after the iteration's work, e.g. a rerun step and its verdict;
        a CUDA clock marks the stream, so it sits where the step's device work ended)."""
        if not self.should_trace(iteration):
            return
        mark = self._clock.mark()
        name = " ".join([label, *(f"{k}={v}" for k, v in attrs.items())])
        self._records.append((name, CAT_USER, mark, mark, iteration, ATTR_DEFAULTS, -1, None))

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

    def wait_writer_idle(self) -> None:
        """Block until the background writer has handled every window handed to it so far;
        records of a window not yet due stay with the tracer (see step_end)."""
        if self._background is not None:
            self._background.wait_idle()

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        records, self._records = self._records, []
        if records:
            self._background.submit(records)

    def _open(self, name: str, cat: str, attrs: dict) -> _Span:
        if cat not in _SPAN_CATEGORIES:
            raise ValueError(f"span category must be one of {_SPAN_CATEGORIES}, got {cat!r}")
        if not attrs:  # the context's attributes, kept as a tuple by _set_defaults
            return _Span(self, name, cat, self._default_values)
        _check_attrs(attrs)
        return _Span(self, name, cat, _attr_values({**self._defaults, **attrs}))

    def span(self, name: str, cat: str = "compute", **attrs: Any):
        """Context manager timing `name`; attrs from SPAN_ATTRS, defaults from context()."""
        if not self._active:
            return NOOP_SPAN
        return self._open(name, cat, attrs)

    def layer_span(self, name: str, layer: int, after: Any = None, **attrs: Any):
        """Like span() but recorded only with granularity "full" (per-layer detail).

        `after`: a layer span of this iteration that has just closed with no device work
        launched since (a layer's attention before its MLP). This span then starts at that
        one's end mark: the same instant, and one CUDA event fewer per pair."""
        if not self._layers_active:
            return NOOP_SPAN
        # Per-layer spans go without CPU time: dozens per step, and their layer's forward or
        # backward span holds it.
        if attrs:
            _check_attrs(attrs)
            values = _attr_values({**self._defaults, **attrs, "layer": layer})
        else:  # the engine's spans: the context's attributes and the layer, without dict work
            d = self._default_values
            values = d[:_LAYER] + (layer,) + d[_LAYER + 1 :]
        span = _Span(self, name, "compute", values, cpu_time=False)
        if type(after) is _Span and after._tracer is self and after._iteration == self._iteration:
            span._start = after._end  # None if it has not closed: start() then takes a mark
        return span

    def _set_defaults(self, defaults: dict) -> None:
        self._defaults = defaults
        self._default_values = _attr_values(defaults)

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
        self._sched.close()
        self.dropped_events, self.writer_cost = background.dropped_events, background.cost
        if background.dropped_windows:
            warnings.warn(
                f"MegaScan dropped {background.dropped_events} events ({background.dropped_windows} windows) "
                f"of {self.path}: the writer could not keep up",
                stacklevel=2,
            )
        if background.error is not None:
            raise RuntimeError(f"MegaScan could not write {self.path}: {background.error!r}") from background.error

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
