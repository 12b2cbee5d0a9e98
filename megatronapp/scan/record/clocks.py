"""The tracer's timelines: where a span's timestamps come from and how they become nanoseconds.

On CPU a timestamp is `time.monotonic_ns()`; on CUDA it is a pooled `torch.cuda.Event`
recorded on the current stream, converted to nanoseconds later (off the training thread)
against an anchor event. Both also give calibration pairs (device ns, wall-clock ns) for
alignment (see format.py). `build_clock` picks one for a device.
"""

from __future__ import annotations

import time
from typing import Any

INITIAL_EVENT_POOL = 4096  # CUDA timing events made at start (two per span)


class MonotonicClock:
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

    def wait_recorded(self, markers: list) -> None:
        pass  # a host timestamp exists once taken

    def calibration_pair(self) -> tuple[int, int]:
        # Keep the tightest of a few monotonic brackets around the wall read, so a
        # preemption between the two clock reads does not become a clock offset.
        best = None
        for _ in range(5):
            before, wall, after = time.monotonic_ns(), time.time_ns(), time.monotonic_ns()
            if best is None or after - before < best[0]:
                best = (after - before, (before + after) // 2, wall)
        return best[1] + self._skew, best[2] + self._skew


class CudaClock:
    """GPU timeline: pooled timing events, converted against an anchor event whose
    host monotonic time was taken while the device was idle (at construction)."""

    name = "cuda"

    def __init__(self, device: Any, skew_ns: int) -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device)
        # Creating an event inside a step costs a driver call (torch creates the CUDA event
        # lazily, at its first record), so make a stock now: record each once, off-step.
        self._pool = [torch.cuda.Event(enable_timing=True) for _ in range(INITIAL_EVENT_POOL)]
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
        self._device_index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._current_stream = torch._C._cuda_getCurrentStream
        self._record = torch._C._CudaEventBase.record  # the C methods, without the Python wrappers
        self._elapsed = torch._C._CudaEventBase.elapsed_time
        self._streams: dict[int, Any] = {}

    def mark(self) -> Any:
        event = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        # Event.record() with no stream builds a Python Stream through current_stream() at every
        # call (~40 Python calls, most of full granularity's host cost on a launch-bound model):
        # look the current stream's id up in C and record on a cached Stream object instead.
        stream_id, device_index, device_type = self._current_stream(self._device_index)
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = self._torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        self._record(event, stream)
        return event

    def wait_recorded(self, events: list) -> None:
        """Sleep until the GPU has passed the last of `events` (the last recorded: on one stream
        the others are done then; one on another stream still running is waited for by to_ns).
        Event.synchronize would spin a core for as long as the GPU runs behind the host (the
        default CUDA scheduling of a host thread), which the writer's CPU time
        (BackgroundWriter.cost) would then count as its work."""
        if events:
            self._sleep_until_done(events[-1])

    def to_ns(self, event: Any) -> int:
        # One driver call per mark when it is done (the writer's case, after wait_recorded);
        # a query or a synchronize first would make it three.
        try:
            elapsed_ms = self._elapsed(self._anchor, event)
        except RuntimeError:  # not completed yet (cudaErrorNotReady)
            self._sleep_until_done(event)
            elapsed_ms = self._elapsed(self._anchor, event)
        return self._anchor_ns + round(elapsed_ms * 1e6)

    @staticmethod
    def _sleep_until_done(event: Any, poll_s: float = 2e-4) -> None:
        while not event.query():
            time.sleep(poll_s)

    def release(self, events: list) -> None:
        # Once each: adjacent spans can share a mark (Tracer.layer_span(after=...)), and an
        # event twice in the pool would be recorded for two spans at once.
        self._pool.extend({id(e): e for e in events}.values())

    def calibration_pair(self) -> tuple[int, int]:
        torch = self._torch
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self._device), torch.cuda.stream(self._calib_stream):
            event.record()
            wall = time.time_ns()
        return self.to_ns(event), wall + self._skew


def build_clock(device: Any, skew_ns: int) -> MonotonicClock | CudaClock:
    """CUDA events for a CUDA device, the host monotonic clock for anything else."""
    return CudaClock(device, skew_ns) if str(device).startswith("cuda") else MonotonicClock(skew_ns)
