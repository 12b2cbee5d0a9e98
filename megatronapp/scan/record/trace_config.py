"""When and how much MegaScan traces: `TraceConfig`, the one source of the tracer's defaults,
and the flags that set it (`train` and `trace run` share them)."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.flags import Flag
from megatronapp.scan.probe_config import PROBE_MODES

GRANULARITIES = ("base", "full")


@dataclass(frozen=True)
class TraceConfig:
    """When and how much to trace.

    Windows of `continuous_iterations` consecutive iterations start at iterations
    `interval`, 2*`interval`, ... (the first one after warm-up, never iteration 0).
    `granularity` "full" also records per-layer attention/mlp spans.
    `clock_skew_ns` is a testing knob added to every timestamp of this rank.
    `probe`: measure every link after the last iteration (scan/probe_job.py) "on", "off", or
    "auto", when the job has point-to-point traffic."""

    enabled: bool = False
    trace_dir: str = "runs/trace"
    interval: int = 1
    continuous_iterations: int = 1
    granularity: str = "base"
    clock_skew_ns: int = 0
    probe: str = "auto"
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
                f"continuous_iterations must be in 1..interval ({self.interval}), got {self.continuous_iterations}"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.probe not in PROBE_MODES:
            raise ValueError(f"--trace-probe must be one of {PROBE_MODES}, got {self.probe!r}")
        if self.enabled and not self.trace_dir:
            raise ValueError("tracing is enabled but trace_dir is empty: set a directory for the .mscan files")

    def should_trace(self, iteration: int) -> bool:
        """True for iterations k*interval .. k*interval + continuous_iterations - 1, k >= 1."""
        return self.enabled and iteration >= self.interval and iteration % self.interval < self.continuous_iterations


# The flags that set TraceConfig's fields (their defaults are the fields'); `train` also takes the
# switch, `trace run` always traces.
TRACE_SWITCH = Flag("--trace", "enabled", "record a MegaScan trace of every rank", {"action": "store_true"})
TRACE_FLAGS = (
    Flag("--trace-dir", "trace_dir", "where rank*.mscan and timeline.json go"),
    Flag("--trace-interval", "interval", "trace K iterations every N (iteration 0 never)"),
    Flag("--continuous-trace-iterations", "continuous_iterations", "K above"),
    Flag(
        "--trace-granularity",
        "granularity",
        "full: also per-layer spans (train: attention and MLP; trace run: every module's forward and backward)",
        {"choices": GRANULARITIES},
    ),
    Flag(
        "--trace-probe",
        "probe",
        "measure every link's bandwidth after the last iteration into TRACE_DIR/probe.json "
        "(auto: when the job sends point-to-point messages)",
        {"choices": PROBE_MODES},
    ),
)
