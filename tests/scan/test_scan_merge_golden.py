"""The merged timeline's bytes are pinned: a speed-up of the streaming merge (merge.py,
merge_window.py, chrome.py, fixed_lines.py, stream.py) must write exactly what it wrote before.

The golden file tests/fixtures/scan_merge_golden.json.gz was written by the merge of 2026-12-03
(before the merge-speed work) from the job below: a 2x2x2 simulated job with a slowed rank,
every rank's clock skewed (so alignment moves times), merged in windows of 150 rows (so
messages cross windows). The timing fields of "otherData" are left out of the comparison.
Regenerate it only for an intended format change:

    PYTHONPATH=.:tests/support python tests/scan/test_scan_merge_golden.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from scan_simulation import SimulatedJob, simulate_job_traces

import megatronapp.scan.merge.merge as merge
from megatronapp.scan.record.format import TraceWriter, trace_file_name

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "scan_merge_golden.json.gz"
WINDOW_EVENTS = 150
_TIMING = ("seconds", "events_per_s")


def _write_skewed_job(path: Path) -> Path:
    job = SimulatedJob(
        tp_size=2, pp_size=2, dp_size=2, iterations=4, num_microbatches=3, seed=11, slow_rank=5, slow_factor=1.4
    )
    skew = np.random.default_rng(3).integers(-20_000_000, 20_000_000, job.world_size)
    path.mkdir(parents=True, exist_ok=True)
    for t in simulate_job_traces(job):
        events = t.events
        for name in ("start_ns", "end_ns"):  # device and wall clock alike: only the trace reveals the skew
            shifted = pa.array(events.column(name).to_numpy() + skew[t.rank], pa.int64())
            index = events.schema.get_field_index(name)
            events = events.set_column(index, events.schema.field(index), shifted)
        with TraceWriter(path / trace_file_name(t.rank), t.meta) as w:
            for batch in events.to_batches(max_chunksize=53):
                w.append(batch)
    return path


def _without_timing(text: bytes) -> tuple[bytes, dict]:
    """(the trace events' bytes, otherData without the merge's timing fields)."""
    head, sep, tail = text.rpartition(b'\n], "displayTimeUnit"')
    assert sep, "not a merged timeline"
    other = json.loads(b"{" + tail.split(b",", 1)[1])["otherData"]
    for key in _TIMING:
        other["megascan"]["merge"].pop(key)
    return head, other


def _merged(tmp_path: Path, output: str = "timeline.json") -> bytes:
    trace_dir = _write_skewed_job(tmp_path / "trace")
    merge.merge_traces(trace_dir, tmp_path / output)
    data = (tmp_path / output).read_bytes()
    return gzip.decompress(data) if output.endswith(".gz") else data


@pytest.mark.parametrize("output", ["timeline.json", "timeline.json.gz"])
def test_merged_timeline_bytes_equal_the_golden_file(tmp_path, monkeypatch, output):
    monkeypatch.setattr(merge, "WINDOW_EVENTS", WINDOW_EVENTS)
    monkeypatch.setattr(merge._OutputFile, "DROP_EVERY", 4096)  # page-cache drops between writes, too
    monkeypatch.setattr(merge._OutputFile, "DROP_LAG", 1024)
    got_events, got_other = _without_timing(_merged(tmp_path, output))
    want_events, want_other = _without_timing(gzip.decompress(GOLDEN.read_bytes()))
    assert got_other == want_other
    assert got_other["megascan"]["merge"]["flows"] > 0 and got_other["megascan"]["alignment"]["anchors"] > 0
    if got_events != want_events:  # name the first line that differs, not a megabyte diff
        for k, (got, want) in enumerate(zip(got_events.split(b"\n"), want_events.split(b"\n"))):
            assert got == want, f"line {k} differs"
        assert len(got_events) == len(want_events)


if __name__ == "__main__":
    import tempfile

    merge.WINDOW_EVENTS = WINDOW_EVENTS
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_bytes(gzip.compress(_merged(Path(tmp)), mtime=0))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
