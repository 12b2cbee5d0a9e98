"""Iterations joined across ranks by the collectives and messages they share (iteration_keys.py):
pure tests over simulated traces, and a traced 4-rank DDP script whose slow rank counted its
iterations ahead of its peers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from scan_simulation import SimulatedJob, simulate_job_traces

from megatronapp.scan.analyze.detect_output import render_report
from megatronapp.scan.analyze.iteration_keys import align_iterations, compute_iteration_alignment
from megatronapp.scan.analyze.load_align_detect import analyze_traces
from megatronapp.scan.record.format import RankTrace, build_event_batch, build_rank_meta

ROOT = Path(__file__).resolve().parents[2]


def _shift(trace: RankTrace, by: int) -> RankTrace:
    its = trace.events.column("iteration").to_numpy()
    moved = pa.array(np.where(its >= 0, its + by, its).astype(np.int32))
    index = trace.events.schema.get_field_index("iteration")
    return dataclasses.replace(trace, events=trace.events.set_column(index, "iteration", moved))


def test_pair_offsets_give_each_rank_its_shift_and_the_majority_keeps_its_numbers():
    assert compute_iteration_alignment([0, 1, 2, 3], {(0, 1): 0, (1, 2): -3, (2, 3): 3}).shifts == {
        0: 0, 1: 0, 2: 3, 3: 0,
    }  # fmt: skip
    two_groups = compute_iteration_alignment([0, 1, 2, 3], {(0, 1): 0, (1, 2): 0})
    assert two_groups.unjoined == (3,) and "ranks [3] share no collective or message" in two_groups.notes[0]
    assert compute_iteration_alignment([0], {}).notes == ()


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 2, 2)], ids=["dp4", "tp2-pp2-dp2"])
def test_a_rank_counting_ahead_is_rekeyed_by_shared_collectives_and_messages(layout):
    tp, pp, dp = layout
    traces = simulate_job_traces(SimulatedJob(tp_size=tp, pp_size=pp, dp_size=dp, iterations=5, seed=2))
    moved = [_shift(t, 3) if t.rank == 2 else t for t in traces]
    keyed, alignment = align_iterations(moved)
    assert alignment.shifts == {r: 3 if r == 2 else 0 for r in range(tp * pp * dp)} and alignment.unjoined == ()
    assert "rank 2 counted 3 ahead" in alignment.notes[0]
    for got, want in zip(keyed, traces):
        assert got.events.column("iteration").to_pylist() == want.events.column("iteration").to_pylist()


def _compute_only_trace(rank: int, forward_ms: float) -> RankTrace:
    meta = build_rank_meta(
        rank=rank, world_size=2, coords={"tp": 0, "dp": rank, "pp": 0},
        layout={"tp_size": 1, "pp_size": 1, "dp_size": 2}, host="h", device="cpu", run_id="t", clock="monotonic",
    )  # fmt: skip
    rows, t = [], 1_000_000
    for it in range(1, 7):
        fwd = int(forward_ms * 1e6)
        rows.append({"name": "iteration", "cat": "step", "start_ns": t, "end_ns": t + fwd + 10, "iteration": it})
        rows.append({"name": "forward", "cat": "compute", "start_ns": t + 5, "end_ns": t + 5 + fwd, "iteration": it})
        t += fwd + 1000
    return RankTrace(meta=meta, events=pa.Table.from_batches([build_event_batch(rows)]))


def test_ranks_sharing_no_collective_get_a_note_not_a_clean_verdict():
    report = analyze_traces([_compute_only_trace(0, 5.0), _compute_only_trace(1, 5.0)]).detection
    assert report.unjoined_ranks == (0, 1)
    assert any("share no collective or message" in n and "could not be aligned" in n for n in report.notes)
    text = render_report(report, width=200)
    assert "No slow rank or slow link found" not in text and "No verdict" in text


def _trace_ddp_script(trace_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLOW_RANK": "2", "LOCAL_STEPS": "3"}
    command = [sys.executable, "-m", "megatronapp.cli.main", "trace", "run", "--nproc-per-node", "4"]
    command += ["--trace-dir", str(trace_dir), "--json", "--", "tests/scan/scripts/ddp_local_steps.py", "--steps", "16"]
    command += ["--extra", "10"]  # about 2.6x its peers' forward: clear of four ranks sharing two cores
    return subprocess.run(command, capture_output=True, text=True, timeout=480, env=env, cwd=ROOT)


@pytest.mark.slow
def test_a_slow_rank_that_ran_local_steps_before_ddp_is_named(tmp_path):
    res = _trace_ddp_script(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout[res.stdout.index("{") :])
    assert report["suspects"] and report["suspects"][0]["rank"] == 2, report
    assert any("rank 2 counted 3 ahead" in n for n in report["notes"]), report["notes"]
