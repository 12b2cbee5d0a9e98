"""A truncated rank file is merged up to its last complete batch and reported as one note line,
not as a Python warning with its source line; the file itself is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from scan_simulation import SimulatedJob, simulate_job_traces

from megatronapp.scan.record.format import TraceWriter, trace_file_name


@pytest.fixture(scope="module")
def truncated_trace_dir(tmp_path_factory) -> tuple[Path, Path]:
    path = tmp_path_factory.mktemp("trace")
    job = SimulatedJob(tp_size=1, pp_size=2, dp_size=1, iterations=4, num_microbatches=2, seed=3)
    for t in simulate_job_traces(job):
        with TraceWriter(path / trace_file_name(t.rank), t.meta) as w:
            for batch in t.events.to_batches(max_chunksize=37):
                w.append(batch)
    victim = path / trace_file_name(1)
    victim.write_bytes(victim.read_bytes()[:-300])  # a crash mid-batch
    return path, victim


def _megatronapp(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatronapp.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("command", ["merge", "detect", "report"])
def test_a_truncated_trace_is_one_note_line(truncated_trace_dir, tmp_path, command):
    trace_dir, victim = truncated_trace_dir
    before = victim.read_bytes()
    args = {
        "merge": ["merge", str(trace_dir), "-o", str(tmp_path / "t.json")],
        "detect": ["detect", str(trace_dir)],
        "report": ["report", str(trace_dir), "--out", str(tmp_path / "report.html")],
    }[command]
    res = _megatronapp("trace", *args)
    assert res.returncode in (0, 3), res.stderr  # detect: 3 when it names a suspect
    assert res.stderr == ""
    notes = [line for line in res.stdout.splitlines() if line.startswith("note: ") and str(victim) in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: {victim}: truncated stream ("), res.stdout
    assert notes[0].endswith("complete batches")
    assert "Warning" not in res.stdout
    assert victim.read_bytes() == before
