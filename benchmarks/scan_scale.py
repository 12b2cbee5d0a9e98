"""MegaScan cost and scale on CPU: bytes per event on disk, merge speed, 1,024-rank analysis.

    python benchmarks/scan_scale.py --repeats 3 --out /tmp/scan_scale.json

  * bytes/event: simulated TP2xPP2xDP2 job (40 iterations, 8 microbatches) written per rank
    through format.TraceWriter, one record batch per iteration (flush_seconds=0, the worst
    case) and one per 10 iterations; file bytes / events, all files together.
  * merge: merge_traces on that directory (one process, one thread), events/s, repeated.
  * 1,024 ranks: TP8xPP4xDP32 simulated, 3 iterations: align + detect wall time, repeated.
Repeats are interleaved; median and (min, max) are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests" / "support")
)  # the trace simulator lives with the tests

from scan_simulation import SimulatedJob, simulate_job_traces

from megatronapp.scan.analyze.load_align_detect import analyze_traces
from megatronapp.scan.merge.merge import merge_traces
from megatronapp.scan.record.format import TraceWriter, filter_iterations, trace_file_name


def write_traces(traces, trace_dir: Path, iterations_per_batch: int, iterations: int) -> tuple[int, int]:
    """Write each rank's events, one batch per `iterations_per_batch`; returns (events, bytes)."""
    events = 0
    for t in traces:
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            for first in range(0, iterations, iterations_per_batch):
                part = filter_iterations(t.events, range(first, first + iterations_per_batch))
                w.append(part.combine_chunks().to_batches()[0] if part.num_rows else [])
        events += t.events.num_rows
    size = sum(os.path.getsize(p) for p in trace_dir.glob("rank*.mscan"))
    return events, size


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    job = SimulatedJob(tp_size=2, pp_size=2, dp_size=2, iterations=40, num_microbatches=8, seed=3)
    traces = simulate_job_traces(job)
    big = simulate_job_traces(SimulatedJob(tp_size=8, pp_size=4, dp_size=32, iterations=3, seed=11))
    results: dict = {"bytes_per_event": {}, "merge_events_per_s": [], "analyze_1024_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        for per_batch in (1, 10):
            d = Path(tmp) / f"b{per_batch}"
            d.mkdir()
            events, size = write_traces(traces, d, per_batch, job.iterations)
            results["bytes_per_event"][f"batch_per_{per_batch}_iterations"] = round(size / events, 1)
        for _ in range(args.repeats):  # interleaved
            summary = merge_traces(Path(tmp) / "b10", Path(tmp) / "timeline.json")
            results["merge_events_per_s"].append(summary.events / summary.seconds)
            t0 = time.perf_counter()
            analyze_traces(big)
            results["analyze_1024_s"].append(time.perf_counter() - t0)
    results["merge_events_per_s"] = summarize(results["merge_events_per_s"])
    results["analyze_1024_s"] = summarize(results["analyze_1024_s"])
    results["merge_events"] = summary.events
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
