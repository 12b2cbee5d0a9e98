"""How the link probe measures (`ProbeConfig`, the one source of its defaults, and the flags that
set it), when a traced job runs it, and the probe.json file it leaves in the trace directory.

probe.json holds every directed link's measurement (`links`, probe.LinkMeasurement fields), or,
when the probe was meant to run and could not, `error` saying why; detection reads it
(analyze/link_probe_verdicts.py). No torch here: the analysis reads the file without a job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatronapp.files import write_text_atomic
from megatronapp.flags import Flag

PROBE_FILE = "probe.json"
PROBE_MODES = ("off", "auto", "on")  # auto: when the job has point-to-point traffic


@dataclass(frozen=True)
class ProbeConfig:
    """One ping-pong per directed link: `payload_mb` MB one way, the fastest of `repeats` round
    trips; the whole probe gives up after `timeout_s` (a dead or stuck rank)."""

    payload_mb: float = 4.0
    repeats: int = 5
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.payload_mb <= 1024:
            raise ValueError(f"--probe-payload-mb must be in (0, 1024] MB, got {self.payload_mb}")
        if self.repeats < 1:
            raise ValueError(f"--probe-repeats must be >= 1, got {self.repeats}")
        if self.timeout_s <= 0:
            raise ValueError(f"probe timeout must be > 0 s, got {self.timeout_s}")

    @property
    def payload_bytes(self) -> int:
        return max(1, int(self.payload_mb * 1e6))


PROBE_FLAGS = (
    Flag("--probe-payload-mb", "payload_mb", "bytes sent one way per link and round trip", {"metavar": "MB"}),
    Flag("--probe-repeats", "repeats", "timed round trips per link (the fastest counts)", {"metavar": "N"}),
)


@dataclass(frozen=True)
class ProbeResult:
    """What probe.json says: every directed link's measurement (dicts of LinkMeasurement's fields),
    or why the probe could not run."""

    links: tuple[dict, ...] = ()
    error: str = ""


def save_probe(path: str | Path, links: list[dict], error: str = "", **extra) -> None:
    """Write a probe result (TRACE_DIR/probe.json, or `trace probe --out`) atomically."""
    doc = {"links": links, **({"error": error} if error else {}), **extra}
    write_text_atomic(path, json.dumps(doc, indent=1))


def load_probe(trace_dir: str | Path) -> ProbeResult | None:
    """probe.json of `trace_dir`, or None when there is none; ValueError (one line) when it cannot be read."""
    path = Path(trace_dir) / PROBE_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        links = tuple(dict(m) for m in doc.get("links", []))
        if any(not {"src", "dst", "kind", "mbytes_per_s"} <= m.keys() for m in links):
            raise ValueError("a link lacks src, dst, kind or mbytes_per_s")
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path}: not a link probe result ({exc})") from None
    return ProbeResult(links, str(doc.get("error", "")))
